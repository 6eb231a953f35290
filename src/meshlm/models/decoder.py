"""The generic decoder: embed -> layers (by plan) -> final norm -> head.

A family (models/family.py) gives the layer kinds and the plan. Each kind's parameters are one stack
(`params["layers"][kind]`, a "layers" axis at `param_scan_axis`) holding that kind's layers in model
order. At run time the plan groups them: the prefix layers unrolled, then a scan over whole
periods, then the remaining layers unrolled. Blocks take and return a per-layer state (the KV cache
when sampling) and side outputs; with neither (training) the scan carries only the activations.

Three entry points share that path: `forward` (training and scoring: logits for every position),
`prefill` (a right-padded prompt block; returns the logits and a fresh cache) and `decode` (one new
token per row against the cache).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm import spec as S
from meshlm.models.context import Context, make_context, windows
from meshlm.models.family import FORCED_EXPERT_IDS
from meshlm.models.registry import family
from meshlm.nn import kv_cache
from meshlm.nn.dense import dense
from meshlm.nn.embed import attend, embed
from meshlm.nn.norm import rms_norm
from meshlm.nn.stack_row import StackRow
from meshlm.parallel.sharding import ACT, LOGITS, constrain, einsum, logical_spec

__all__ = ["ACT", "LOGITS", "decode", "forward", "init_params", "param_shardings", "param_specs", "prefill"]


def plan(cfg: Config):
  return family(cfg).layer_plan(cfg.model)


def param_specs(cfg: Config) -> dict:
  m = cfg.model
  fam = family(cfg)
  lp = fam.layer_plan(m)
  specs = {
      # Untied embedding rows have unit scale. A tied head reuses the rows as its kernel, and families
      # that multiply embeddings by sqrt(D) scale them up: both draw rows at D ** -0.5, so the
      # logits (and the scaled input) start at unit scale.
      "embed": S.ParamSpec((m.vocab_size, m.embed_dim), ("vocab", "embed"), "normal",
                           fan_in=m.embed_dim if (fam.embed_scale or m.tie_embeddings) else 1),
      "layers": {k: S.stack(fam.kinds[k].spec(m), lp.count(k), cfg.param_scan_axis) for k in lp.kind_names()},
      "final_norm": S.zeros(m.embed_dim) if fam.norm_plus_one else S.ones(m.embed_dim),
  }
  if not m.tie_embeddings:
    specs["lm_head"] = S.kernel((m.embed_dim, m.vocab_size), ("embed", "vocab"))
  return specs


def model_state_specs(cfg: Config) -> dict:
  """The non-trainable leaves the parts declare (Part.model_state), stacked like the parameters:
  {"layers": {kind: {part key: ...}}} for the kinds that have any; {} when none do."""
  m, fam, lp = cfg.model, family(cfg), plan(cfg)
  layers = {k: S.stack(fam.kinds[k].model_state(m), lp.count(k), cfg.param_scan_axis) for k in lp.kind_names()
            if fam.kinds[k].model_state(m)}
  return {"layers": layers} if layers else {}


def _shardings(specs: dict, mesh) -> dict:
  from jax.sharding import NamedSharding
  return S.map_specs(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh)), specs)


def param_shardings(cfg: Config, mesh) -> dict:
  return _shardings(param_specs(cfg), mesh)


def model_state_shardings(cfg: Config, mesh) -> dict:
  return _shardings(model_state_specs(cfg), mesh)


def model_specs(cfg: Config) -> dict:
  """The whole model tree's specs: the parameters' with the model-state leaves merged in (what
  checkpoints, model directories and Hugging Face files hold, and what forward and generate take)."""
  return merge_state(param_specs(cfg), model_state_specs(cfg))


def model_shardings(cfg: Config, mesh) -> dict:
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


def split_state(cfg: Config, tree: dict) -> tuple[dict, dict]:
  """merge_state's inverse: (params, model_state) of a whole model tree."""
  state_specs = model_state_specs(cfg)
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


def after_step_side(cfg: Config) -> dict[str, str]:
  """{side output: "mean" | "sum"} over the parts' after_step rules (Part.after_step_side): how the
  train step adds each over micro-batches."""
  out: dict[str, str] = {}
  for _, p in _parts(cfg):
    for n, how in p.state_side().items():
      assert out.setdefault(n, how) == how, (n, how, out[n])
  return out


def side_layers(cfg: Config, name: str) -> list[int]:
  """The model layers (in order) whose kind has a part that returns the side output `name`."""
  fam, lp = family(cfg), plan(cfg)
  return [i for i, k in enumerate(lp.kinds) if any(name in p.side_names for p in fam.kinds[k].parts)]


def after_step(cfg: Config, model_state: dict, side: dict) -> dict:
  """Each part's after_step rule on its leaves (stacked over its kind's layers, layer axis leading)
  and its side outputs, sliced to that kind's layers: the new model state."""
  if not model_state:
    return model_state
  fam, lp, axis = family(cfg), plan(cfg), cfg.param_scan_axis
  out = {"layers": {}}
  for kind, parts in model_state["layers"].items():
    out["layers"][kind] = dict(parts)
    for part in fam.kinds[kind].parts:
      if part.after_step is None or part.key not in parts:
        continue
      mine = {}
      for name in part.state_side():
        layers = side_layers(cfg, name)
        rows = [j for j, i in enumerate(layers) if lp.kinds[i] == kind]
        mine[name] = side[name] if len(rows) == len(layers) else side[name][np.asarray(rows)]
      leaves = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), parts[part.key])
      new = part.after_step(leaves, mine, cfg.model)
      out["layers"][kind][part.key] = jax.tree.map(lambda a: jnp.moveaxis(a, 0, min(axis, a.ndim - 1)), new)
  return out


def _seed_paths(cfg: Config, specs: dict) -> Any:
  """The path each leaf's draw is seeded by: its tree path, with the kind left out when the model has
  one kind, so that a one-kind stack draws what the single stack of earlier versions drew."""
  one_kind = len(specs["layers"]) == 1

  def seed_path(path, _):
    if one_kind and len(path) > 1 and path[0].key == "layers":
      return path[:1] + path[2:]
    return path
  return jax.tree_util.tree_map_with_path(seed_path, specs, is_leaf=S.is_spec)


def init_params(cfg: Config, key: jax.Array, mesh=None) -> dict:
  """Initializes every parameter straight onto its sharding.

  Each leaf is drawn on the host with numpy (seeded by the key and the leaf's path), one leaf at a
  time, and placed onto its sharding: no XLA compile (a jitted init takes longer to compile than
  the tiny models take to train), the same numbers on every backend, and never more than one leaf
  on the host. Under tracing (jax.eval_shape, jit) it draws with jax.random instead: use that for
  shapes, not for numbers.
  """
  return _init(cfg, param_specs(cfg), key, mesh)


def init_model_state(cfg: Config, key: jax.Array, mesh=None) -> dict:
  """The model-state leaves' initial values (model_state_specs), as init_params draws them."""
  specs = model_state_specs(cfg)
  return _init(cfg, specs, key, mesh) if specs else {}


def _init(cfg: Config, specs: dict, key: jax.Array, mesh) -> dict:
  paths = _seed_paths(cfg, specs)
  dtype = jnp.dtype(cfg.train.param_dtype)
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


def _layer(stack: Any, i: int, axis: int) -> Any:
  return jax.tree.map(lambda a: jax.lax.index_in_dim(a, i, axis=min(axis, a.ndim - 1), keepdims=False), stack)


def _unrolled_params(cfg: Config, kind, stack: dict, i: int) -> dict:
  """Row i of an unrolled layer's stacks (layer axis leading): with cfg.stack_rows its parts' `stack_rows`
  left in their stacks as StackRow (nn/stack_row.py), every other leaf sliced."""
  parts = [p for p in kind.parts if p.stack_rows and cfg.stack_rows]
  out = _layer({k: v for k, v in stack.items() if k not in {p.key for p in parts}}, i, 0)
  for part in parts:
    out[part.key] = {n: StackRow(a, i) if n in part.stack_rows else _layer(a, i, 0)
                     for n, a in stack[part.key].items()}
  return out


def _parts(cfg: Config):
  """Every (kind name, Part) of the plan's kinds."""
  fam = family(cfg)
  return [(k, part) for k in plan(cfg).kind_names() for part in fam.kinds[k].parts]


def remat_policy(cfg: Config):
  """remat=full saves nothing but the values the parts name as cheap to keep and dear to recompute (a
  MoE layer's sort permutation: without it the backward sorts again); remat=dots saves dots too."""
  cp = jax.checkpoint_policies
  names = cp.save_only_these_names(*sorted({n for _, p in _parts(cfg) for n in p.remat_save_names}))
  return names if cfg.remat == "full" else cp.save_from_both_policies(cp.checkpoint_dots, names)


def _stack_side(pieces: list[tuple[list[int], dict]]) -> dict:
  """Side outputs of every layer that produced them: {name: [n_layers, ...]} in model layer order.

  pieces: (model indices, {name: values stacked over those indices}) from unrolled layers and scans.
  """
  out = {}
  for name in dict.fromkeys(k for _, side in pieces for k in side):
    idx = [i for ids, side in pieces if name in side for i in ids]
    vals = jnp.concatenate([side[name] for _, side in pieces if name in side])
    order = np.argsort(idx, kind="stable")
    out[name] = vals if np.all(order == np.arange(len(idx))) else vals[order]
  return out


# --- per-layer inputs -------------------------------------------------------------------------------

def input_readers(cfg: Config, name: str) -> list[int]:
  """The model layers (in order) whose kind has a part that reads the per-layer input `name`."""
  fam, lp = family(cfg), plan(cfg)
  return [i for i, k in enumerate(lp.kinds) if any(name in p.layer_inputs for p in fam.kinds[k].parts)]


def split_layer_inputs(cfg: Config, layer_inputs: dict, shape_BT) -> dict:
  """{name: [n_readers, ...]} (stacked over input_readers(name), model order) -> {kind: {name: rows of
  that kind's layers}}, each checked by the part that reads it (ValueError, one line)."""
  fam, lp = family(cfg), plan(cfg)
  out: dict[str, dict] = {}
  for name, a in layer_inputs.items():
    readers = input_readers(cfg, name)
    if not readers:
      known = sorted({n for _, p in _parts(cfg) for n in p.layer_inputs})
      raise ValueError(f"layer_inputs: no layer of model family {cfg.model.family!r} here reads {name!r} "
                       f"(inputs its layers read: {', '.join(known) or 'none'})")
    check = next(p.layer_inputs[name] for p in fam.kinds[lp.kinds[readers[0]]].parts if name in p.layer_inputs)
    check(cfg.model, a, len(readers), tuple(shape_BT))
    kinds = [lp.kinds[i] for i in readers]
    for kind in dict.fromkeys(kinds):
      rows = [j for j, k in enumerate(kinds) if k == kind]
      out.setdefault(kind, {})[name] = a if len(rows) == len(kinds) else a[np.asarray(rows)]
  return out


# --- decode state ------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
  """Every layer's decode state: `unrolled` [per unrolled layer, in model order] and `scanned` [per
  position in the period, stacked over the scan's groups], each a {part key: {leaf: array}}; `length`
  (static) is the full-attention cache length."""
  unrolled: list
  scanned: list | None
  length: int = dataclasses.field(metadata=dict(static=True))


def _state_spec(cfg: Config, i: int, batch: int, cache_len: int) -> dict:
  """Model layer i's {part key: {leaf: StateLeaf}} for a cache of cache_len positions."""
  lp = plan(cfg)
  size = kv_cache.cache_size(cache_len, windows(cfg.model)[lp.contexts[i]])
  return family(cfg).kinds[lp.kinds[i]].state_spec(cfg.model, batch, size)


def _commit(specs: dict, old: dict | None, update: dict, ctx: Context, stacked: bool) -> dict:
  """A layer's (or a stack of layers') new state from its update, by each leaf's commit rule."""
  slots = ctx.here.cache
  out = {}
  for key, leaves in specs.items():
    out[key] = {}
    for name, leaf in leaves.items():
      new = update[key][name]
      if leaf.commit == "replace":
        out[key][name] = new
      elif ctx.mode == "prefill":
        assert not stacked  # a prefill builds each layer's cache inside the scan
        out[key][name] = kv_cache.fill(new, slots, leaf.axes, leaf.slot_axis)
      else:
        axes = (("layers",) + tuple(leaf.axes)) if stacked else tuple(leaf.axes)
        out[key][name] = kv_cache.write_rows(old[key][name], new, slots, axes, leaf.slot_axis + stacked)
  return out


# --- the layers ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Run:
  """What every layer of one run shares: the plan, the context and whether to collect hidden states."""
  cfg: Config
  ctx: Context
  collect: bool

  def layer_fn(self, i: int):
    """Model layer i as f(p, x, state, inputs) -> (x, update, side), rematerialized per cfg.remat."""
    lp = plan(self.cfg)
    kind = family(self.cfg).kinds[lp.kinds[i]]
    here = self.ctx.as_type(lp.contexts[i])

    def f(p, x, state, inputs):
      x, update, side = kind.apply(p, x, here.with_layer(inputs), state)
      return x, update, (dict(side, hidden=x) if self.collect else side)
    return f if self.cfg.remat == "none" else jax.checkpoint(f, policy=remat_policy(self.cfg))


def _grouped(lp, by_kind: dict, G: int) -> dict:
  """Each kind's rows for the scanned layers, as [G, n, ...] (n = that kind's layers per period), or
  [G, ...] when n is 1 (stacks with the layer axis leading)."""
  pre, P = lp.prefix, lp.period
  period = lp.kinds[pre:pre + P]
  groups = {}
  for kind in dict.fromkeys(period):
    if kind not in by_kind:
      continue
    n, start = period.count(kind), lp.kinds[:pre].count(kind)
    g = by_kind[kind]
    if start or lp.count(kind) != start + G * n:
      g = jax.tree.map(lambda a: a[start:start + G * n], g)
    if n > 1:
      g = jax.tree.map(lambda a: jnp.reshape(a, (G, n) + a.shape[1:]), g)
    groups[kind] = g
  return groups


def run_layers(cfg: Config, layers: dict, x_BTD: jax.Array, ctx: Context, cache: Cache | None = None,
               collect: bool = False, layer_inputs: dict | None = None) -> tuple[jax.Array, Cache | None, dict]:
  """Runs every layer: (x [B, T, D], new cache or None, side outputs).

  layers: each kind's (prepared) stack with its layer axis leading. cache: the decode state (decode),
  an empty Cache (prefill: built from the layers' updates), or None (training). With collect, side
  outputs include "hidden": every layer's output [L, B, T, D], for layer-by-layer comparisons.
  layer_inputs: {kind: {name: [n, ...]}} (split_layer_inputs), each layer's row as `ctx.layer[name]`.
  Decode writes every layer's update into the (donated) cache once, after all the layers, in place.
  """
  lp = plan(cfg)
  run = _Run(cfg, ctx, collect)
  layer_inputs = layer_inputs or {}
  slots = lp.slots()
  P, pre, G = lp.period, lp.prefix, lp.groups
  scan = cfg.scan_layers and G > 0
  ids = _unrolled_ids(cfg, lp)
  B = x_BTD.shape[0]
  decode = ctx.mode == "decode"
  states = list(cache.unrolled) if cache is not None else [None] * len(ids)
  updates = [None] * len(ids)  # decode: each unrolled layer's update, committed at the end
  pieces: list[tuple[list[int], dict]] = []

  def unrolled(i: int):
    nonlocal x_BTD
    kind, row = slots[i]
    u = ids.index(i)
    with jax.named_scope(f"layer_{i}"):
      x_BTD, update, side = run.layer_fn(i)(_unrolled_params(cfg, family(cfg).kinds[kind], layers[kind], row), x_BTD,
                                            states[u] if ctx.mode == "decode" else None,
                                            _layer(layer_inputs.get(kind, {}), row, 0))
    if decode:
      updates[u] = update
    elif cache is not None:
      states[u] = _commit(_state_spec(cfg, i, B, cache.length), None, update, ctx.as_type(lp.contexts[i]), False)
    pieces.append(([i], {k: v[None] for k, v in side.items()}))

  for i in ids[:pre] if scan else ids:
    unrolled(i)
  scanned = None
  if scan:
    x_BTD, scanned, sides = _scan(run, lp, layers, layer_inputs, x_BTD, cache)
    for j, side in enumerate(sides):
      pieces.append(([pre + g * P + j for g in range(G)], side))
    for i in ids[pre:]:
      unrolled(i)
  if decode:
    states, scanned = _commit_decode(cfg, lp, ctx, cache, updates, scanned, x_BTD)
  new_cache = None if cache is None else Cache(states, scanned, cache.length)
  return x_BTD, new_cache, _stack_side(pieces)


def _commit_decode(cfg: Config, lp, ctx: Context, cache: Cache, updates: list, scanned_updates, x_BTD):
  """Every layer's decode update written into the cache, in place, once all the layers have read it.

  The updates pass an optimization barrier together with the last layer's output, so every write
  depends on every read: without that ordering XLA:CPU copies each cache buffer it writes
  (benchmarks/decode_memory.py).
  """
  B = x_BTD.shape[0]
  (updates, scanned_updates), _ = jax.lax.optimization_barrier(((updates, scanned_updates), x_BTD))
  ids = _unrolled_ids(cfg, lp)
  states = [_commit(_state_spec(cfg, i, B, cache.length), cache.unrolled[u], updates[u], ctx.as_type(lp.contexts[i]),
                    False) for u, i in enumerate(ids)]
  if scanned_updates is None:
    return states, None
  pre = lp.prefix
  scanned = [_commit(_state_spec(cfg, pre + j, B, cache.length), cache.scanned[j], scanned_updates[j],
                     ctx.as_type(lp.contexts[pre + j]), True) for j in range(lp.period)]
  return states, scanned


def _scan(run: _Run, lp, layers: dict, layer_inputs: dict, x_BTD: jax.Array, cache: Cache | None):
  """The scan over whole periods: (x, the scanned layers' new states or None, side per period position)."""
  cfg, ctx = run.cfg, run.ctx
  pre, P, G = lp.prefix, lp.period, lp.groups
  one_kind = len(layers) == 1
  period = lp.kinds[pre:pre + P]
  rank = [period[:j].count(period[j]) for j in range(P)]
  fns = [run.layer_fn(pre + j) for j in range(P)]
  label = (lambda j: lp.contexts[pre + j]) if one_kind else (lambda j: f"{period[j]}.{lp.contexts[pre + j]}")
  states = cache.scanned if cache is not None and ctx.mode == "decode" else None

  def body(x, xs):
    ps, g, ins = xs
    # The decode state is read as a loop constant, each layer's slice indexed here: as the scan's xs
    # XLA:CPU would copy the whole stacked cache to write it after the scan (benchmarks/decode_memory.py).
    sts = None if states is None else [jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, g, keepdims=False), s)
                                       for s in states]
    updates, sides = [], []
    with jax.named_scope("layers"):
      for j in range(P):
        kind = period[j]
        one = period.count(kind) == 1
        p = ps[kind] if one else _layer(ps[kind], rank[j], 0)
        li = ins.get(kind, {})
        li = li if one else _layer(li, rank[j], 0)
        st = None if sts is None else sts[j]
        if P == 1:
          x, update, side = fns[j](p, x, st, li)
        else:
          # Each position in the period names its scope ("layers/local_0"), so profiles tell them apart.
          with jax.named_scope(f"{label(j)}_{j}"):
            x, update, side = fns[j](p, x, st, li)
        if ctx.mode == "prefill":
          # A prefill builds each layer's cache from its rows here; nothing exists yet to write into.
          spec = _state_spec(cfg, pre + j, x.shape[0], cache.length)
          update = _commit(spec, None, update, ctx.as_type(lp.contexts[pre + j]), False)
        updates.append(update)
        sides.append(side)
    return x, (updates if cache is not None else None, sides)

  xs = (_grouped(lp, layers, G), jnp.arange(G, dtype=jnp.int32), _grouped(lp, layer_inputs, G))
  x_BTD, (updates, sides) = jax.lax.scan(body, x_BTD, xs)
  # prefill: the built caches; decode: the updates, stacked over the groups (run_layers commits them).
  return x_BTD, updates, sides


def _prepare(cfg: Config, layers: dict) -> dict:
  """Each kind's stack with its layer axis leading, after each part's `prepare` (gather-once)."""
  fam = family(cfg)
  specs = param_specs(cfg)["layers"]
  axis = cfg.param_scan_axis
  out = {}
  for kind, stack in layers.items():
    stack = dict(stack)
    for part in fam.kinds[kind].parts:
      if part.prepare is not None:
        stack[part.key] = part.prepare(stack[part.key], specs[kind][part.key])
    if axis != 0:
      stack = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), stack)
    out[kind] = stack
  return out


def head(cfg: Config, params: dict, x_BTD: jax.Array) -> jax.Array:
  """Logits [B, T, V] from the final-normed activations, soft-capped when the model asks for it."""
  with jax.named_scope("lm_head"):
    if cfg.model.tie_embeddings:
      logits = attend(params["embed"], x_BTD)
    else:
      logits = dense(x_BTD, params["lm_head"].astype(x_BTD.dtype), "btd,dv->btv", LOGITS,
                     kernel_order=cfg.lm_head_kernel_order, impl=cfg.weight_grad_impl)
    cap = cfg.model.final_logit_softcap
    if cap is not None:
      logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
    return logits


def apply(cfg: Config, params: dict, tokens_BT: jax.Array, ctx: Context, cache: Cache | None = None,
          collect: bool = False, last_B: jax.Array | None = None,
          layer_inputs: dict | None = None) -> tuple[jax.Array, Cache | None, dict]:
  """embed -> layers -> final norm -> head: (logits [B, T, V], new cache, side outputs).

  With last_B, only row b's position last_B[b] goes through the head: logits [B, 1, V] (a prefill
  needs the next-token logits of each prompt's last real token, not [B, T, V]).
  layer_inputs: {name: [n_readers, ...]} (see forward).
  """
  m = cfg.model
  fam = family(cfg)
  by_kind = split_layer_inputs(cfg, layer_inputs or {}, tokens_BT.shape)  # checked before anything runs
  dt = jnp.dtype(cfg.train.compute_dtype)
  x = constrain(embed(params["embed"], tokens_BT, dt), ACT)  # [B, T, D]
  if fam.embed_scale:
    # sqrt(D) rounded to the compute dtype first, as HF does: bf16 runs see the same factor.
    x = x * jnp.asarray(m.embed_dim ** 0.5, dt)
  x, cache, side = run_layers(cfg, _prepare(cfg, params["layers"]), x, ctx, cache, collect, by_kind)
  x = rms_norm(params["final_norm"], x, m.norm_eps, plus_one=fam.norm_plus_one)
  if last_B is not None:
    pick = jax.nn.one_hot(last_B, x.shape[1], dtype=x.dtype)  # [B, T]
    x = einsum("btd,bt->bd", x, pick, ("batch", "act_embed"))[:, None]  # [B, 1, D]
  return head(cfg, params, x), cache, side


def _positions(tokens_BT: jax.Array, positions_BT=None) -> jax.Array:
  if positions_BT is not None:
    return positions_BT
  B, T = tokens_BT.shape
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def context(cfg: Config, positions_BT: jax.Array, segment_ids_BT=None, **kw) -> Context:
  """The Context for this config's plan: its contexts and the RoPE widths its parts read."""
  dims = tuple(sorted({d for _, p in _parts(cfg) for d in p.rotary_dims(cfg.model)}))
  return make_context(cfg, plan(cfg).contexts, dims, positions_BT, segment_ids_BT, **kw)


def forward(cfg: Config, params: dict, tokens_BT: jax.Array, positions_BT=None, segment_ids_BT=None,
            return_hidden: bool = False, return_side: bool = False, forced_expert_ids=None,
            layer_inputs: dict | None = None):
  """Logits [B, T, V] in the compute dtype.

  tokens_BT must lie in [0, model.vocab_size): an id outside it reads no embedding row (JAX clamps
  or fills out-of-range gathers) and gives meaningless, possibly NaN, logits. The data pipeline
  refuses tokenizers whose ids do not fit the model; callers passing ids directly must check.
  positions and segment ids describe packed rows (each document restarts its positions, and
  attention never crosses segments). With return_hidden, returns (logits, hidden) where hidden
  [L, B, T, D] holds each layer's output (before the final norm), in layer order. With
  return_side, returns (logits, side outputs), e.g. aux losses of MoE layers and the routed expert
  ids "moe_expert_ids" [L_moe, B, T, k] (L_moe: the MoE layers, in model order).

  layer_inputs: {name: [n, ...]}, a per-layer input stacked over the n model layers that read it
  (input_readers(cfg, name)), in model order; each is checked by the part that reads it.
  forced_expert_ids [L_moe, B, T, k] (int32, -1 = not forced) is layer_inputs' "forced_expert_ids":
  router replay (nn/router_replay.py); pass the "moe_expert_ids" of an earlier forward. Its shape is
  checked, and its range when the array is concrete (called outside jit).
  """
  positions_BT = _positions(tokens_BT, positions_BT)
  if forced_expert_ids is not None:
    layer_inputs = dict(layer_inputs or {}, **{FORCED_EXPERT_IDS: forced_expert_ids})
  ctx = context(cfg, positions_BT, segment_ids_BT)
  logits, _, side = apply(cfg, params, tokens_BT, ctx, collect=return_hidden, layer_inputs=layer_inputs)
  if return_hidden:
    return logits, side.pop("hidden")
  return (logits, side) if return_side else logits


def prefill(cfg: Config, params: dict, tokens_BT: jax.Array, lengths_B: jax.Array, cache_len: int,
            layer_inputs: dict | None = None) -> tuple[jax.Array, Cache, dict]:
  """Runs right-padded prompts (row b holds lengths_B[b] real tokens): (next-token logits [B, V] at
  each row's last real token, the cache, side outputs [n, B, T, ...]).

  The cache holds room for cache_len positions per row (local layers: a ring of their window).
  """
  lp = plan(cfg)
  ctx = context(cfg, _positions(tokens_BT), mode="prefill", cache_len=cache_len, lengths_B=lengths_B)
  empty = Cache([None] * len(_unrolled_ids(cfg, lp)), None, cache_len)
  logits, cache, side = apply(cfg, params, tokens_BT, ctx, empty, last_B=lengths_B - 1, layer_inputs=layer_inputs)
  return logits[:, 0], cache, side


def decode(cfg: Config, params: dict, tokens_B: jax.Array, positions_B: jax.Array, cache: Cache,
           layer_inputs: dict | None = None) -> tuple[jax.Array, Cache, dict]:
  """One new token per row at its position: (logits [B, V], the cache with the new rows written in
  place, side outputs [n, B, 1, ...]). Donate the cache (jax.jit(donate_argnums=...)) so XLA writes
  its buffers instead of copying them."""
  ctx = context(cfg, positions_B[:, None], mode="decode", cache_len=cache.length)
  logits, cache, side = apply(cfg, params, tokens_B[:, None], ctx, cache, layer_inputs=layer_inputs)
  return logits[:, 0], cache, side


def _scans(cfg: Config, lp) -> bool:
  return cfg.scan_layers and lp.groups > 0


def _unrolled_ids(cfg: Config, lp) -> list[int]:
  if not _scans(cfg, lp):
    return list(range(lp.num_layers))
  return list(range(lp.prefix)) + list(range(lp.prefix + lp.groups * lp.period, lp.num_layers))
