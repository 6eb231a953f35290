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
