"""Presets, dotted key=value overrides and the one-line errors users see."""
from __future__ import annotations

import copy
import os
from importlib import resources
from typing import Any, Iterable

import pydantic
import yaml

from meshlm.config.schema import Config, ModelConfig
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


def set_key(tree: dict, dotted: str, value: Any) -> None:
  """tree[a][b][c] = value for dotted 'a.b.c', creating sections on the way. A key moved into a part's section
  (ModelConfig.MOVED) sets its new name, so it overrides what the tree holds there."""
  keys = dotted.split(".")
  if len(keys) == 2 and keys[0] == "model" and keys[1] in ModelConfig.MOVED:
    keys = ["model", "parts", *ModelConfig.MOVED[keys[1]][:2]]
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
    from meshlm.config.keys import suggest, trl_hint
    trl = trl_hint(loc, first.get("input"))
    if trl:
      return trl
    near = suggest(loc)
    msg = f"unknown key; did you mean {near}? (docs/config.md lists every key)" if near else \
        "unknown key (docs/config.md lists every key)"
  elif "input" in first and first["type"] not in ("missing",) and not isinstance(first["input"], dict):
    msg = f"{msg} (got {first['input']!r})"
  msg = msg.removeprefix("Value error, ")
  return f"{loc}: {msg}" if loc else msg


def load_config(*overrides: str, base: dict[str, Any] | None = None) -> Config:
  """Builds a validated Config with its tri-state flags resolved, from a preset and overrides only.

  `model=NAME` picks a preset; every other override is a dotted path into the config, applied in order.
  base: the tree to start from instead of a preset (model= is then ignored). `model=PATH` (a model or
  run directory) is resolved a layer up, by meshlm.commands.resolve.load_config (= meshlm.load_config).
  """
  pairs = parse_overrides(overrides)
  name = "llama2-tiny"
  for key, value in pairs:
    if key == "model":
      if not isinstance(value, str):
        raise ConfigError(f"model: expected a preset name or a model directory, got {value!r}")
      name = value
  if base is not None:
    tree = copy.deepcopy(base)
  elif is_model_path(name):
    raise ConfigError(f"model={name}: a directory, which meshlm.config.load_config does not read; "
                      "use meshlm.load_config (or the CLI), which resolves model=PATH")
  else:
    tree = load_preset(name)
  for key, value in pairs:
    if key != "model":
      set_key(tree, key, value)
  return validate(tree)


def validate(tree: dict[str, Any]) -> Config:
  """The Config of a plain tree, its flags resolved; a pydantic error becomes one ConfigError line."""
  try:
    cfg = Config.model_validate(tree)
  except pydantic.ValidationError as err:
    raise ConfigError(_format_error(err)) from None
  return cfg.resolved()


def is_model_path(value: str) -> bool:
  """A preset name stays a preset; otherwise a value with a '/' or naming something that exists is a path."""
  return value not in preset_names() and ("/" in value or os.path.exists(value))


def to_yaml(cfg: Config) -> str:
  return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
