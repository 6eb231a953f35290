"""Rotary position embeddings, computed from the positions (never a whole table to index into)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
  """[head_dim // 2] inverse frequencies, with llama3-style scaling when given."""
  inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if not scaling:
    return inv
  factor = scaling["factor"]
  low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
  old_len = scaling["original_max_position"]
  wavelen = 2 * math.pi / inv
  # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
  smooth = (old_len / wavelen - low) / (high - low)
  mid = (1 - smooth) * inv / factor + smooth * inv
  out = jnp.where(wavelen > old_len / low, inv / factor, inv)
  is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
  return jnp.where(is_mid, mid, out)


def rope_angles(positions_BT: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape [B, T, head_dim] for the given positions (HF's rotate-half layout)."""
  ang = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  ang = jnp.concatenate([ang, ang], axis=-1)  # [B, T, H]
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
  with jax.named_scope("rope"):
    half = x_BTNH.shape[-1] // 2
    xf = x_BTNH.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    y = xf * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
    return y.astype(x_BTNH.dtype)
