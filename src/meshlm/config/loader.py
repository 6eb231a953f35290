"""Presets, dotted key=value overrides and the one-line errors users see."""
from __future__ import annotations

import copy
import os
from importlib import resources
from typing import Any, Iterable

import pydantic
import yaml

from meshlm.config.schema import Config
from meshlm.errors import ConfigError


def preset_names() -> list[str]:
  folder = resources.files("meshlm.config") / "presets"
  return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
  path = resources.files("meshlm.config") / "presets" / f"{name}.yaml"
  if not path.is_file():
    raise ConfigError(f"model={name}: unknown preset; known presets: {', '.join(preset_names())}")
  data = yaml.safe_load(path.read_text()) or {}
  data.setdefault("model_name", name)
  return data


def _parse_value(text: str) -> Any:
  # YAML scalars: 3 -> int, 1e-3 -> float, true/null -> bool/None, [1, 2] -> list, else str.
  try:
    return yaml.safe_load(text) if text != "" else ""
  except yaml.YAMLError:
    return text


def _set(tree: dict, dotted: str, value: Any) -> None:
  keys = dotted.split(".")
  node = tree
  for i, k in enumerate(keys[:-1]):
    nxt = node.get(k)
    if nxt is None:
      nxt = node[k] = {}
    if not isinstance(nxt, dict):
      raise ConfigError(f"{'.'.join(keys[:i + 1])}: is a value, not a section; cannot set {dotted}")
    node = nxt
  node[keys[-1]] = value


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
  out = []
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"{item!r}: expected key=value (for example train.steps=20)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
      raise ConfigError(f"{item!r}: empty key")
    out.append((key, _parse_value(text)))
  return out


def _format_error(err: pydantic.ValidationError) -> str:
  first = err.errors()[0]
  loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
  msg = first["msg"]
  if first["type"] == "extra_forbidden":
    from meshlm.config.keys import suggest
    near = suggest(loc)
    msg = f"unknown key; did you mean {near}? (meshlm train --help lists every key)" if near else \
        "unknown key (meshlm train --help lists every key)"
  elif "input" in first and first["type"] not in ("missing",) and not isinstance(first["input"], dict):
    msg = f"{msg} (got {first['input']!r})"
  msg = msg.removeprefix("Value error, ")
  return f"{loc}: {msg}" if loc else msg


def load_config(*overrides: str, base: dict[str, Any] | None = None) -> Config:
  """Builds a validated Config with its tri-state flags resolved.

  `model=NAME` picks a preset, `model=PATH` a model directory (model_dir_tree; applied first, wherever
  it appears); every other override is a dotted path into the config, applied in order.
  """
  pairs = parse_overrides(overrides)
  name = "llama2-tiny"
  for key, value in pairs:
    if key == "model":
      if not isinstance(value, str):
        raise ConfigError(f"model: expected a preset name or a model directory, got {value!r}")
      name = value
  dir_tree = model_dir_tree(name) if base is None and is_model_path(name) else None
  if base is not None:
    tree = copy.deepcopy(base)
  else:
    tree = copy.deepcopy(dir_tree) if dir_tree is not None else load_preset(name)
  for key, value in pairs:
    if key != "model":
      _set(tree, key, value)
  try:
    cfg = Config.model_validate(tree)
  except pydantic.ValidationError as err:
    raise ConfigError(_format_error(err)) from None
  if dir_tree is not None:
    refuse_shape_overrides(name, dir_tree, pairs)
  return cfg.resolved()


# ----------------------------------------------------------------------------------------------
# model=PATH: a Hugging Face model directory, or a meshlm model or run directory

def is_model_path(value: str) -> bool:
  """A preset name stays a preset; otherwise a value with a '/' or naming something that exists is a path."""
  return value not in preset_names() and ("/" in value or os.path.exists(value))


def model_dir_tree(value: str) -> dict[str, Any]:
  """The config tree model=PATH starts from: the directory's model config, its parameters
  (checkpoint.load_params_from) and its tokenizer.json (data.tokenizer). key=value overrides go on top."""
  path = os.path.abspath(os.path.expanduser(value))
  key = f"model={value}"
  if not os.path.isdir(path):
    raise ConfigError(f"{key}: no such directory (nor a preset: meshlm presets lists them)")
  if os.path.isfile(os.path.join(path, "config.json")):
    from pathlib import Path
    from meshlm.hf.io import model_fields
    name, model = os.path.basename(path), model_fields(Path(path))
  else:
    name, model = _meshlm_model(path, key)
  tree: dict[str, Any] = {"model_name": name, "model": model, "checkpoint": {"load_params_from": path}}
  tokenizer = os.path.join(path, "tokenizer.json")
  if os.path.isfile(tokenizer):
    tree["data"] = {"tokenizer": tokenizer}
  return tree


def _meshlm_model(path: str, key: str) -> tuple[str, dict]:
  """(model_name, model) of a meshlm model dir, run dir or step dir: from the metadata of the step that
  checkpoint.load_params_from will read, else from a config.yaml beside its params."""
  from meshlm.train.checkpoint import _find_step_dir, saved_model
  try:
    step = _find_step_dir(path, key)
  except ConfigError:
    raise ConfigError(f"{key}: not a Hugging Face model directory (no config.json) nor a meshlm model or run "
                      "directory (no params/, <step>/params or checkpoints/<step>/params)") from None
  saved = saved_model(step, key)
  if saved is not None:
    return saved["model_name"], saved["model"]
  raise ConfigError(f"{key}: {step} has params/ but no meta/metadata or config.yaml that says which model")


def refuse_shape_overrides(value: str, tree: dict[str, Any], pairs: list[tuple[str, Any]]) -> None:
  """model=PATH loads PATH's parameters: a model.* override that changes any parameter's shape cannot
  apply to them, and is refused naming the key (norm_eps, rope or token ids may change)."""
  from meshlm import spec as S
  from meshlm.models import decoder

  def shapes(t: dict) -> dict:
    try:
      cfg = Config.model_validate(t)
    except pydantic.ValidationError as err:
      raise ConfigError(_format_error(err)) from None
    return {jax_path: s.shape for jax_path, s in _flat_specs(decoder.param_specs(cfg), S)}

  before = shapes(tree)
  for key, v in pairs:
    if not key.startswith("model."):
      continue
    one = copy.deepcopy(tree)
    _set(one, key, v)
    after = shapes(one)
    if after != before:
      what = next((f"{p} {list(before[p])} -> {list(after[p])}" for p in before if after.get(p, before[p]) != before[p]),
                  f"parameters {sorted(set(before) ^ set(after))[:3]} appear or go")
      raise ConfigError(f"{key}={v}: would change the shape of parameters loaded from model={value} ({what}); "
                        "only settings that keep every shape can be changed")


def _flat_specs(specs, S) -> list[tuple[str, Any]]:
  import jax
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=S.is_spec)[0]
  return [(".".join(str(k.key) for k in p), s) for p, s in flat]


def to_yaml(cfg: Config) -> str:
  return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
