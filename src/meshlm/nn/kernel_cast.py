"""A float32 kernel's cast to the compute dtype, kept where the layer reads it (inside the layer loop).

XLA:TPU's bfloat16-propagation pass turns a loop-carried float32 stack whose only use in the loop is (slice,
convert to bfloat16) into a bfloat16 stack converted before the loop: a whole-stack bfloat16 copy of the kernel
beside the float32 one, held through the layer loops (llama3-8b on v5p-8 at fsdp=4: 3.0 GiB per device for the
dense kernels; mixtral-8x7b's experts, 3.5 GiB per loop; docs/compile.md). `cast_bits` rounds by integer ops,
which have no bfloat16 form, so the pass leaves the cast in the loop; values and gradient are astype's, bit for bit
(tests/test_moe_kernel_cast.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

@jax.custom_vjp
def cast_bits(w: jax.Array) -> jax.Array:
  """w (float32) rounded to bfloat16 by integer ops on its bits: round to nearest even, as astype rounds (the
  reference; NaN stays NaN). The gradient is astype's: the cotangent in float32."""
  u = jax.lax.bitcast_convert_type(w, jnp.uint32)
  # Add half an ulp of bfloat16 (less one, plus the kept bit's lowest: ties to even), keep the high 16 bits.
  r = (u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))) >> 16
  b = jax.lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isnan(w), jnp.array(jnp.nan, jnp.bfloat16), b)


cast_bits.defvjp(lambda w: (cast_bits(w), None), lambda _, g: (g.astype(jnp.float32),))


def in_layer(w: jax.Array, dt, bits: bool = True) -> jax.Array:
  """w in dtype dt, cast here, in the layer: float32 to bfloat16 by cast_bits (no whole-stack copy), else astype.
  bits=False (the `layer_cast=astype` key): astype always, which XLA:TPU hoists as whole-stack copies."""
  if bits and w.dtype == jnp.float32 and jnp.dtype(dt) == jnp.bfloat16:
    return cast_bits(w)
  return w.astype(dt)
