"""Blockwise ("flash") attention in pure JAX: the `attention_impl=flash` core.

The forward walks the query blocks; for each it runs an online softmax over only the key blocks its mask can
reach (the causal diagonal and below, inside the sliding window), keeping a running max, sum and output in
float32. It saves the output and each row's log-sum-exp. The backward (a custom VJP, FlashAttention-2's)
walks the key blocks, and for each only the query blocks that can see it, recomputing the block's
probabilities from q, k and the saved log-sum-exp. Neither pass holds more than a [B, K, G, block, block]
score tile: memory is O(T x block), never O(T^2), and causal costs about half the square's FLOPs.

Everything nn/attention.gqa_attention (the `xla` reference) does: heads-first rows in and out (q [B, N, T, H],
k/v [B, K, T, H], the output [B, N, T, Hv]; inside, q [B, K, G, T, H] and every tile indexed along T), GQA groups,
the scale, the logit soft-cap (and its derivative), a sliding window, packed segments (segment ids: a
document never sees another), query/key and value head dims that differ (MLA), and any length (padded to
the block inside, the pad masked). Only jnp and lax loops: it runs on CPU, GPU and TPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

BLOCK = 512  # query and key block length (a shorter sequence is one block)
# The checkpoint name of an attention core's output and row log-sum-exp, the residuals its backward reads (flash's,
# ring's and the splash kernel's): a remat policy that saves it (remat_attention=save) keeps the backward from
# rerunning the forward kernel.
RESIDUALS = "attention_residuals"
_F32 = jnp.float32
_MIN = float(jnp.finfo(_F32).min)


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  softcap: float | None
  window: int | None
  block: int
  length: int  # the real T (the arrays are padded to a multiple of block)
  segments: bool


def flash_attention(q_BNTH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, segment_ids_BT: jax.Array | None = None,
                    *, scale: float, softcap: float | None = None, window: int | None = None,
                    block: int = BLOCK) -> jax.Array:
  """Causal softmax(q k^T * scale) v, as gqa_attention with attention_mask(segment_ids_BT, T, window), blockwise.

  q [B, N, T, H], k [B, K, T, H], v [B, K, T, Hv] (the same T: training and prefill); returns [B, N, T, Hv].
  """
  B, N, T, H = q_BNTH.shape
  K = k_BKSH.shape[1]
  assert k_BKSH.shape[2] == T == v_BKSH.shape[2], (q_BNTH.shape, k_BKSH.shape, v_BKSH.shape)
  b = min(block, T)
  pad = -T % b
  q = jnp.reshape(q_BNTH, (B, K, N // K, T, H))

  def padded(x, axis):
    return jnp.pad(x, tuple((0, pad if a == axis else 0) for a in range(x.ndim))) if pad else x
  seg = None if segment_ids_BT is None else padded(segment_ids_BT.astype(jnp.int32), 1)
  st = _Static(float(scale), softcap, window, b, T, seg is not None)
  with jax.named_scope("flash_attention"):
    out = _flash(st, padded(q, 3), padded(k_BKSH, 2), padded(v_BKSH, 2), seg)  # [B, K, G, Tp, Hv]
  return jnp.reshape(out[:, :, :, :T], (B, N, T, out.shape[-1]))


def _key_offset(j, b: int):
  """The first position of block j (tests swap in a wrong one: the negative control)."""
  return j * b


def _tile_mask(st: _Static, i, j, seg, seg_k=None, delta=0):
  """[B or 1, 1, 1, bq, bk]: what query block i sees of key block j (causal, inside the window, a real key,
  the same segment). delta: the query array's first position minus the key array's (ring attention's chunk
  pairs; 0 when both are the one sequence); seg_k: the key array's segment ids when they are another array's."""
  b = st.block
  qp = delta + i * b + jnp.arange(b)[:, None]
  kl = _key_offset(j, b) + jnp.arange(b)[None, :]  # the key's index in its array
  mask = (kl <= qp) & (kl < st.length)
  if st.window is not None:
    mask &= qp - kl < st.window
  mask = mask[None, None, None]
  if st.segments:
    sq = lax.dynamic_slice_in_dim(seg, i * b, b, axis=1)  # [B, bq]
    sk = lax.dynamic_slice_in_dim(seg if seg_k is None else seg_k, j * b, b, axis=1)
    mask = mask & _same_segment(sq, sk)[:, None, None]
  return mask


def _same_segment(sq_Bq, sk_Bk):
  """[B, bq, bk]: a query sees keys of its own document only."""
  return sq_Bq[:, :, None] == sk_Bk[:, None, :]


def _scores(st: _Static, q_i, k_j):
  """(capped scores [B, K, G, bq, bk] float32, tanh of the raw scores / cap or None) of q_i [B, K, G, bq, H] and
  k_j [B, K, bk, H]."""
  s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=_F32) * st.scale
  if st.softcap is None:
    return s, None
  t = jnp.tanh(s / st.softcap)
  return st.softcap * t, t


def _key_blocks(st: _Static, i, delta=0, n: int | None = None):
  """[lo, hi): the key blocks (of n, by default all up to the diagonal) query block i can see; delta as in
  _tile_mask (a chunk pair whose keys all come after its queries gets an empty range)."""
  b = st.block
  if isinstance(delta, int) and delta == 0 and n is None:
    lo = 0 if st.window is None else jnp.maximum(i * b - st.window + 1, 0) // b
    return lo, i + 1
  hi = jnp.clip((delta + (i + 1) * b - 1) // b + 1, 0, n)  # the block of the last key the last query sees
  lo = 0 if st.window is None else jnp.clip((delta + i * b - st.window + 1) // b, 0, n)
  return lo, jnp.maximum(hi, lo)


def _query_blocks(st: _Static, j, n: int, delta=0):
  """[lo, hi): the query blocks that can see key block j; delta as in _tile_mask."""
  b = st.block
  if isinstance(delta, int) and delta == 0:
    hi = n if st.window is None else jnp.minimum((j * b + b - 1 + st.window - 1) // b + 1, n)
    return j, hi
  # ceil((j b - delta - b + 1) / b): the first block with a query at or after the key block's first key
  lo = jnp.clip(-((delta - j * b + b - 1) // b), 0, n)
  hi = n if st.window is None else jnp.clip((j * b + b - 2 + st.window - delta) // b + 1, 0, n)
  return lo, jnp.maximum(hi, lo)


def empty_rows(B: int, K: int, G: int, b: int, Hv: int):
  """The running softmax of a query block that has seen nothing yet: (max, sum, output) [B, K, G, bq] (twice)
  and [B, K, G, bq, Hv], float32."""
  return jnp.full((B, K, G, b), _MIN, _F32), jnp.zeros((B, K, G, b), _F32), jnp.zeros((B, K, G, b, Hv), _F32)


def merge_keys(st: _Static, q_i, i, k, v, seg, carry, bounds, seg_k=None, delta=0):
  """The running softmax (max, sum, output) of query block i (q_i [B, K, G, bq, H]) with the key blocks
  [lo, hi) = bounds of k [B, K, S, H], v [B, K, S, Hv] merged in, one [B, K, G, bq, bk] tile at a time.
  seg_k, delta: as _tile_mask's (ring attention's chunk pairs)."""
  b = st.block

  def key_block(j, carry):
    m, l, acc = carry  # [B, K, G, bq], the same, [B, K, G, bq, Hv]
    k_j = lax.dynamic_slice_in_dim(k, _key_offset(j, b), b, axis=2)  # [B, K, bk, H]
    v_j = lax.dynamic_slice_in_dim(v, _key_offset(j, b), b, axis=2)
    mask = _tile_mask(st, i, j, seg, seg_k, delta)
    s, _ = _scores(st, q_i, k_j)
    s = jnp.where(mask, s, _MIN)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v_j, preferred_element_type=_F32)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

  return lax.fori_loop(*bounds, key_block, carry)


def finish_rows(m, l, acc, dtype):
  """(out [..., bq, Hv] in dtype, lse [..., bq] float32) of a running softmax; a row that saw nothing (a pad
  row) gets out 0 and lse +inf, so the backward's exp(s - lse) is 0 there."""
  seen = l > 0
  out = acc / jnp.where(seen, l, 1.0)[..., None]
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
  return out.astype(dtype), lse


def _forward(st: _Static, q, k, v, seg):
  """(out [B, K, G, Tp, Hv] in v's dtype, lse [B, K, G, Tp] float32) over padded inputs (q [B, K, G, Tp, H])."""
  B, K, G, Tp, H = q.shape
  Hv, b = v.shape[-1], st.block

  def query_block(i):
    q_i = lax.dynamic_slice_in_dim(q, i * b, b, axis=3)  # [B, K, G, bq, H]
    carry = merge_keys(st, q_i, i, k, v, seg, empty_rows(B, K, G, b, Hv), _key_blocks(st, i))
    return finish_rows(*carry, v.dtype)

  out, lse = lax.map(query_block, jnp.arange(Tp // b))  # [n, B, K, G, bq, Hv], [n, B, K, G, bq]
  return blocks_to_rows(out, lse)


def blocks_to_rows(out, lse):
  """Per-query-block out [n, B, K, G, bq, Hv] and lse [n, B, K, G, bq] as rows: [B, K, G, n bq, Hv], [B, K, G, n bq]."""
  n, B, K, G, b, Hv = out.shape
  out = jnp.reshape(jnp.moveaxis(out, 0, 3), (B, K, G, n * b, Hv))
  lse = jnp.reshape(jnp.moveaxis(lse, 0, 3), (B, K, G, n * b))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, seg):
  return _forward(st, q, k, v, seg)[0]


def _flash_fwd(st: _Static, q, k, v, seg):
  out, lse = (checkpoint_name(x, RESIDUALS) for x in _forward(st, q, k, v, seg))
  return out, (q, k, v, seg, out, lse)


def row_term(d_out, out):
  """D_i = sum_h dO_i o_i: the softmax's row term, [B, K, G, Tp] float32 (of [B, K, G, Tp, Hv] each)."""
  return jnp.einsum("bkgth,bkgth->bkgt", d_out.astype(_F32), out.astype(_F32))


def key_block_grads(st: _Static, j, k_j, v_j, q, d_out, lse, d_row, seg, grads, bounds, seg_k=None, delta=0):
  """(dq, dk_j, dv_j): key block j (k_j [B, K, bk, H], v_j [B, K, bk, Hv]) against the query blocks [lo, hi) =
  bounds of q [B, K, G, Tp, H], recomputing each tile's probabilities from the saved lse; dq [B, K, G, Tp, H]
  accumulates in place, dk_j and dv_j (float32) from `grads` = (dq, dk_j, dv_j). seg_k, delta: as _tile_mask's."""
  b = st.block

  def query_block(i, carry):
    dq, dk, dv = carry
    q_i = lax.dynamic_slice_in_dim(q, i * b, b, axis=3)  # [B, K, G, bq, H]
    do_i = lax.dynamic_slice_in_dim(d_out, i * b, b, axis=3)
    lse_i = lax.dynamic_slice_in_dim(lse, i * b, b, axis=3)  # [B, K, G, bq]
    d_i = lax.dynamic_slice_in_dim(d_row, i * b, b, axis=3)
    s, t = _scores(st, q_i, k_j)
    p = jnp.where(_tile_mask(st, i, j, seg, seg_k, delta), jnp.exp(s - lse_i[..., None]), 0.0)  # [B, K, G, bq, bk]
    dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p.astype(d_out.dtype), do_i, preferred_element_type=_F32)
    dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=_F32)
    ds = p * (dp - d_i[..., None])
    if t is not None:
      ds = ds * (1.0 - t * t)  # d(cap tanh(s / cap)) / ds
    # In the inputs' dtype (bf16 compute: bf16 dots accumulating in float32), as the forward's p @ v.
    ds = (ds * st.scale).astype(q.dtype)
    dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j, preferred_element_type=_F32)
    dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, i * b, b, axis=3) + dq_i, i * b, axis=3)
    dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i, preferred_element_type=_F32)
    return dq, dk, dv

  return lax.fori_loop(*bounds, query_block, grads)


def _flash_bwd(st: _Static, res, d_out):
  """FlashAttention-2's backward: per key block, the query blocks that see it; dq accumulates in place."""
  q, k, v, seg, out, lse = res
  B, K, G, Tp, H = q.shape
  b, n = st.block, Tp // st.block
  d_row = row_term(d_out, out)

  def key_block(dq, j):
    k_j = lax.dynamic_slice_in_dim(k, _key_offset(j, b), b, axis=2)  # [B, K, bk, H]
    v_j = lax.dynamic_slice_in_dim(v, _key_offset(j, b), b, axis=2)
    grads = (dq, jnp.zeros(k_j.shape, _F32), jnp.zeros(v_j.shape, _F32))
    dq, dk, dv = key_block_grads(st, j, k_j, v_j, q, d_out, lse, d_row, seg, grads, _query_blocks(st, j, n))
    return dq, (dk, dv)

  dq, (dk, dv) = lax.scan(key_block, jnp.zeros(q.shape, _F32), jnp.arange(n))  # dk [n, B, K, bk, H]
  dk = jnp.reshape(jnp.moveaxis(dk, 0, 2), k.shape)
  dv = jnp.reshape(jnp.moveaxis(dv, 0, 2), v.shape)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
