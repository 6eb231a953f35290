"""The model's trees: parameter and model-state specs, their shardings and initial values, the merge of
the two, and the parts' after-step rules on the model state.

Each function takes a Config or a resolved Model (models/model.py). The specs come from the Model's
cached trees; each call returns a fresh tree, so a caller may change what it gets.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm import spec as S
from meshlm.models.model import Model, resolve
from meshlm.parallel.sharding import logical_spec


def _copy(specs: dict) -> dict:
  return S.map_specs(lambda s: s, specs)


def param_specs(cfg: Config | Model) -> dict:
  return _copy(resolve(cfg).param_specs)


def model_state_specs(cfg: Config | Model) -> dict:
  """The non-trainable leaves the parts declare (ModelState), stacked like the parameters:
  {"layers": {kind: {part key: ...}}} for the kinds that have any; {} when none do."""
  return _copy(resolve(cfg).model_state_specs)


def _shardings(specs: dict, mesh) -> dict:
  from jax.sharding import NamedSharding
  return S.map_specs(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh)), specs)


def param_shardings(cfg: Config | Model, mesh) -> dict:
  return _shardings(resolve(cfg).param_specs, mesh)


def model_state_shardings(cfg: Config | Model, mesh) -> dict:
  return _shardings(resolve(cfg).model_state_specs, mesh)


def model_specs(cfg: Config | Model) -> dict:
  """The whole model tree's specs: the parameters' with the model-state leaves merged in (what
  checkpoints, model directories and Hugging Face files hold, and what forward and generate take)."""
  M = resolve(cfg)
  return merge_state(_copy(M.param_specs), _copy(M.model_state_specs))


def model_shardings(cfg: Config | Model, mesh) -> dict:
  return _shardings(model_specs(cfg), mesh)


def merge_state(params: dict, model_state: dict) -> dict:
  """The whole model tree: the parameters with the model-state leaves beside them (what forward,
  checkpoints and Hugging Face files hold)."""
  if not model_state:
    return params
  out = dict(params, layers=dict(params["layers"]))
  for kind, parts in model_state["layers"].items():
    out["layers"][kind] = dict(out["layers"][kind])
    for key, leaves in parts.items():
      out["layers"][kind][key] = {**out["layers"][kind][key], **leaves}
  return out


def split_state(cfg: Config | Model, tree: dict) -> tuple[dict, dict]:
  """merge_state's inverse: (params, model_state) of a whole model tree."""
  state_specs = resolve(cfg).model_state_specs
  if not state_specs:
    return tree, {}
  params = dict(tree, layers=dict(tree["layers"]))
  state = {"layers": {}}
  for kind, parts in state_specs["layers"].items():
    params["layers"][kind] = dict(params["layers"][kind])
    state["layers"][kind] = {}
    for key, leaves in parts.items():
      sub = dict(params["layers"][kind][key])
      state["layers"][kind][key] = {name: sub.pop(name) for name in leaves}
      params["layers"][kind][key] = sub
  return params, state


def after_step_side(cfg: Config | Model) -> dict[str, str]:
  """{side output: "mean" | "sum"} over the parts' after_step rules (ModelState.side): how the
  train step adds each over micro-batches."""
  out: dict[str, str] = {}
  for _, p in resolve(cfg).parts:
    for n, how in p.state_side().items():
      assert out.setdefault(n, how) == how, (n, how, out[n])
  return out


def after_step(cfg: Config | Model, model_state: dict, side: dict) -> dict:
  """Each part's after_step rule on its leaves (stacked over its kind's layers, layer axis leading)
  and its side outputs, sliced to that kind's layers: the new model state."""
  if not model_state:
    return model_state
  M = resolve(cfg)
  lp, axis = M.plan, M.cfg.param_scan_axis
  out = {"layers": {}}
  for kind, parts in model_state["layers"].items():
    out["layers"][kind] = dict(parts)
    for part in M.family.kinds[kind].parts:
      if part.model_state is None or part.key not in parts:
        continue
      mine = {}
      for name in part.state_side():
        layers = M.side_layers(name)
        rows = [j for j, i in enumerate(layers) if lp.kinds[i] == kind]
        mine[name] = side[name] if len(rows) == len(layers) else side[name][np.asarray(rows)]
      leaves = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), parts[part.key])
      new = part.model_state.after_step(leaves, mine, M.m)
      out["layers"][kind][part.key] = jax.tree.map(lambda a: jnp.moveaxis(a, 0, min(axis, a.ndim - 1)), new)
  return out


def _seed_paths(specs: dict) -> Any:
  """The path each leaf's draw is seeded by: its tree path, with the kind left out when the model has
  one kind, so that a one-kind stack draws what the single stack of earlier versions drew."""
  one_kind = len(specs["layers"]) == 1

  def seed_path(path, _):
    if one_kind and len(path) > 1 and path[0].key == "layers":
      return path[:1] + path[2:]
    return path
  return jax.tree_util.tree_map_with_path(seed_path, specs, is_leaf=S.is_spec)


def init_params(cfg: Config | Model, key: jax.Array, mesh=None) -> dict:
  """Initializes every parameter straight onto its sharding.

  Each leaf is drawn on the host with numpy (seeded by the key and the leaf's path), one leaf at a
  time, and placed onto its sharding: no XLA compile (a jitted init takes longer to compile than
  the tiny models take to train), the same numbers on every backend, and never more than one leaf
  on the host. Under tracing (jax.eval_shape, jit) it draws with jax.random instead: use that for
  shapes, not for numbers.
  """
  M = resolve(cfg)
  return _init(M, M.param_specs, key, mesh)


def init_model_state(cfg: Config | Model, key: jax.Array, mesh=None) -> dict:
  """The model-state leaves' initial values (model_state_specs), as init_params draws them."""
  M = resolve(cfg)
  return _init(M, M.model_state_specs, key, mesh) if M.model_state_specs else {}


def _init(M: Model, specs: dict, key: jax.Array, mesh) -> dict:
  paths = _seed_paths(specs)
  dtype = jnp.dtype(M.cfg.train.param_dtype)
  try:
    seed = tuple(int(v) for v in np.asarray(jax.random.key_data(key)).ravel())
  except jax.errors.TracerArrayConversionError:
    return jax.tree.map(lambda s, p: S.init_leaf(s, S.path_key(key, p), dtype), specs, paths, is_leaf=S.is_spec)
  shardings = _shardings(specs, mesh) if mesh is not None else S.map_specs(lambda _: None, specs)

  def leaf(s, path, sharding):
    host = S.init_leaf_host(s, seed, path).astype(dtype)
    if sharding is None:
      return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  return jax.tree.map(leaf, specs, paths, shardings, is_leaf=S.is_spec)
