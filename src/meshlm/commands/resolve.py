"""model=PATH: a Hugging Face model directory, or a meshlm model, run or step directory.

`load_config` here is meshlm.load_config and what every command reads its keys with: presets and
overrides as meshlm.config.load_config, plus model=PATH, which needs hf/ (an HF config.json) and train/
(the checkpoint layout), both above config/.
"""
from __future__ import annotations

import copy
import os
from typing import Any

from meshlm import config
from meshlm.config import Config, loader
from meshlm.errors import ConfigError


def load_config(*overrides: str, base: dict[str, Any] | None = None, carry: tuple[str, ...] = ()) -> Config:
  """config.load_config, where `model=PATH` starts from the directory's tree (model_dir_tree; applied
  first, wherever it appears) and a model.* override that changes a loaded parameter's shape is refused;
  then the model family checks its own fields (Family.validate). carry: more keys (dotted) that a meshlm
  directory's config.yaml gives model=PATH besides CARRIED (`meshlm eval`: the run's data rules); overrides win."""
  from meshlm.models import registry  # lazy: jax
  pairs = config.parse_overrides(overrides)
  name = next((v for k, v in reversed(pairs) if k == "model"), None)
  if base is not None or not isinstance(name, str) or not loader.is_model_path(name):
    return registry.validate(config.load_config(*overrides, base=base))
  tree = model_dir_tree(name, carry)
  cfg = config.load_config(*overrides, base=tree)
  refuse_shape_overrides(name, tree, pairs)
  return registry.validate(cfg)



def model_dir_tree(value: str, carry: tuple[str, ...] = ()) -> dict[str, Any]:
  """The config tree model=PATH starts from: the directory's model config, its parameters
  (checkpoint.load_params_from), its tokenizer.json (data.tokenizer) and, of a meshlm directory, the CARRIED and
  `carry` keys of its config.yaml; a tokenizer.json or chat_template.jinja in the directory wins over the
  data.tokenizer or data.chat_template its config.yaml names (the run's copies). key=value overrides go on top."""
  path = os.path.abspath(os.path.expanduser(value))
  key = f"model={value}"
  if not os.path.isdir(path):
    raise ConfigError(f"{key}: no such directory (nor a preset: meshlm presets lists them)")
  if os.path.isfile(os.path.join(path, "config.json")):
    from pathlib import Path
    from meshlm.hf.io import model_fields  # lazy: safetensors and the family maps, only for an HF dir
    name, model = os.path.basename(path), model_fields(Path(path))
    carried = {}
  else:
    name, model, carried = _meshlm_model(path, key, CARRIED + tuple(carry))
  tree: dict[str, Any] = {"model_name": name, "model": model, "checkpoint": {"load_params_from": path}, **carried}
  tokenizer = os.path.join(path, "tokenizer.json")
  if os.path.isfile(tokenizer):
    data = tree.setdefault("data", {})
    data["tokenizer"] = tokenizer
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
      data.pop("chat_template", None)  # the template found beside the tokenizer: the one the run used
  return tree


# The keys of a meshlm directory's config.yaml that model=PATH carries besides the model: how its parameters were
# trained to compute (a float32 run goes on in float32, not in the schema's bfloat16 default). Overrides win.
CARRIED = ("train.compute_dtype",)


def _meshlm_model(path: str, key: str, keys: tuple[str, ...]) -> tuple[str, dict, dict]:
  """(model_name, model, `keys` as a tree) of a meshlm model dir, run dir or step dir: from the metadata of the step
  that checkpoint.load_params_from will read, else from a config.yaml beside its params; the carried keys (dotted,
  section.field) from the config.yaml of the step, model or run directory."""
  from meshlm.train.checkpoint import _find_step_dir, saved_config, saved_model  # lazy: orbax
  try:
    step = _find_step_dir(path, key)
  except ConfigError:
    raise ConfigError(f"{key}: not a Hugging Face model directory (no config.json) nor a meshlm model or run "
                      "directory (no params/, <step>/params or checkpoints/<step>/params)") from None
  saved = saved_model(step, key)
  if saved is not None:
    record, carried = saved_config(step, key) or {}, {}
    for dotted in keys:
      section, _, field = dotted.partition(".")
      if field in (record.get(section) or {}):
        carried.setdefault(section, {})[field] = record[section][field]
    return saved["model_name"], saved["model"], carried
  raise ConfigError(f"{key}: {step} has params/ but no meta/metadata or config.yaml that says which model")


def refuse_shape_overrides(value: str, tree: dict[str, Any], pairs: list[tuple[str, Any]]) -> None:
  """model=PATH loads PATH's parameters: a model.* override that changes any parameter's shape cannot
  apply to them, and is refused naming the key (norm_eps, rope or token ids may change)."""
  import jax
  from meshlm import spec as S
  from meshlm.models.params import param_specs

  def shapes(t: dict) -> dict:
    # The model alone decides the shapes: a train.seq_len default beyond a small model.max_position must
    # not fail here (the real config, overrides applied, is validated on its own).
    t = dict(t, train={"seq_len": 1})
    flat = jax.tree_util.tree_flatten_with_path(param_specs(loader.validate(t)), is_leaf=S.is_spec)[0]
    return {".".join(str(k.key) for k in p): s.shape for p, s in flat}

  before = shapes(tree)
  for key, v in pairs:
    if not key.startswith("model."):
      continue
    one = copy.deepcopy(tree)
    loader.set_key(one, key, v)
    after = shapes(one)
    if after != before:
      what = next((f"{p} {list(before[p])} -> {list(after[p])}" for p in before if after.get(p, before[p]) != before[p]),
                  f"parameters {sorted(set(before) ^ set(after))[:3]} appear or go")
      raise ConfigError(f"{key}={v}: would change the shape of parameters loaded from model={value} ({what}); "
                        "only settings that keep every shape can be changed")


def load(path: str, *overrides: str, mesh=None) -> tuple[Config, dict]:
  """meshlm.load: (cfg, the whole model tree) of a run directory (its latest checkpoint), a step directory, a
  meshlm model directory or a Hugging Face model directory, resolved as `meshlm generate PATH` resolves it, in
  float32 compute unless overrides say otherwise. The tree is placed on `mesh` (default:
  parallel.resolve_mesh: the enclosing jax.set_mesh's, else the config's), ready for forward and generate."""
  path = os.fspath(path)
  if not path.startswith(("/", ".", "~")) and "/" not in path:
    path = "./" + path  # a directory, never a preset name
  cfg = load_config(f"model={path}", "train.compute_dtype=float32", *overrides)
  return cfg, load_tree(cfg, mesh)


def load_tree(cfg: Config, mesh=None) -> dict:
  """The whole model tree that cfg's checkpoint.load_params_from holds (a model=PATH config), on `mesh`."""
  import jax
  import jax.numpy as jnp
  from meshlm import spec as S
  from meshlm.models.params import model_shardings, model_specs
  from meshlm.parallel.mesh import resolve_mesh, set_cpu_devices
  from meshlm.train.checkpoint import load_params
  set_cpu_devices(cfg.cpu_devices)
  mesh = resolve_mesh(cfg, None, mesh)
  shardings = model_shardings(cfg, mesh)  # the model-state leaves included
  abstract = jax.tree.map(lambda sh, s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh), shardings,
                          model_specs(cfg), is_leaf=S.is_spec)
  return load_params(cfg, cfg.checkpoint.load_params_from, abstract, shardings, mesh)
