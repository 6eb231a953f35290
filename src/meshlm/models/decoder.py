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

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm import spec as S
from meshlm.models.context import Context, make_context
from meshlm.models.registry import family
from meshlm.nn import moe
from meshlm.nn.dense import dense
from meshlm.nn.embed import attend, embed
from meshlm.nn.norm import rms_norm
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


def param_shardings(cfg: Config, mesh) -> dict:
  from jax.sharding import NamedSharding
  return S.map_specs(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh)), param_specs(cfg))


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
  specs = param_specs(cfg)
  paths = _seed_paths(cfg, specs)
  dtype = jnp.dtype(cfg.train.param_dtype)
  try:
    seed = tuple(int(v) for v in np.asarray(jax.random.key_data(key)).ravel())
  except jax.errors.TracerArrayConversionError:
    return jax.tree.map(lambda s, p: S.init_leaf(s, S.path_key(key, p), dtype), specs, paths, is_leaf=S.is_spec)
  shardings = param_shardings(cfg, mesh) if mesh is not None else S.map_specs(lambda _: None, specs)

  def leaf(s, path, sharding):
    host = S.init_leaf_host(s, seed, path).astype(dtype)
    if sharding is None:
      return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  return jax.tree.map(leaf, specs, paths, shardings, is_leaf=S.is_spec)


def _layer(stack: Any, i: int, axis: int) -> Any:
  return jax.tree.map(lambda a: jax.lax.index_in_dim(a, i, axis=min(axis, a.ndim - 1), keepdims=False), stack)


def _remat(fn, policy: str):
  """remat=full saves nothing but the named values that are cheap to keep and dear to recompute (a
  MoE layer's sort permutation: without it the backward sorts again); remat=dots saves dots too."""
  if policy == "none":
    return fn
  from meshlm.nn.moe import REMAT_SAVE_NAMES
  cp = jax.checkpoint_policies
  names = cp.save_only_these_names(*REMAT_SAVE_NAMES)
  if policy == "full":
    return jax.checkpoint(fn, policy=names)
  return jax.checkpoint(fn, policy=cp.save_from_both_policies(cp.checkpoint_dots, names))


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


def check_layer_inputs(lp, layer_inputs: dict) -> None:
  """Refuses per-layer inputs for a kind the plan lacks, or whose leading axis is not that kind's
  layer count (ValueError, one line)."""
  for kind, inputs in layer_inputs.items():
    if kind not in lp.kind_names():
      raise ValueError(f"layer_inputs: the model has no {kind!r} layers (its kinds: {', '.join(lp.kind_names())})")
    for name, a in inputs.items():
      if not a.shape or a.shape[0] != lp.count(kind):
        raise ValueError(f"layer_inputs: {name} has shape {tuple(a.shape)}; its first axis must be the model's "
                         f"{lp.count(kind)} {kind!r} layers")


def run_layers(cfg: Config, layers: dict, x_BTD: jax.Array, ctx: Context, cache: dict | None = None,
               collect: bool = False, layer_inputs: dict | None = None) -> tuple[jax.Array, dict | None, dict]:
  """Runs every layer: (x [B, T, D], new cache or None, side outputs).

  cache (sampling) holds each layer's state: {"unrolled": [state per unrolled layer, in model order],
  "scanned": [state per period position, stacked over the scan's groups]}. With collect, side
  outputs include "hidden": every layer's output [L, B, T, D], for layer-by-layer comparisons.
  layer_inputs, {kind: {name: [n, ...]}}, are per-layer inputs stacked in model order over the n
  layers of a kind (axis 0, whatever param_scan_axis): each layer gets its row as `ctx.layer[name]`,
  sliced like its parameters when unrolled and scanned alongside them otherwise.
  """
  fam = family(cfg)
  lp = fam.layer_plan(cfg.model)
  layer_inputs = layer_inputs or {}
  check_layer_inputs(lp, layer_inputs)
  slots = lp.slots()
  L, P, pre, G, R = lp.num_layers, lp.period, lp.prefix, lp.groups, lp.rest
  axis = cfg.param_scan_axis
  one_kind = len(layers) == 1
  scan = cfg.scan_layers and G > 0
  unrolled = list(range(pre)) + list(range(pre + G * P, L)) if scan else list(range(L))
  states = cache["unrolled"] if cache is not None else [None] * len(unrolled)
  scan_states = cache["scanned"] if cache is not None and scan else None

  def run(i: int):
    """Layer i's block as f(p, x, state, inputs) -> (x, state, side), rematerialized per cfg.remat."""
    kind, ctype = lp.kinds[i], lp.contexts[i]
    block, here = fam.kinds[kind].block, ctx.as_type(ctype)

    def f(p, x, state, inputs):
      x, state, side = block(p, x, ctx=here.with_layer(inputs), state=state)
      return x, state, (dict(side, hidden=x) if collect else side)
    return _remat(f, cfg.remat)

  pieces: list[tuple[list[int], dict]] = []
  new_unrolled: list[Any] = []

  def run_unrolled(ids: list[int], stacks: dict, stack_axis: int):
    nonlocal x_BTD
    for i in ids:
      kind, row = slots[i]
      with jax.named_scope(f"layer_{i}"):
        x_BTD, st, side = run(i)(_layer(stacks[kind], row, stack_axis), x_BTD, states[len(new_unrolled)],
                                 _layer(layer_inputs.get(kind, {}), row, 0))
      new_unrolled.append(st)
      pieces.append(([i], {k: v[None] for k, v in side.items()}))

  if not scan:
    run_unrolled(unrolled, layers, axis)
    return x_BTD, _cache(new_unrolled, None, cache), _stack_side(pieces)

  stacks = layers
  if axis != 0:
    stacks = jax.tree.map(lambda a: jnp.moveaxis(a, min(axis, a.ndim - 1), 0), stacks)
  run_unrolled(list(range(pre)), stacks, 0)
  # Each kind's rows for the scanned layers, as [G, n, ...] (n = that kind's layers per period), or
  # [G, ...] when n is 1. A kind's rank within the period picks its row inside a group.
  period = lp.kinds[pre:pre + P]
  rank = [period[:j].count(period[j]) for j in range(P)]
  def grouped(by_kind: dict) -> dict:
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
  groups, input_groups = grouped(stacks), grouped(layer_inputs)
  label = (lambda j: lp.contexts[pre + j]) if one_kind else (lambda j: f"{period[j]}.{lp.contexts[pre + j]}")
  fns = [run(pre + j) for j in range(P)]

  def body(x, xs):
    ps, sts, ins = xs
    new_sts, sides = [], []
    with jax.named_scope("layers"):
      for j in range(P):
        kind = period[j]
        one = period.count(kind) == 1
        p = ps[kind] if one else _layer(ps[kind], rank[j], 0)
        li = ins.get(kind, {})
        li = li if one else _layer(li, rank[j], 0)
        st = None if sts is None else sts[j]
        if P == 1:
          x, st, side = fns[j](p, x, st, li)
        else:
          # Each position in the period names its scope ("layers/local_0"), so profiles tell them apart.
          with jax.named_scope(f"{label(j)}_{j}"):
            x, st, side = fns[j](p, x, st, li)
        new_sts.append(st)
        sides.append(side)
    return x, (None if sts is None else new_sts, sides)

  x_BTD, (scan_states, sides) = jax.lax.scan(body, x_BTD, (groups, scan_states, input_groups))
  for j, side in enumerate(sides):
    pieces.append(([pre + g * P + j for g in range(G)], side))
  run_unrolled(list(range(pre + G * P, L)), stacks, 0)
  return x_BTD, _cache(new_unrolled, scan_states, cache), _stack_side(pieces)


def _cache(unrolled: list, scanned: list | None, cache: dict | None) -> dict | None:
  return None if cache is None else {"unrolled": unrolled, "scanned": scanned}


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


def apply(cfg: Config, params: dict, tokens_BT: jax.Array, ctx: Context, cache: dict | None = None,
          collect: bool = False, last_B: jax.Array | None = None,
          layer_inputs: dict | None = None) -> tuple[jax.Array, dict | None, dict]:
  """embed -> layers -> final norm -> head: (logits [B, T, V], new cache, side outputs).

  With last_B, only row b's position last_B[b] goes through the head: logits [B, 1, V] (a prefill
  needs the next-token logits of each prompt's last real token, not [B, T, V]).
  """
  m = cfg.model
  fam = family(cfg)
  dt = jnp.dtype(cfg.train.compute_dtype)
  x = constrain(embed(params["embed"], tokens_BT, dt), ACT)  # [B, T, D]
  if fam.embed_scale:
    # sqrt(D) rounded to the compute dtype first, as HF does: bf16 runs see the same factor.
    x = x * jnp.asarray(m.embed_dim ** 0.5, dt)
  # MoE routers: each stacked router kernel is all-gathered once here, not per layer in the scan.
  layers = moe.gather_router_once(params["layers"], param_specs(cfg)["layers"])
  x, cache, side = run_layers(cfg, layers, x, ctx, cache, collect, layer_inputs)
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

  forced_expert_ids [L_moe, B, T, k] (int32, -1 = not forced) replays routing (nn/router_replay.py):
  pass the "moe_expert_ids" of an earlier forward. Checked here: its shape, and its range when the
  array is concrete (called outside jit). layer_inputs: run_layers' general per-layer channel.
  """
  positions_BT = _positions(tokens_BT, positions_BT)
  lp = plan(cfg)
  ctx = make_context(cfg, lp.contexts, positions_BT, segment_ids_BT)
  if forced_expert_ids is not None:
    layer_inputs = with_forced_expert_ids(cfg, lp, layer_inputs, forced_expert_ids, tokens_BT.shape)
  logits, _, side = apply(cfg, params, tokens_BT, ctx, collect=return_hidden, layer_inputs=layer_inputs)
  if return_hidden:
    return logits, side.pop("hidden")
  return (logits, side) if return_side else logits


def with_forced_expert_ids(cfg: Config, lp, layer_inputs: dict | None, forced, shape_BT) -> dict:
  """layer_inputs plus the MoE layers' forced ids, checked (nn/router_replay.check_forced_ids)."""
  from meshlm.models import moe_block
  from meshlm.nn.router_replay import check_forced_ids
  n = lp.count(moe_block.KIND)
  if not n:
    raise ValueError(f"forced_expert_ids: model family {cfg.model.family!r} here has no MoE layers")
  check_forced_ids(forced, (n, *shape_BT, cfg.model.num_experts_per_tok), cfg.model.num_experts)
  layer_inputs = dict(layer_inputs or {})
  layer_inputs[moe_block.KIND] = dict(layer_inputs.get(moe_block.KIND, {}), **{moe_block.FORCED_IDS: forced})
  return layer_inputs


def prefill(cfg: Config, params: dict, tokens_BT: jax.Array, lengths_B: jax.Array, cache_len: int):
  """Runs right-padded prompts (row b holds lengths_B[b] real tokens): (next-token logits [B, V] at
  each row's last real token, cache).

  The cache holds room for cache_len positions per row (local layers: a ring of their window).
  """
  lp = plan(cfg)
  ctx = make_context(cfg, lp.contexts, _positions(tokens_BT), mode="prefill", cache_len=cache_len, lengths_B=lengths_B)
  unrolled = len(_unrolled_ids(cfg, lp))
  empty = {"unrolled": [None] * unrolled, "scanned": [None] * lp.period if _scans(cfg, lp) else None}
  logits, cache, _ = apply(cfg, params, tokens_BT, ctx, empty, last_B=lengths_B - 1)
  return logits[:, 0], cache


def decode(cfg: Config, params: dict, tokens_B: jax.Array, positions_B: jax.Array, cache: dict):
  """One new token per row at its position: (logits [B, V], the updated cache)."""
  ctx = make_context(cfg, plan(cfg).contexts, positions_B[:, None], mode="decode",
                     cache_len=_cache_len(cfg, cache))
  logits, cache, _ = apply(cfg, params, tokens_B[:, None], ctx, cache)
  return logits[:, 0], cache


def _scans(cfg: Config, lp) -> bool:
  return cfg.scan_layers and lp.groups > 0


def _unrolled_ids(cfg: Config, lp) -> list[int]:
  if not _scans(cfg, lp):
    return list(range(lp.num_layers))
  return list(range(lp.prefix)) + list(range(lp.prefix + lp.groups * lp.period, lp.num_layers))


def _cache_len(cfg: Config, cache: dict) -> int:
  """The full-attention cache length: the largest cache any layer holds."""
  lens = [a.shape[-3] for a in jax.tree.leaves(cache)]
  return max(lens)
