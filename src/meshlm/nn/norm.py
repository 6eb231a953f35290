"""RMSNorm."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import constrain


def rms_norm(scale_D: jax.Array, x: jax.Array, eps: float, *, plus_one: bool = False) -> jax.Array:
  """x / rms(x) * scale over the last dim, computed in float32. plus_one gives gemma's (1 + w)."""
  with jax.named_scope("rms_norm"):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    # A sharded scale vector would shard the activation's last dim: use it whole.
    scale = constrain(scale_D.astype(jnp.float32), (None,))
    if plus_one:
      scale = 1.0 + scale
    return (y * scale).astype(x.dtype)
