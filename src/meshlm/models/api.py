"""The Python API's model calls as users make them (README, "Python API"): on one device or many, inside or
outside `jax.set_mesh`, on parameters from `init_params`, `hf.load` or `meshlm.load`.

`decoder.forward` is the traced core that the train step and the sampler build on: it runs wherever its caller
put it (under jit, inside the step's mesh). `forward` here is that core jitted onto a mesh
(`parallel.resolve_mesh`: the given one, the enclosing `jax.set_mesh`'s, the parameters', or the config's),
with the parameters placed onto their shardings there. Called while tracing (inside the caller's own
`jax.jit`), it is the core itself, under the parameters' mesh when the caller set none.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models import decoder, params as MP  # MP: this module's init_params is the public one, over MP's
from meshlm.models.layers import split_layer_inputs
from meshlm.models.model import clear_cache
from meshlm.models.ffns.moe import FORCED_IDS
from meshlm.parallel.mesh import resolve_mesh

__all__ = ["Generation", "forward", "init_params", "place"]


@dataclasses.dataclass
class Generation:
  """What `generate` returns (models/generate.py): the new tokens, their log-probs and the record a
  replay forces."""
  tokens: np.ndarray  # [B, N] int32: row b's new tokens in [:lengths[b]] (up to and including a stop token), 0 after
  logprobs: np.ndarray  # [B, N] float32: log p(token | prefix) under the model, 0 after the row's length
  lengths: np.ndarray  # [B] int32
  recorded: dict[str, np.ndarray]  # per-layer input name -> [B, T, n, ...] what a replay of this sample forces
  compilations: dict[str, int]  # {"prefill": n, "decode": n} traced during this call
  # [B, N] float32: log q(token | prefix), q the distribution drawn from (temperature, top-k, top-p
  # applied; 0 when greedy): the RL sampler's old-policy log-probs. 0 after the row's length.
  sample_logprobs: np.ndarray | None = None

  @property
  def expert_ids(self) -> np.ndarray | None:
    """[B, T, L_moe, k] int32 routed ids (the train step's forced_expert_ids), None without MoE layers."""
    return self.recorded.get(FORCED_IDS)

  def token_lists(self) -> list[list[int]]:
    return [[int(t) for t in row[:n]] for row, n in zip(self.tokens, self.lengths)]

  def logprob_lists(self) -> list[list[float]]:
    return [[float(x) for x in row[:n]] for row, n in zip(self.logprobs, self.lengths)]


def init_params(cfg: Config, key: jax.Array, mesh=None) -> dict:
  """The whole model tree, drawn as the train step draws it: the parameters with the model-state leaves
  merged in (DeepSeek-V3's routing bias; params.merge_state), what forward, generate and hf.save take.
  mesh: place every leaf onto its sharding there (default: each leaf on one device)."""
  return MP.merge_state(MP.init_params(cfg, key, mesh), MP.init_model_state(cfg, key, mesh))


def _paths(tree) -> list[str]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [".".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]


def place(cfg: Config, tree: dict, mesh) -> dict:
  """The whole model tree on its shardings on `mesh` (arrays already there are not copied). A tree that is
  not the model's is refused in one line naming the first leaf missing or unexpected."""
  shardings = MP.model_shardings(cfg, mesh)
  if jax.tree.structure(tree) != jax.tree.structure(shardings):
    want, got = _paths(shardings), _paths(tree)
    missing = [p for p in want if p not in got]
    extra = [p for p in got if p not in want]
    what = (f"lacks {missing[0]}" if missing else f"has {extra[0]}, which model family "
            f"{cfg.model.family!r} here does not") if missing or extra else "is not shaped as the model's"
    raise ConfigError(f"params: the tree {what}; pass the whole model tree (meshlm.init_params, meshlm.hf.load or "
                      "meshlm.load give it, the model-state leaves included)")
  return jax.device_put(tree, shardings)


def _tracing(*trees) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(trees))


def _abstract_mesh_of(tree):
  """Under the caller's jit with no mesh set: the mesh that tree's arrays are typed with (explicit sharding
  types every array with its mesh, and arrays made inside the program must share it)."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  for leaf in jax.tree.leaves(tree):
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
      return jax.sharding.use_abstract_mesh(mesh)
  return contextlib.nullcontext()


# The config sections no model program reads: a program is cached by the rest, so a model loaded twice (its
# HF export read back, a run and its checkpoint) under other names or training settings compiles once.
_NOT_READ = {"model_name", "run_dir", "cpu_devices", "mesh", "data", "checkpoint", "distributed", "rl"}
_TRAIN_READ = {"compute_dtype", "param_dtype"}


def program_key(cfg: Config) -> str:
  """What a model program (forward, prefill, decode) depends on in cfg, as JSON: every field but _NOT_READ and
  the train fields other than the dtypes. (The mesh is not in it: jit keys its executables on the mesh.)"""
  exclude = {name: True for name in _NOT_READ}
  exclude["train"] = set(type(cfg.train).model_fields) - _TRAIN_READ
  return cfg.model_dump_json(exclude=exclude)


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()


def cached(name: str, cfg: Config, build, *static):
  """build(cfg, *static), once per (name, program_key(cfg), static): the last 32 are kept."""
  key = (name, program_key(cfg), static)
  if key in _PROGRAMS:
    _PROGRAMS.move_to_end(key)
  else:
    _PROGRAMS[key] = build(cfg, *static)
    while len(_PROGRAMS) > 32:
      _PROGRAMS.popitem(last=False)
  return _PROGRAMS[key]


def clear_programs() -> None:
  """Forget every cached program and resolved Model (a test that patches a layer or a registry entry
  resolves and traces anew)."""
  _PROGRAMS.clear()
  clear_cache()


def _inputs(forced_LBTk) -> dict | None:
  """The decoder's layer_inputs for a router replay (None without one)."""
  return None if forced_LBTk is None else {FORCED_IDS: forced_LBTk}


def _build_forward(cfg: Config, return_hidden: bool, return_side: bool):
  def run(params, tokens_BT, positions_BT, segment_ids_BT, forced_LBTk):
    return decoder.forward(cfg, params, tokens_BT, positions_BT, segment_ids_BT, return_hidden=return_hidden,
                           return_side=return_side, layer_inputs=_inputs(forced_LBTk))
  return jax.jit(run)


def forward(cfg: Config, params: dict, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
            forced_expert_ids=None, return_hidden: bool = False, return_side: bool = False, mesh=None):
  """Logits [B, T, V] (in the compute dtype) of token ids [B, T], each below model.vocab_size.

  positions_BT and segment_ids_BT describe packed rows: each document restarts its positions, and attention
  never crosses segments (segment id 0 is padding). forced_expert_ids [B, T, L_moe, k] (int32, -1 = not
  forced; L_moe the MoE layers in model order) replays a routing: `generate(...).expert_ids` is in this
  layout, as is the train step's batch field. return_hidden: (logits, every layer's output [L, B, T, D]);
  return_side: (logits, side outputs, e.g. "moe_expert_ids" [L_moe, B, T, k]). mesh: where to run (default
  as parallel.resolve_mesh says); params not yet there are placed onto their shardings on it.
  """
  forced = None if forced_expert_ids is None else jnp.moveaxis(jnp.asarray(forced_expert_ids), 2, 0)
  kw = dict(return_hidden=return_hidden, return_side=return_side)
  if _tracing(params, tokens_BT, positions_BT, segment_ids_BT, forced_expert_ids):
    with _abstract_mesh_of(params):
      return decoder.forward(cfg, params, tokens_BT, positions_BT, segment_ids_BT, layer_inputs=_inputs(forced),
                             **kw)
  if forced is not None:
    split_layer_inputs(cfg, _inputs(forced), np.shape(tokens_BT))  # one line, before compiling
  mesh = resolve_mesh(cfg, params, mesh)
  params = place(cfg, params, mesh)
  host = lambda a: None if a is None else np.asarray(a)  # noqa: E731  (committed to no device: the jit places it)
  with jax.set_mesh(mesh):
    return cached("forward", cfg, _build_forward, return_hidden, return_side)(
        params, host(tokens_BT), host(positions_BT), host(segment_ids_BT), host(forced))
