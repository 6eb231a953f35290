"""Multi-head latent attention's decode step against a latent cache (models/mixers/mla.py), two ways.

The cache holds, per position, the normed compressed kv c [Rkv] and the roped rope key k_rope [Hr], shared by
every head. Head n's key is [k_b[:, n]^T c, k_rope] and its value v_b[:, n]^T c, so

    q_n . k_n = (k_b[:, n] q_nope_n) . c + q_rope_n . k_rope        (the absorbed query lives in Rkv)
    sum_s p_s v_s = v_b[:, n]^T (sum_s p_s c_s)                      (the output is projected once, after)

`absorbed_decode` attends against the latent rows directly: per cached position Rkv + Hr numbers are read and
nothing of [C, N, H] is built. `expanded_decode` rebuilds K/V from the rows first (the plain path, and the
reference the absorbed one is tested against). Plain math with no sharding annotations of their own: both run
inside an auto-axes region.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.nn.attention import gqa_attention_decode, with_new_slot
from meshlm.parallel.sharding import axes

EXPANDED = axes("batch", "heads", None, "head_dim")  # K/V rebuilt from the latent rows: [B, N, C, H]


def absorbed_decode(q_lat_BN1R: jax.Array, q_rope_BN1H: jax.Array, c_B1R: jax.Array, k_rope_B1H: jax.Array,
                    c_BCR: jax.Array, k_rope_BCH: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
  """The latent output [B, N, 1, Rkv] (heads-first rows, as the query's): sum over the cache's slots (mask
  [B, 1, 1, 1, C]) and the new position of softmax(q_lat . c + q_rope . k_rope) c. q_lat: the query with k_b
  absorbed (q_nope k_b^T)."""
  with jax.named_scope("attention"):
    f32 = jnp.float32
    q_lat, q_rope = q_lat_BN1R[:, :, 0], q_rope_BN1H[:, :, 0]  # [B, N, Rkv], [B, N, Hr]
    s_cache = jnp.einsum("bnr,bcr->bnc", q_lat, c_BCR) + jnp.einsum("bnh,bch->bnc", q_rope, k_rope_BCH)
    s_new = jnp.einsum("bnr,br->bn", q_lat, c_B1R[:, 0]) + jnp.einsum("bnh,bh->bn", q_rope, k_rope_B1H[:, 0])
    s = jnp.concatenate([s_cache, s_new[..., None]], axis=-1).astype(f32) * scale  # [B, N, C + 1]
    s = jnp.where(with_new_slot(mask), s, jnp.finfo(f32).min)
    p = jax.nn.softmax(s, axis=-1).astype(c_BCR.dtype)
    C = c_BCR.shape[1]
    o = jnp.einsum("bnc,bcr->bnr", p[..., :C], c_BCR) + p[..., C:] * c_B1R  # [B, N, Rkv]
    return o[:, :, None]


def expanded_decode(q_nope_BN1H, q_rope_BN1H, c_B1R, k_rope_B1H, c_BCR, k_rope_BCH, mask, k_b_RNH, v_b_RNH, *,
                    scale: float, dense) -> jax.Array:
  """The same step with K/V rebuilt from the latent rows (k_b, v_b through `dense`): [B, N, 1, Hv]."""
  with jax.named_scope("k_b"):
    k_nope = dense(c_BCR, k_b_RNH, "bcr,rnh->bnch", EXPANDED)  # [B, N, C, Hn]
    k_nope_new = dense(c_B1R, k_b_RNH, "btr,rnh->bnth", EXPANDED)  # [B, N, 1, Hn]
  with jax.named_scope("v_b"):
    v = dense(c_BCR, v_b_RNH, "bcr,rnh->bnch", EXPANDED)  # [B, N, C, Hv]
    v_new = dense(c_B1R, v_b_RNH, "btr,rnh->bnth", EXPANDED)

  def key(k_nope_BNCH, k_rope_BCH):
    rope = jnp.broadcast_to(k_rope_BCH[:, None], k_nope_BNCH.shape[:3] + k_rope_BCH.shape[-1:])
    return jnp.concatenate([k_nope_BNCH, rope], axis=-1)  # [B, N, C, Hn + Hr]
  q = jnp.concatenate([q_nope_BN1H, q_rope_BN1H], axis=-1)  # [B, N, 1, Hn + Hr]
  return gqa_attention_decode(q, key(k_nope_new, k_rope_B1H), v_new, key(k_nope, k_rope_BCH), v, mask, scale=scale)
