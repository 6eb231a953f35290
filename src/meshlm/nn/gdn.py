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
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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
# Everything but the three state lines is computed for all chunks at once before the scan; the scan over
# chunks carries S and emits o as its output (no buffer written in place).

from functools import partial  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402

INVERSES = ("right_looking", "solve_triangular", "blocked", "doubling")
_HI = jax.lax.Precision.HIGHEST  # float32 matmuls on every backend (TPU's default would round to bf16)


def check_chunk_size(chunk_size: int) -> None:
  """The chunk must be a power of two (the blocked and doubling inverses halve it; chunks tile shards)."""
  if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ConfigError(f"model.gdn_chunk_size={chunk_size!r}: the Gated DeltaNet chunk must be a power of two "
                      "(16, 32, 64, ...); set model.gdn_chunk_size=64")


def _einsum(spec, *xs):
  return jnp.einsum(spec, *xs, precision=_HI)


def _inverse_right_looking(a_XWW, *, skip_column=None):
  """Right-looking: once row j is final, subtract a[i, j] * x_j from every later row (a loop over columns).
  skip_column drops one column's update: the negative control of the tests, never used otherwise."""
  W = a_XWW.shape[-1]
  x = jnp.broadcast_to(jnp.eye(W, dtype=a_XWW.dtype), a_XWW.shape)
  for j in range(W - 1):
    if j == skip_column:
      continue
    # a[i, j] is zero for i <= j, so rows up to j (already final) are untouched.
    x = x - a_XWW[..., :, j:j + 1] * x[..., j:j + 1, :]
  return x


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


def _to_chunks(x_BT, U, W, mode="constant"):
  """[B, T, ...] -> [U, B, W, ...] after padding T up to U * W (zeros, or `mode` as jnp.pad's; a no-op when
  T = U * W)."""
  B, T = x_BT.shape[:2]
  if U * W != T:
    x_BT = jnp.pad(x_BT, ((0, 0), (0, U * W - T)) + ((0, 0),) * (x_BT.ndim - 2), mode=mode)
  return jnp.moveaxis(x_BT.reshape((B, U, W) + x_BT.shape[2:]), 1, 0)


class _Chunks:
  """The per-chunk terms that do not depend on the state, for all U chunks at once ([U, B, N, ...])."""

  def __init__(self, q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, segment_ids_BT, W, inverse):
    B, T, N, J = v_BTNJ.shape
    U = -(-T // W)
    f32 = jnp.float32
    q = _to_chunks(expand_heads(q_BTKH, N).astype(f32), U, W)  # [U, B, W, N, H]
    k = _to_chunks(expand_heads(k_BTKH, N).astype(f32), U, W)  # [U, B, W, N, H]
    v = _to_chunks(v_BTNJ.astype(f32), U, W)  # [U, B, W, N, J]
    g = _to_chunks(g_BTN.astype(f32), U, W)  # [U, B, W, N]
    beta = _to_chunks(beta_BTN.astype(f32), U, W)  # [U, B, W, N]
    # Segment index: the count of starts so far in the row, so equal ids in two separate runs never match.
    # The padded tail (no new start) continues the row's last segment, with g = beta = k = 0: a no-op.
    starts = segment_starts(segment_ids_BT, T)
    starts = jnp.zeros((B, T), bool) if starts is None else starts
    seg_UBW = _to_chunks(jnp.cumsum(starts, axis=1, dtype=jnp.int32), U, W, mode="edge")
    start_UBW = _to_chunks(starts, U, W)
    incoming_UB = seg_UBW[:, :, 0] - start_UBW[:, :, 0].astype(jnp.int32)  # the segment of the incoming state
    carry_UBW = seg_UBW == incoming_UB[:, :, None]  # position still in the incoming state's segment
    same_UBWW = seg_UBW[:, :, :, None] == seg_UBW[:, :, None, :]
    causal_WW = jnp.tri(W, dtype=bool)
    # The gate cumsum, restarted at each segment start inside the chunk: gamma_i = sum of g from i's
    # segment's first position in the chunk to i.
    cum_UBWN = jnp.cumsum(g, axis=2)
    first_UBW = jax.lax.cummax(jnp.where(start_UBW | (jnp.arange(W) == 0), jnp.arange(W), 0), axis=2)
    before_UBWN = jnp.take_along_axis(cum_UBWN - g, first_UBW[..., None], axis=2)
    gamma = jnp.moveaxis(cum_UBWN - before_UBWN, 3, 2)  # [U, B, N, W]
    last_UBW = seg_UBW == seg_UBW[:, :, -1:]  # positions in the chunk's last segment

    pair_UBWW = same_UBWW & causal_WW
    diff_UBNWW = gamma[..., :, None] - gamma[..., None, :]
    decay_UBNWW = jnp.where(pair_UBWW[:, :, None], jnp.exp(jnp.where(pair_UBWW[:, :, None], diff_UBNWW, 0.0)), 0.0)
    beta_UBNW = jnp.moveaxis(beta, 3, 2)
    kk_UBNWW = _einsum("ubinh,ubjnh->ubnij", k, k)
    a_UBNWW = jnp.where(jnp.tri(W, k=-1, dtype=bool), beta_UBNW[..., None] * kk_UBNWW * decay_UBNWW, 0.0)
    t_UBNWW = unit_lower_inverse(a_UBNWW, inverse)
    carry_decay_UBNW = jnp.where(carry_UBW[:, :, None], jnp.exp(gamma), 0.0)
    self.u_UBNWJ = _einsum("ubnij,ubjnd->ubnid", t_UBNWW, beta[..., None] * v)
    self.w_UBNWH = _einsum("ubnij,ubjnh->ubnih", t_UBNWW,
                           jnp.moveaxis(beta_UBNW * carry_decay_UBNW, 2, 3)[..., None] * k)
    self.p_UBNWW = _einsum("ubinh,ubjnh->ubnij", q, k) * decay_UBNWW
    self.q_UBWNH = jnp.moveaxis(carry_decay_UBNW, 2, 3)[..., None] * q  # [U, B, W, N, H]
    gamma_last = gamma[..., -1:]
    to_last_UBNW = jnp.where(last_UBW[:, :, None], jnp.exp(jnp.where(last_UBW[:, :, None], gamma_last - gamma, 0.0)),
                             0.0)
    self.k_UBWNH = jnp.moveaxis(to_last_UBNW, 2, 3)[..., None] * k
    self.decay_UBN = carry_decay_UBNW[..., -1]  # the incoming state's decay over the whole chunk (0: reset)
    self.shape = (B, T, N, J, U, W)


def _chunk_step(S_BNHJ, c):
  u, w, p, qd, kd, dec = c
  delta_BNWJ = u - _einsum("bnwh,bnhj->bnwj", w, S_BNHJ)
  o_BWNJ = _einsum("bwnh,bnhj->bwnj", qd, S_BNHJ) + _einsum("bnij,bnjd->bind", p, delta_BNWJ)
  S_BNHJ = dec[..., None, None] * S_BNHJ + _einsum("bwnh,bnwj->bnhj", kd, delta_BNWJ)
  return S_BNHJ, o_BWNJ


def gated_delta_rule_chunked(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, *, segment_ids_BT=None,
                             initial_state_BNHJ=None, chunk_size=64, inverse="right_looking"):
  """The gated delta rule in chunks of `chunk_size` positions (the WY form), the reference's contract and
  return: (o [B, T, N, J] in v's dtype, final state [B, N, H, J] float32). Any T (the last chunk is
  padded inside the call); packed documents reset inside a chunk, with no padding to chunk multiples."""
  check_chunk_size(chunk_size)
  if inverse not in INVERSES:
    raise ValueError(f"inverse={inverse!r}: expected one of {INVERSES}")
  B, T, N, J = v_BTNJ.shape
  H = q_BTKH.shape[-1]
  with jax.named_scope("gdn_chunked"):
    c = _Chunks(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, segment_ids_BT, chunk_size, inverse)
    U, W = c.shape[4:]
    S = jnp.zeros((B, N, H, J), jnp.float32) if initial_state_BNHJ is None else initial_state_BNHJ.astype(jnp.float32)
    S, o_UBWNJ = jax.lax.scan(_chunk_step, S, (c.u_UBNWJ, c.w_UBNWH, c.p_UBNWW, c.q_UBWNH, c.k_UBWNH, c.decay_UBN))
    o_BTNJ = jnp.moveaxis(o_UBWNJ, 0, 1).reshape(B, U * W, N, J)[:, :T]
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
