"""Router replay: route a MoE layer's tokens with forced expert ids (RL replays the rollout's routing).

forced_ids_BTk (int32 [B, T, k]): a token whose row holds expert ids (0 <= id < E) uses them; a row of
-1 ("not forced") is routed by top-k as usual. Every token's routing weights still come from the live
router probabilities at its ids (gathered, then renormalized when the model renormalizes), so the
router keeps its gradient even when every token is forced.

Top-k runs only over the rows that need it, those neither forced nor padding: at most R of them are
gathered (`jnp.nonzero(size=R)`), top-k'd and scattered back, and a `lax.cond` falls back to the full
top-k when more rows need it. The ids are integers, so the cond carries no gradient: the weights are
one gather from the probabilities after it. Both branches, and `impl="full"` (the plain path: top-k
over every row), therefore give bit-identical ids, weights and gradients. Rows that are padding
(token_mask 0) and not forced take experts 0..k-1; their outputs are masked anyway.

Under a mesh the selection runs per batch (and length) shard inside `shard_map`, so R counts the
rows of one shard and each device top-k's only its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.parallel.sharding import constrain, current_mesh, logical_spec

REPLAY_ROWS = 256  # R: rows one compact top-k handles before the cond falls back to the full top-k
REPLAY_IMPLS = ("compact", "full")
TOKENS = ("batch", "length", None)


def check_forced_ids(forced, shape: tuple[int, ...], num_experts: int, name: str = "forced_expert_ids") -> None:
  """Refuses forced ids of the wrong shape (ValueError, one line) and, when the values are concrete
  (not traced), ids outside [-1, num_experts) or rows that mix -1 with expert ids."""
  got = tuple(getattr(forced, "shape", ()))
  if got != tuple(shape):
    raise ValueError(f"{name}: shape {got}, expected {tuple(shape)}")
  if isinstance(forced, jax.core.Tracer):
    return
  a = np.asarray(forced)
  if not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"{name}: dtype {a.dtype}, expected integer expert ids (-1 = not forced)")
  if a.size == 0:
    return
  lo, hi = int(a.min()), int(a.max())
  if lo < -1 or hi >= num_experts:
    raise ValueError(f"{name}: ids range over [{lo}, {hi}], expected -1 (not forced) or an expert in "
                     f"[0, {num_experts})")
  rows = a.reshape(-1, a.shape[-1]) < 0
  mixed = rows.any(-1) & ~rows.all(-1)
  if mixed.any():
    raise ValueError(f"{name}: row {int(np.argmax(mixed))} (flattened over the leading axes) mixes -1 with "
                     f"expert ids; a token is forced in all its k slots or in none")


def compact_fits(need_M: jax.Array, rows: int) -> jax.Array:
  """The cond's predicate: True when at most `rows` rows need top-k (the compact branch runs)."""
  return jnp.sum(need_M.astype(jnp.int32)) <= rows


def plain_topk(scores_ME: jax.Array, k: int) -> jax.Array:
  """The softmax router's selection: the top-k ids [M, k] int32 of each row."""
  return jax.lax.top_k(scores_ME, k)[1].astype(jnp.int32)


def compact_topk(probs_ME: jax.Array, need_M: jax.Array, k: int, rows: int, select=plain_topk) -> jax.Array:
  """Top-k ids [M, k] of the first `rows` rows that need it (gathered, top-k'd, scattered back);
  every other row holds 0..k-1. Exact only when at most `rows` rows need it (see compact_fits).
  select(scores [R, E], k) -> ids [R, k]: the router's selection rule (plain_topk, or group-limited)."""
  M = probs_ME.shape[0]
  (idx,) = jnp.nonzero(need_M, size=rows, fill_value=M)  # [R]; M (out of range) for unused slots
  sub = jnp.take(probs_ME, idx, axis=0, mode="fill", fill_value=0)  # [R, E]
  return _fill(M, k).at[idx].set(select(sub, k), mode="drop")


def full_topk(probs_ME: jax.Array, need_M: jax.Array, k: int, select=plain_topk) -> jax.Array:
  """The plain path: top-k over every row, 0..k-1 kept for the rows that do not need it."""
  return jnp.where(need_M[:, None], select(probs_ME, k), _fill(probs_ME.shape[0], k))


def _fill(M: int, k: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (M, k))


def _local_route(probs_BTE, forced_BTk, mask_BT, *select_args, k: int, norm_topk: bool, rows: int, impl: str,
                 select=None, weigh=None):
  """(weights [B, T, k] float32, ids [B, T, k] int32) for the tokens at hand (one shard or all).
  select(scores [R, E], *select_args, k=) -> ids [R, k] and weigh(w [M, k]) -> w: a router's own rule
  (group-limited sigmoid routing); None: plain top-k and the renormalization by the sum."""
  B, T, E = probs_BTE.shape
  M = B * T
  probs = probs_BTE.reshape(M, E)
  forced = forced_BTk.reshape(M, k).astype(jnp.int32)
  is_forced = forced[:, 0] >= 0
  need = ~is_forced & (mask_BT.reshape(M) > 0)
  sg = jax.lax.stop_gradient(probs)
  # The router's own selection, passed only when it has one (the plain calls stay as they were).
  pick = () if select is None else (lambda sc, kk: select(sc, *select_args, k=kk),)
  if impl == "full" or rows >= M:
    top = full_topk(sg, need, k, *pick)
  else:
    top = jax.lax.cond(compact_fits(need, rows), lambda: compact_topk(sg, need, k, rows, *pick),
                       lambda: full_topk(sg, need, k, *pick))
  ids = jnp.where(is_forced[:, None], forced, top)  # [M, k]
  w = jnp.take_along_axis(probs, ids, axis=-1)  # the live probabilities at the ids: the router's gradient
  if weigh is not None:
    w = weigh(w)
  elif norm_topk:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return w.reshape(B, T, k), ids.reshape(B, T, k)


def replay_route(logits_BTE: jax.Array, forced_ids_BTk: jax.Array, k: int, norm_topk: bool,
                 token_mask_BT: jax.Array | None = None, *, rows: int = REPLAY_ROWS,
                 impl: str = "compact", scoring: str = "softmax", select=None, select_args: tuple = (),
                 weigh=None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`moe.route` with forced ids: (probs [B, T, E] float32, weights [B, T, k] float32, ids [B, T, k] int32).

  impl "compact" (top-k over at most `rows` gathered rows, falling back to the full top-k) or "full".
  scoring "softmax" or "sigmoid" (the scores the weights come from); select(scores [R, E], *select_args,
  k=) -> ids [R, k] picks the unforced tokens' experts (default: plain top-k; group-limited sigmoid
  routing passes its rule and the bias as select_args, replicated under a mesh), and weigh(w [M, k])
  turns the scores at the ids into weights (default: renormalized by the sum when norm_topk). Forced
  ids bypass select: their weights are weigh(the live scores at them).
  """
  if impl not in REPLAY_IMPLS:
    raise ValueError(f"router replay impl={impl!r}: expected one of {REPLAY_IMPLS}")
  B, T, E = logits_BTE.shape
  if tuple(forced_ids_BTk.shape) != (B, T, k):
    raise ValueError(f"forced_expert_ids: shape {tuple(forced_ids_BTk.shape)}, expected {(B, T, k)} ([B, T, k])")
  if scoring == "softmax":
    probs = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
  elif scoring == "sigmoid":
    probs = jax.nn.sigmoid(logits_BTE.astype(jnp.float32))
  else:
    raise ValueError(f"router scoring={scoring!r}: expected softmax or sigmoid")
  mask = jnp.ones((B, T), jnp.int32) if token_mask_BT is None else (token_mask_BT > 0).astype(jnp.int32)
  forced = forced_ids_BTk.astype(jnp.int32)

  def local(p, f, m, *args):
    return _local_route(p, f, m, *args, k=k, norm_topk=norm_topk, rows=rows, impl=impl, select=select,
                        weigh=weigh)

  if current_mesh().empty:
    w, ids = local(probs, forced, mask, *select_args)
    return probs, w, ids
  # Per batch (and length) shard: nonzero, the compact gather and the scatter stay on the device.
  spec = logical_spec(TOKENS, probs.shape)
  probs_l, forced_l = constrain(probs, TOKENS), constrain(forced, TOKENS)
  mask_l = constrain(mask, TOKENS[:2])
  args = tuple(constrain(a, (None,) * a.ndim) for a in select_args)
  w, ids = jax.shard_map(local, in_specs=(spec, spec, logical_spec(TOKENS[:2], mask.shape))
                         + (jax.sharding.PartitionSpec(),) * len(args),
                         out_specs=(spec, spec))(probs_l, forced_l, mask_l, *args)
  return probs, w, ids
