"""Running the layers by plan: the prefix unrolled, a scan over whole periods, the rest unrolled.

Blocks take and return a per-layer state (the decode state when sampling) and side outputs; with neither
(training) the scan carries only the activations. Decode writes every layer's update into the (donated)
cache once, after all the layers. Each function takes the resolved Model (models/model.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm.models.context import Context
from meshlm.models.family import StateLeaf
from meshlm.models.model import Model, resolve
from meshlm.nn import kv_cache
from meshlm.nn.stack_row import StackRow


def _layer(stack: Any, i: int, axis: int) -> Any:
  return jax.tree.map(lambda a: jax.lax.index_in_dim(a, i, axis=min(axis, a.ndim - 1), keepdims=False), stack)


def _unrolled_params(M: Model, kind, stack: dict, i: int) -> dict:
  """Row i of an unrolled layer's stacks (layer axis leading): with cfg.stack_rows its parts' `stack_rows`
  left in their stacks as StackRow (nn/stack_row.py), every other leaf sliced."""
  parts = [p for p in kind.parts if p.mesh.stack_rows and M.cfg.stack_rows]
  out = _layer({k: v for k, v in stack.items() if k not in {p.key for p in parts}}, i, 0)
  for part in parts:
    out[part.key] = {n: StackRow(a, i) if n in part.mesh.stack_rows else _layer(a, i, 0)
                     for n, a in stack[part.key].items()}
  return out


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


def split_layer_inputs(cfg: Config | Model, layer_inputs: dict, shape_BT) -> dict:
  """{name: [n_readers, ...]} (stacked over input_readers(name), model order; None: not given) -> {kind:
  {name: rows of that kind's layers}}, each checked by the part that reads it (ValueError, one line)."""
  M = resolve(cfg)
  lp = M.plan
  out: dict[str, dict] = {}
  for name, a in layer_inputs.items():
    if a is None:
      continue  # not given
    readers = M.input_readers(name)
    if not readers:
      raise ValueError(f"layer_inputs: no layer of model family {M.m.family!r} here reads {name!r} "
                       f"(inputs its layers read: {', '.join(M.layer_input_names) or 'none'})")
    li = M.layer_input(name)
    li.check(M.m, a, (len(readers), *shape_BT, *li.trailing(M.m)), name)
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
        # A leaf the pallas decode attention reads is written by tiles, which keeps its layout (write_rows).
        tiles = leaf.in_place and ctx.decode.for_size(slots.size) == "pallas"
        out[key][name] = kv_cache.write_rows(old[key][name], new, slots, axes, leaf.slot_axis + stacked, tiles)
  return out


# --- the layers ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Run:
  """What every layer of one run shares: the plan, the context and whether to collect hidden states."""
  M: Model
  ctx: Context
  collect: bool

  def layer_fn(self, i: int, row: int | None = None):
    """Model layer i as f(p, x, state, inputs) -> (x, update, side), rematerialized per cfg.remat. With row, p is
    a scanned period's rows of this layer's kind ([n, ...], the scan's xs as it is) and the layer's own row is
    taken inside the rematerialized function: remat then saves that xs, which the scan forwards to the backward as
    the stack it already is. A row taken outside is a new value per trip, which the scan stacks as a residual: a
    copy of every such layer's kernels for the backward (float32, since the kernels are cast in the layer:
    docs/compile.md)."""
    kind = self.M.kind(i)
    here = self.ctx.as_context(self.M.plan.contexts[i])

    def f(p, x, state, inputs):
      if row is not None:
        p = _layer(p, row, 0)
      x, update, side = kind.apply(p, x, here.with_layer(inputs), state)
      return x, update, (dict(side, hidden=x) if self.collect else side)
    return f if self.M.cfg.remat == "none" else jax.checkpoint(f, policy=self.M.remat_policy)


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


def run_layers(cfg: Config | Model, layers: dict, x_BTD: jax.Array, ctx: Context, cache: Cache | None = None,
               collect: bool = False, layer_inputs: dict | None = None) -> tuple[jax.Array, Cache | None, dict]:
  """Runs every layer: (x [B, T, D], new cache or None, side outputs).

  layers: each kind's (prepared) stack with its layer axis leading. cache: the decode state (decode),
  an empty Cache (prefill: built from the layers' updates), or None (training). With collect, side
  outputs include "hidden": every layer's output [L, B, T, D], for layer-by-layer comparisons.
  layer_inputs: {kind: {name: [n, ...]}} (split_layer_inputs), each layer's row as `ctx.layer[name]`.
  Decode writes every layer's update into the (donated) cache once, after all the layers, in place.
  """
  M = resolve(cfg)
  lp = M.plan
  run = _Run(M, ctx, collect)
  layer_inputs = layer_inputs or {}
  slots = lp.slots()
  P, pre, G = lp.period, lp.prefix, lp.groups
  scan = M.scans
  ids = M.unrolled_ids
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
      x_BTD, update, side = run.layer_fn(i)(_unrolled_params(M, M.family.kinds[kind], layers[kind], row), x_BTD,
                                            states[u] if ctx.mode == "decode" else None,
                                            _layer(layer_inputs.get(kind, {}), row, 0))
    if decode:
      updates[u] = update
    elif cache is not None:
      states[u] = _commit(M.state_spec(i, B, cache.length), None, update, ctx.as_context(lp.contexts[i]), False)
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
    states, scanned = _commit_decode(M, ctx, cache, updates, scanned, x_BTD)
  new_cache = None if cache is None else Cache(states, scanned, cache.length)
  return x_BTD, new_cache, _stack_side(pieces)


def _commit_decode(M: Model, ctx: Context, cache: Cache, updates: list, scanned_updates, x_BTD):
  """Every layer's decode update written into the cache, in place, once all the layers have read it.

  The updates pass an optimization barrier together with the last layer's output, so every write
  depends on every read: without that ordering XLA:CPU copies each cache buffer it writes
  (benchmarks/decode_memory.py).
  """
  B = x_BTD.shape[0]
  (updates, scanned_updates), _ = jax.lax.optimization_barrier(((updates, scanned_updates), x_BTD))
  lp = M.plan
  states = [_commit(M.state_spec(i, B, cache.length), cache.unrolled[u], updates[u], ctx.as_context(lp.contexts[i]),
                    False) for u, i in enumerate(M.unrolled_ids)]
  if scanned_updates is None:
    return states, None
  pre = lp.prefix
  scanned = [_commit(M.state_spec(pre + j, B, cache.length), cache.scanned[j], scanned_updates[j],
                     ctx.as_context(lp.contexts[pre + j]), True) for j in range(lp.period)]
  return states, scanned


def _scan(run: _Run, lp, layers: dict, layer_inputs: dict, x_BTD: jax.Array, cache: Cache | None):
  """The scan over whole periods: (x, the scanned layers' new states or None, side per period position)."""
  M, ctx = run.M, run.ctx
  pre, P, G = lp.prefix, lp.period, lp.groups
  one_kind = len(layers) == 1
  period = lp.kinds[pre:pre + P]
  rank = [period[:j].count(period[j]) for j in range(P)]
  # A kind with several layers per period takes its layer's row inside the layer's function (layer_fn's row).
  fns = [run.layer_fn(pre + j, None if period.count(period[j]) == 1 else rank[j]) for j in range(P)]
  label = (lambda j: lp.contexts[pre + j]) if one_kind else (lambda j: f"{period[j]}.{lp.contexts[pre + j]}")
  states = cache.scanned if cache is not None and ctx.mode == "decode" else None
  in_place = None if states is None else [
      jax.tree.map(lambda leaf: leaf.in_place, M.state_spec(pre + j, x_BTD.shape[0], cache.length),
                   is_leaf=lambda a: isinstance(a, StateLeaf)) for j in range(P)]

  def body(x, xs):
    ps, g, ins = xs
    # The decode state is read as a loop constant, each layer's slice indexed here: as the scan's xs
    # XLA:CPU would copy the whole stacked cache to write it after the scan (benchmarks/decode_memory.py). A leaf
    # read in place (StateLeaf.in_place) is handed over as its row of the stack, unsliced.
    row = lambda a, keep: kv_cache.LayerRow(a, g) if keep else jax.lax.dynamic_index_in_dim(a, g, keepdims=False)
    sts = None if states is None else [jax.tree.map(row, s, in_place[j]) for j, s in enumerate(states)]
    updates, sides = [], []
    with jax.named_scope("layers"):
      for j in range(P):
        kind = period[j]
        one = period.count(kind) == 1
        p = ps[kind]  # its one layer's, or the period's rows of its kind: fns[j] takes its own row
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
          spec = M.state_spec(pre + j, x.shape[0], cache.length)
          update = _commit(spec, None, update, ctx.as_context(lp.contexts[pre + j]), False)
        updates.append(update)
        sides.append(side)
    return x, (updates if cache is not None else None, sides)

  xs = (_grouped(lp, layers, G), jnp.arange(G, dtype=jnp.int32), _grouped(lp, layer_inputs, G))
  x_BTD, (updates, sides) = jax.lax.scan(body, x_BTD, xs)
  # prefill: the built caches; decode: the updates, stacked over the groups (run_layers commits them).
  return x_BTD, updates, sides


def prepare(M: Model, layers: dict) -> dict:
  """Each kind's stack with its layer axis leading, after each part's `prepare` (gather-once)."""
  fam = M.family
  specs = M.param_specs["layers"]
  axis = M.cfg.param_scan_axis
  dt = jnp.dtype(M.cfg.train.compute_dtype)
  out = {}
  for kind, stack in layers.items():
    stack = dict(stack)
    for part in fam.kinds[kind].parts:
      if part.compute.prepare is not None:
        stack[part.key] = part.compute.prepare(stack[part.key], specs[kind][part.key], dt)
    if axis != 0:
      stack = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), stack)
    out[kind] = stack
  return out
