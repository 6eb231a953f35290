"""Causal grouped-query attention with segment masking (packed documents never see each other)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.nn import kv_cache
from meshlm.parallel.sharding import auto_region


def attention_mask(segment_ids_BT: jax.Array | None, T: int, sliding_window: int | None = None) -> jax.Array:
  """[B or 1, 1, 1, T, T] boolean: causal, same segment, and inside the window if one is given."""
  q = jnp.arange(T)[:, None]
  k = jnp.arange(T)[None, :]
  mask = k <= q
  if sliding_window is not None:
    mask &= q - k < sliding_window
  mask = mask[None, None, None]
  if segment_ids_BT is not None:
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]  # [B, T, T]
    mask = mask & same[:, None, None]
  return mask


def gqa_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: jax.Array, *,
                  scale: float, softcap: float | None = None) -> jax.Array:
  """softmax(q k^T * scale) v with K kv heads shared by groups of G = N // K query heads.

  Returns [B, T, K, G, H]: left grouped, so that the output projection contracts it directly (a
  reshape back to [B, T, N, H] would sit between that projection's gradient dot and the transpose
  after it). Plain math with no sharding annotations of its own (it runs inside an auto-axes region).
  """
  with jax.named_scope("attention"):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q = jnp.reshape(q_BTNH, (B, T, K, N // K, H))
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH).astype(jnp.float32) * scale
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p, v_BSKH)


def self_attention(p: dict, x_BTD: jax.Array, ctx, state: dict | None = None, *, scale: float,
                   softcap: float | None = None, q_norm=None, k_norm=None) -> tuple[jax.Array, dict | None]:
  """Projections, RoPE and GQA: (output [B, T, D], the layer's new KV cache or None).

  p: q [D, N, H], k/v [D, K, H], o [N, H, D]. ctx.here carries this layer's RoPE tables, mask and
  cache slots; ctx.dense is the projection. q_norm/k_norm are optional per-head functions applied
  before RoPE (qwen3, gemma3). state is the layer's cache {"k", "v"} [B, C, K, H] when decoding;
  prefill builds it from the prompt's keys and values, train leaves it None.
  """
  from meshlm.nn.rope import apply_rope
  dt = x_BTD.dtype
  dense = ctx.dense
  heads = ("batch", "length", "heads", "head_dim")
  kv = ("batch", "length", "kv_heads", "head_dim")
  with jax.named_scope("q"):
    q = dense(x_BTD, p["q"].astype(dt), "btd,dnh->btnh", heads)
  with jax.named_scope("k"):
    k = dense(x_BTD, p["k"].astype(dt), "btd,dkh->btkh", kv)
  with jax.named_scope("v"):
    v = dense(x_BTD, p["v"].astype(dt), "btd,dkh->btkh", kv)
  if q_norm is not None:
    q, k = q_norm(q), k_norm(k)
  here = ctx.here
  q, k = apply_rope(q, here.cos, here.sin), apply_rope(k, here.cos, here.sin)
  if ctx.mode == "prefill":
    state = {"k": kv_cache.fill(k, here.cache), "v": kv_cache.fill(v, here.cache)}
  elif ctx.mode == "decode":
    # The new position goes into its slot first, then attends over the whole cache.
    k, v = kv_cache.write(state["k"], k, here.cache), kv_cache.write(state["v"], v, here.cache)
    state = {"k": k, "v": v}
  # The attention core and the output projection run in one auto-axes region. Under explicit sharding
  # every einsum output would otherwise carry a sharding annotation between its dot and the
  # transpose after it (the core's own einsums, and the incoming gradient of the output projection
  # in the backward pass), which XLA cannot fold. Inside the region XLA folds them as under auto;
  # the output projection still goes through dense.
  def attend_and_project(q, k, v, mask, w_o):
    o = gqa_attention(q, k, v, mask, scale=scale, softcap=softcap)  # [B, T, K, G, H]
    w_o = jnp.reshape(w_o, o.shape[2:] + w_o.shape[-1:])  # [N, H, D] -> [K, G, H, D]
    with jax.named_scope("o"):
      return dense(o, w_o, "btkgh,kghd->btd", ("batch", "length", "act_embed"))
  region = auto_region(attend_and_project, ("batch", "length", "act_embed"), x_BTD.shape)
  return region(q, k, v, here.mask, p["o"].astype(dt)), state
