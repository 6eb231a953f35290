"""Gated DeltaNet's gated delta rule (qwen3-next, qwen3.5): the recurrence, written out as the reference.

Letters (docs/architecture.md): K key heads, N value heads (N = G * K, value head n reads key head
n // G), H the key head dim, J the value head dim. Shapes:

  q, k  [B, T, K, H]   already L2-normalized; q already scaled by H ** -0.5
  v     [B, T, N, J]
  g     [B, T, N]      the log decay, <= 0 (g = -exp(A_log) * softplus(a + dt_bias))
  beta  [B, T, N]      the write strength, sigmoid(b)
  state [B, N, H, J]

The recurrence, per value head, in float32:

  S <- exp(g_t) * S
  S <- S + k_t (beta_t * (v_t - S^T k_t))^T
  o_t = S^T q_t

Packed documents: segment_ids [B, T] (0 is padding, as the data pipeline writes them). The state
entering position t is zero wherever segment_ids[t] != segment_ids[t - 1], so no document sees
another; `initial_state` enters at t = 0 only. A position with g = 0 and beta = 0 leaves the state as
it is (how a right-padded prompt keeps the state of its last real token).

The rule, three ways, one contract (o [B, T, N, J] in v's dtype, final state [B, N, H, J] float32):
- `gated_delta_rule_reference`: the recurrence, one position at a time (the reference);
- `gated_delta_rule_chunked`: chunks of W positions in the WY form, a scan over chunks (the fast path);
- `gated_delta_rule_context_parallel`: the chunked rule with T sharded over mesh.context.
`gated_delta_rule(..., impl=)` picks the first two. docs/performance.md ("Gated DeltaNet hybrids") measures them.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from meshlm.errors import ConfigError
from meshlm.parallel.sharding import is_explicit, logical_spec


def segment_starts(segment_ids_BT: jax.Array | None, T: int) -> jax.Array | None:
  """[B, T] bool: position t starts a segment (t > 0 and its id differs from t - 1's); None without ids."""
  if segment_ids_BT is None:
    return None
  prev = jnp.concatenate([segment_ids_BT[:, :1], segment_ids_BT[:, :-1]], axis=1)
  return (segment_ids_BT != prev) & (jnp.arange(T) > 0)[None, :]


def expand_heads(x_BTKH: jax.Array, n: int) -> jax.Array:
  """[B, T, K, H] -> [B, T, N, H]: value head n reads key head n // (N / K)."""
  return jnp.repeat(x_BTKH, n // x_BTKH.shape[2], axis=2)


def gated_delta_rule_reference(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, *, segment_ids_BT=None,
                               initial_state_BNHJ=None):
  """The naive recurrence, one position at a time: (o [B, T, N, J] in v's dtype, final state
  [B, N, H, J] float32). The reference every fast path is tested against."""
  B, T, N, J = v_BTNJ.shape
  H = q_BTKH.shape[-1]
  f32 = jnp.float32
  q = expand_heads(q_BTKH, N).astype(f32)
  k = expand_heads(k_BTKH, N).astype(f32)
  v, g, beta = v_BTNJ.astype(f32), g_BTN.astype(f32), beta_BTN.astype(f32)
  starts = segment_starts(segment_ids_BT, T)
  if starts is None:
    starts = jnp.zeros((B, T), bool)
  state = jnp.zeros((B, N, H, J), f32) if initial_state_BNHJ is None else initial_state_BNHJ.astype(f32)

  def step(S_BNHJ, xs):
    q_t, k_t, v_t, g_t, b_t, start_t = xs  # [B, N, H], [B, N, H], [B, N, J], [B, N], [B, N], [B]
    S_BNHJ = jnp.where(start_t[:, None, None, None], 0.0, S_BNHJ)
    S_BNHJ = S_BNHJ * jnp.exp(g_t)[..., None, None]
    delta_BNJ = b_t[..., None] * (v_t - jnp.einsum("bnhj,bnh->bnj", S_BNHJ, k_t))
    S_BNHJ = S_BNHJ + k_t[..., :, None] * delta_BNJ[..., None, :]
    return S_BNHJ, jnp.einsum("bnhj,bnh->bnj", S_BNHJ, q_t)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  state, o_TBNJ = jax.lax.scan(step, state, tuple(map(time_major, (q, k, v, g, beta, starts))))
  return jnp.moveaxis(o_TBNJ, 0, 1).astype(v_BTNJ.dtype), state


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last dim, in float32 (transformers' l2norm). Finite, with a finite
  gradient, for an all-zero row."""
  xf = x.astype(jnp.float32)
  return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


# ---------------------------------------------------------------------------------- the chunked rule
#
# Letters of the chunked form: U chunks of W positions each (T padded up to U * W inside the call only).
# Per chunk and value head, with the state S [H, J] entering it and gamma the gate cumsum inside the chunk
# (restarted at every segment start), only same-segment pairs (i, j) interact:
#
#   A = strict_tril(beta_i (k_i . k_j) exp(gamma_i - gamma_j))       [W, W]
#   Tm = (I + A)^-1,  u = Tm (beta v),  w = Tm (beta exp(gamma) c k)   c_i: i still in the incoming segment
#   delta = u - w S                                                   [W, J]  (beta * the delta rule's error)
#   o = (c exp(gamma) q) S + tril(q_i . k_j exp(gamma_i - gamma_j)) delta
#   S <- c_last exp(gamma_last) S + (k exp(gamma_last - gamma) [j in the last segment])^T delta
#
# Only the state line is sequential: a scan over chunks carries S and emits the state entering each chunk
# (its scan output; no buffer written in place). Every other term is one batched product over all chunks,
# before the scan (A, Tm, u, w) or after it (o = (c exp(gamma) q - P w) S_in + P u, P the tril term).

INVERSES = ("right_looking", "solve_triangular", "blocked", "doubling")
DEFAULT_INVERSE = "right_looking"
# Columns of the right-looking inverse per loop trip (its loop: _inverse_right_looking).
INVERSE_UNROLL = 8
# The chunked rule's named scope: its chunk scans, forward and backward, and the terms after them (the census counts
# the dead work around the scope's loops; the per-chunk terms before the scan, with the inverse's loop, are outside).
CHUNK_SCOPE = "gdn_chunked"
_HI = jax.lax.Precision.HIGHEST  # float32 matmuls on every backend (TPU's default would round to bf16)


def check_chunk_size(chunk_size: int) -> None:
  """The chunk must be a power of two (the blocked and doubling inverses halve it; chunks tile shards)."""
  if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ConfigError(f"model.parts.gdn.chunk_size={chunk_size!r}: the Gated DeltaNet chunk must be a power of two "
                      "(16, 32, 64, ...); set model.parts.gdn.chunk_size=64")


def _einsum(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _inverse_right_looking(a_XWW, *, skip_column=None):
  """Right-looking: once row j is final, subtract a[i, j] * x_j from every later row (a loop over columns).
  skip_column drops one column's update: the negative control of the tests, never used otherwise."""
  W = a_XWW.shape[-1]
  eye_XWW = jnp.broadcast_to(jnp.eye(W, dtype=a_XWW.dtype), a_XWW.shape)

  def column(j, x_XWW):
    # a[i, j] is zero for i <= j, so rows up to j (already final) are untouched: whole-row updates.
    update = x_XWW - jax.lax.dynamic_slice_in_dim(a_XWW, j, 1, -1) * jax.lax.dynamic_slice_in_dim(x_XWW, j, 1, -2)
    return update if skip_column is None else jnp.where(j == skip_column, x_XWW, update)

  if W == 1:
    return eye_XWW
  # Column 0 outside the loop: its result has a's type (its sharding under explicit), the loop's carry type.
  x_XWW = column(0, eye_XWW)

  def trip(t, x_XWW):
    for c in range(INVERSE_UNROLL):
      x_XWW = column(1 + t * INVERSE_UNROLL + c, x_XWW)
    return x_XWW

  # A loop of INVERSE_UNROLL columns per trip, not W - 1 unrolled steps: fully unrolled, the inverse was 64% of
  # the qwen3.5-397b period's optimized HLO at context=2 (XLA:TPU took tens of minutes over it); one column per
  # trip measured ~10x slower on XLA:CPU than the unrolled chain, which XLA fuses. The same multiply and subtract
  # per element either way, so the same numbers. The trip's columns are written out here, not fori_loop's
  # unroll=: remat saves the loop counter of every trip as a stacked residual, and JAX (0.10 to 0.12) lowers an
  # unrolled scan's stacked outputs under the program's mesh, not the values' own: inside the rule's auto_axes
  # region of an explicit mesh that stacking fails ("context mesh ... should match the aval mesh"). An
  # unroll=1 loop writes them under the values' mesh.
  trips, rest = divmod(W - 2, INVERSE_UNROLL)
  x_XWW = jax.lax.fori_loop(0, trips, trip, x_XWW)
  for j in range(W - 1 - rest, W - 1):  # the last columns, fewer than a trip
    x_XWW = column(j, x_XWW)
  return x_XWW


def _inverse_solve_triangular(a_XWW):
  W = a_XWW.shape[-1]
  eye = jnp.eye(W, dtype=a_XWW.dtype)
  l_XWW = a_XWW + eye
  return jax.scipy.linalg.solve_triangular(l_XWW, jnp.broadcast_to(eye, a_XWW.shape), lower=True,
                                           unit_diagonal=True)


def _diag_blocks(a_XWW, b):
  """[..., W, W] -> [..., W / b, b, b]: the diagonal b x b blocks."""
  W = a_XWW.shape[-1]
  nb = W // b
  a = a_XWW.reshape(a_XWW.shape[:-2] + (nb, b, nb, b))
  return jnp.einsum("...ibic->...ibc", a)


def _inverse_blocked(a_XWW, base=16):
  """flash-linear-attention's form: substitution on the base x base diagonal blocks, then merges
  [[X1, 0], [-X2 A21 X1, X2]] doubling the block until it is the whole chunk."""
  W = a_XWW.shape[-1]
  b = min(base, W)
  x = _inverse_right_looking(_diag_blocks(a_XWW, b))  # [..., W / b, b, b]
  while b < W:
    pairs = _diag_blocks(a_XWW, 2 * b)  # [..., W / 2b, 2b, 2b]
    a21 = pairs[..., b:, :b]
    x1, x2 = x[..., 0::2, :, :], x[..., 1::2, :, :]
    x21 = -_einsum("...ab,...bc,...cd->...ad", x2, a21, x1)
    zero = jnp.zeros_like(x1)
    x = jnp.concatenate([jnp.concatenate([x1, zero], -1), jnp.concatenate([x21, x2], -1)], -2)
    b *= 2
  return x[..., 0, :, :]


def _inverse_doubling(a_XWW):
  """(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is nilpotent (A^W = 0). Products of powers of A, which
  grow large when |A| is (the adversarial test)."""
  W = a_XWW.shape[-1]
  p = -a_XWW
  x = jnp.eye(W, dtype=a_XWW.dtype) + p
  span = 2
  while span < W:
    p = _einsum("...ab,...bc->...ac", p, p)
    x = x + _einsum("...ab,...bc->...ac", x, p)
    span *= 2
  return x


_INVERSE_FNS = {"right_looking": _inverse_right_looking, "solve_triangular": _inverse_solve_triangular,
                "blocked": _inverse_blocked, "doubling": _inverse_doubling}


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def unit_lower_inverse(a_XWW: jax.Array, variant: str = "right_looking") -> jax.Array:
  """(I + A)^-1 for A [..., W, W] strictly lower triangular, by `variant` (INVERSES). Every variant has
  the same backward: dA = -strict_tril(X^T dX X^T), two matmuls, so no variant's loop is differentiated."""
  return _INVERSE_FNS[variant](a_XWW)


def _unit_lower_inverse_fwd(a_XWW, variant):
  x = _INVERSE_FNS[variant](a_XWW)
  return x, x


def _unit_lower_inverse_bwd(variant, x_XWW, dx_XWW):
  W = x_XWW.shape[-1]
  da = -_einsum("...ba,...bc,...dc->...ad", x_XWW, dx_XWW, x_XWW)
  return (jnp.where(jnp.tri(W, k=-1, dtype=bool), da, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _to_chunks(x_BT, U, W, edge=False):
  """[B, T, ...] -> [U, B, W, ...] after padding T up to U * W with zeros, or with the last position's
  value if `edge` (a no-op when T = U * W). Only T is touched: B may be sharded (jnp.pad's edge mode
  slices every axis, which explicit sharding refuses on a sharded batch)."""
  B, T = x_BT.shape[:2]
  if U * W != T:
    tail = x_BT[:, -1:] if edge else jnp.zeros_like(x_BT[:, :1])
    x_BT = jnp.concatenate([x_BT, jnp.repeat(tail, U * W - T, axis=1)], axis=1)
  return jnp.moveaxis(x_BT.reshape((B, U, W) + x_BT.shape[2:]), 1, 0)


def _heads_to_chunks(x_BTNX, U, W):
  """[B, T, N, X] -> [U, B, N, W, X], head-major inside the chunk: one layout copy here, so every batched
  product below has its batch dims (u, b, n) leading and contiguous."""
  return jnp.moveaxis(_to_chunks(x_BTNX, U, W), 3, 2)


class _Chunks:
  """The per-chunk terms that do not depend on the state, for all U chunks at once ([U, B, N, ...])."""

  def __init__(self, q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, starts_BT, W, inverse):
    B, T, N, J = v_BTNJ.shape
    U = -(-T // W)
    f32 = jnp.float32
    q = _heads_to_chunks(expand_heads(q_BTKH, N).astype(f32), U, W)  # [U, B, N, W, H]
    k = _heads_to_chunks(expand_heads(k_BTKH, N).astype(f32), U, W)  # [U, B, N, W, H]
    v = _heads_to_chunks(v_BTNJ.astype(f32), U, W)  # [U, B, N, W, J]
    g = _heads_to_chunks(g_BTN.astype(f32)[..., None], U, W)[..., 0]  # [U, B, N, W]
    beta = _heads_to_chunks(beta_BTN.astype(f32)[..., None], U, W)[..., 0]  # [U, B, N, W]
    # Segment index: the count of starts so far in the row, so equal ids in two separate runs never match.
    # The padded tail (no new start) continues the row's last segment, with g = beta = k = 0: a no-op.
    starts = jnp.zeros((B, T), bool) if starts_BT is None else starts_BT
    seg_UBW = _to_chunks(jnp.cumsum(starts, axis=1, dtype=jnp.int32), U, W, edge=True)
    start_UBW = _to_chunks(starts, U, W)
    incoming_UB = seg_UBW[:, :, 0] - start_UBW[:, :, 0].astype(jnp.int32)  # the segment of the incoming state
    carry_UB1W = (seg_UBW == incoming_UB[:, :, None])[:, :, None]  # still in the incoming state's segment
    same_UBWW = seg_UBW[:, :, :, None] == seg_UBW[:, :, None, :]
    # The gate cumsum, restarted at each segment start inside the chunk: gamma_i = sum of g from i's
    # segment's first position in the chunk to i. A masked [W, W] matmul (its backward is one too).
    pair_UB1WW = (same_UBWW & jnp.tri(W, dtype=bool))[:, :, None]
    gamma = _einsum("ubnij,ubnj->ubni", pair_UB1WW.astype(f32), g)  # [U, B, N, W]
    last_UB1W = (seg_UBW == seg_UBW[:, :, -1:])[:, :, None]  # positions in the chunk's last segment

    diff_UBNWW = gamma[..., :, None] - gamma[..., None, :]
    decay_UBNWW = jnp.where(pair_UB1WW, jnp.exp(jnp.where(pair_UB1WW, diff_UBNWW, 0.0)), 0.0)
    kk_UBNWW = _einsum("ubnih,ubnjh->ubnij", k, k)
    a_UBNWW = jnp.where(jnp.tri(W, k=-1, dtype=bool), beta[..., None] * kk_UBNWW * decay_UBNWW, 0.0)
    t_UBNWW = unit_lower_inverse(a_UBNWW, inverse)
    carry_decay_UBNW = jnp.where(carry_UB1W, jnp.exp(gamma), 0.0)
    self.u_UBNWJ = _einsum("ubnij,ubnjd->ubnid", t_UBNWW, beta[..., None] * v)
    self.w_UBNWH = _einsum("ubnij,ubnjh->ubnih", t_UBNWW, (beta * carry_decay_UBNW)[..., None] * k)
    to_last_UBNW = jnp.where(last_UB1W, jnp.exp(jnp.where(last_UB1W, gamma[..., -1:] - gamma, 0.0)), 0.0)
    self.k_UBNWH = to_last_UBNW[..., None] * k
    self.decay_UBN = carry_decay_UBNW[..., -1]  # the incoming state's decay over the whole chunk (0: reset)
    self.shape = (B, T, N, J, U, W)
    self._q, self._k, self._decay, self._carry_decay = q, k, decay_UBNWW, carry_decay_UBNW

  def outputs(self, St_in_UBNJH):
    """o [U, B, N, W, J] from the state entering each chunk: o = (c exp(gamma) q - P w) S_in + P u, with
    P = tril(q k^T * decay). All chunks at once, outside the scan."""
    p_UBNWW = _einsum("ubnih,ubnjh->ubnij", self._q, self._k) * self._decay
    q_UBNWH = self._carry_decay[..., None] * self._q
    q_UBNWH = q_UBNWH - _einsum("ubnij,ubnjh->ubnih", p_UBNWW, self.w_UBNWH)
    return _einsum("ubnwh,ubnjh->ubnwj", q_UBNWH, St_in_UBNJH) + _einsum("ubnij,ubnjd->ubnid", p_UBNWW, self.u_UBNWJ)


def _state_step(St_BNJH, c, *, keep):
  """One chunk: S -> dec S + kd^T (u - w S), on the state transposed (St = S^T [B, N, J, H]). Emits the
  state entering the chunk when `keep`."""
  u, w, kd, dec = c
  delta_BNWJ = u - _einsum("bnwh,bnjh->bnwj", w, St_BNJH)
  St_next = dec[..., None, None] * St_BNJH + _einsum("bnwj,bnwh->bnjh", delta_BNWJ, kd)
  return St_next, (St_BNJH if keep else None)


def _chunk_states(c: _Chunks, S_BNHJ, *, keep: bool):
  """The scan over chunks: (final state [B, N, H, J], the states entering each chunk, transposed,
  [U, B, N, J, H], or None). Inside, the state is kept as S^T: every product then comes out of XLA's dot
  in the layout it is stored in, forward and backward, so neither the chunk states nor their cotangent
  are transposed (with S [H, J] the cotangent of the chunk states was copied once into its layout)."""
  xs = (c.u_UBNWJ, c.w_UBNWH, c.k_UBNWH, c.decay_UBN)
  St, St_in = jax.lax.scan(partial(_state_step, keep=keep), jnp.swapaxes(S_BNHJ, -1, -2), xs)
  return jnp.swapaxes(St, -1, -2), St_in


def gated_delta_rule_chunked(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, *, segment_ids_BT=None,
                             initial_state_BNHJ=None, chunk_size=64, inverse=DEFAULT_INVERSE):
  """The gated delta rule in chunks of `chunk_size` positions (the WY form), the reference's contract and
  return: (o [B, T, N, J] in v's dtype, final state [B, N, H, J] float32). Any T (the last chunk is
  padded inside the call); packed documents reset inside a chunk, with no padding to chunk multiples."""
  check_chunk_size(chunk_size)
  if inverse not in INVERSES:
    raise ValueError(f"inverse={inverse!r}: expected one of {INVERSES}")
  B, T, N, J = v_BTNJ.shape
  H = q_BTKH.shape[-1]
  # The per-chunk terms before the scope: the inverse's column loop is no chunk scan (the census counts the
  # scope's loops).
  c = _Chunks(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, segment_starts(segment_ids_BT, T), chunk_size, inverse)
  U, W = c.shape[4:]
  with jax.named_scope(CHUNK_SCOPE):
    S = jnp.zeros((B, N, H, J), jnp.float32) if initial_state_BNHJ is None else initial_state_BNHJ.astype(jnp.float32)
    # Only the state recurrence is sequential; the scan emits the chunk states (which its backward needs
    # anyway) and the outputs are one batched product after it.
    S, St_in_UBNJH = _chunk_states(c, S, keep=True)
    o_UBNWJ = c.outputs(St_in_UBNJH)
    o_BTNJ = jnp.transpose(o_UBNWJ, (1, 0, 3, 2, 4)).reshape(B, U * W, N, J)[:, :T]
  return o_BTNJ.astype(v_BTNJ.dtype), S


def gated_delta_rule(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, *, segment_ids_BT=None, initial_state_BNHJ=None,
                     impl="chunked", chunk_size=64):
  """The gated delta rule by `impl`: "chunked" (the default) or "reference" (the recurrence)."""
  if impl == "chunked":
    return gated_delta_rule_chunked(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, segment_ids_BT=segment_ids_BT,
                                    initial_state_BNHJ=initial_state_BNHJ, chunk_size=chunk_size)
  if impl == "reference":
    return gated_delta_rule_reference(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, segment_ids_BT=segment_ids_BT,
                                      initial_state_BNHJ=initial_state_BNHJ)
  raise ValueError(f"impl={impl!r}: expected 'chunked' or 'reference'")


# ------------------------------------------------------------------------- context parallelism
#
# The sequence sharded over mesh axis `context`, C shards in order. A shard maps the state entering it
# affinely: S_out = M S_in + S_local, with S_local its final state from zero and M [H, H] the product of
# its chunk transitions M_c = dec I - kd^T w (a reset inside the shard makes some M_c, so M, zero).
#   pass 1: each shard computes S_local and M only (a scan carrying both: no outputs, no chunk states);
#   pass 2: an all-gather of the C small (S_local, M) and a fold in shard order gives every shard's
#           incoming state (and the final state);
#   pass 3: each shard runs its chunks from its incoming state, outputs included.
# The chunk terms (A, its inverse, u, w) are computed once and serve passes 1 and 3.


def _transition_step(carry, c):
  S_BNHJ, M_BNHH = carry
  u, w, kd, dec = c
  kw_BNHH = _einsum("bnwh,bnwk->bnhk", kd, w)
  delta_BNWJ = u - _einsum("bnwk,bnkj->bnwj", w, S_BNHJ)
  S_BNHJ = dec[..., None, None] * S_BNHJ + _einsum("bnwh,bnwj->bnhj", kd, delta_BNWJ)
  M_BNHH = dec[..., None, None] * M_BNHH - _einsum("bnhk,bnkl->bnhl", kw_BNHH, M_BNHH)
  return (S_BNHJ, M_BNHH), None


def _shard_transition(c: _Chunks, B, N, H, J, axes):
  """Pass 1: (S_local [B, N, H, J], M [B, N, H, H]): S_out = M S_in + S_local over this shard's chunks."""
  eye = jnp.broadcast_to(jnp.eye(H, dtype=jnp.float32), (B, N, H, H))
  # The carry varies over `axes` as the shard's terms do (scan carries must match their update's type).
  init = jax.lax.pcast((jnp.zeros((B, N, H, J), jnp.float32), eye), axes, to="varying")
  (S, M), _ = jax.lax.scan(_transition_step, init, (c.u_UBNWJ, c.w_UBNWH, c.k_UBNWH, c.decay_UBN))
  return S, M


def gated_delta_rule_context_parallel(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, *, segment_ids_BT=None,
                                      initial_state_BNHJ=None, chunk_size=64, inverse=DEFAULT_INVERSE,
                                      axis="context"):
  """gated_delta_rule_chunked with T sharded over mesh axis `axis` (the current mesh's; without it, or at
  size 1, the plain chunked rule). Same contract and return; o comes back sharded as T is, the final state
  replicated over `axis` (its rows split as the batch's). T must divide by the axis size; a shard's length need not be a whole number of chunks (its
  last chunk is padded with no-op positions). Segment ids may span shards: a start is where the id
  changes, across shard edges too."""
  check_chunk_size(chunk_size)
  if inverse not in INVERSES:
    raise ValueError(f"inverse={inverse!r}: expected one of {INVERSES}")
  mesh = jax.sharding.get_abstract_mesh()
  C = 1 if mesh.empty else dict(mesh.shape).get(axis, 1)
  kw = dict(segment_ids_BT=segment_ids_BT, initial_state_BNHJ=initial_state_BNHJ, chunk_size=chunk_size,
            inverse=inverse)
  if C == 1:
    return gated_delta_rule_chunked(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, **kw)
  B, T, N, J = v_BTNJ.shape
  H = q_BTKH.shape[-1]
  if T % C:
    raise ValueError(f"gated_delta_rule_context_parallel: T={T} does not divide over mesh.{axis}={C}")
  seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
  S0 = () if initial_state_BNHJ is None else (initial_state_BNHJ.astype(jnp.float32),)

  def local(q, k, v, g, beta, seg, *S0):
    # A shard's first position opens a segment when its id differs from the previous shard's last one: that
    # one id per row comes one shard forward (the first shard's first position never starts one).
    prev_last = jax.lax.ppermute(seg[:, -1:], axis, [(i, i + 1) for i in range(C - 1)])
    prev_last = jnp.where(jax.lax.axis_index(axis) == 0, seg[:, :1], prev_last)
    starts = seg != jnp.concatenate([prev_last, seg[:, :-1]], axis=1)
    c = _Chunks(q, k, v, g, beta, starts, chunk_size, inverse)
    Bl = q.shape[0]  # this device's rows
    S_local, M = _shard_transition(c, Bl, N, H, J, varying)  # pass 1
    S_all = jax.lax.all_gather(S_local, axis, to="invarying")  # pass 2: [C, B, N, H, J], [C, B, N, H, H]
    M_all = jax.lax.all_gather(M, axis, to="invarying")
    # Without an initial state the fold starts from zeros shaped (and, under auto, sharded) as the gathered
    # states: a replicated zeros array made the fsdp-split rows gather over fsdp here.
    S, incoming = (S0[0] if S0 else jnp.zeros_like(S_all[0])), []
    for i in range(C):
      incoming.append(S)
      S = _einsum("bnhk,bnkj->bnhj", M_all[i], S) + S_all[i]
    S_in = jnp.stack(incoming)[jax.lax.axis_index(axis)]
    _, St_in = _chunk_states(c, S_in, keep=True)  # pass 3
    U, W = c.shape[4:]
    o = jnp.transpose(c.outputs(St_in), (1, 0, 3, 2, 4)).reshape(Bl, U * W, N, J)[:, :q.shape[1]]
    return o.astype(v.dtype), S

  P = jax.sharding.PartitionSpec
  # Rows split as the batch's logical axis says (data, fsdp, expert), T over `axis`: each device runs its own
  # rows' shard, and the pass-2 gathers move only its rows' states (manual over `axis` alone, XLA gathered
  # the fsdp-split rows of the states before the fold). Explicit: resharded onto that; auto: the shard_map
  # moves its inputs.
  rows = logical_spec(("batch",), (B,))[0]
  seq, rep = P(rows, axis), P(rows)
  varying = (() if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)) + (axis,)
  args = (q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, seg_BT)
  if is_explicit():
    args = tuple(jax.sharding.reshard(x, seq) for x in args)
    S0 = tuple(jax.sharding.reshard(x, rep) for x in S0)
  with jax.named_scope("gdn_context_parallel"):
    return jax.shard_map(local, in_specs=(seq,) * 6 + (rep,) * len(S0), out_specs=(seq, rep))(*args, *S0)
