"""Rotary position embeddings, computed from the positions (never a whole table to index into)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.parallel.sharding import is_explicit, platform



def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
  """[head_dim // 2] inverse frequencies, with llama3-style or linear scaling when given."""
  inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if not scaling:
    return inv
  factor = scaling["factor"]
  if scaling.get("rope_type", "llama3") == "linear":
    # Positions divided by factor, i.e. every frequency divided by it (gemma3's global layers).
    return inv / factor
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


def fold_sign(sin_BTH: jax.Array) -> jax.Array:
  """sin [B, T, H] (rotate-half layout, [s, s]) with its first half negated, [-s, s]: the factor apply_rope takes,
  built once per step with cos and sin (models/context.py)."""
  half = sin_BTH.shape[-1] // 2
  return jnp.concatenate([-sin_BTH[..., :half], sin_BTH[..., half:]], axis=-1)


def resolve_swap(key: str, platform: str) -> str:
  """The rope_swap key on a platform: matmul or roll (auto: matmul on TPU, roll elsewhere)."""
  return key if key != "auto" else "matmul" if platform == "tpu" else "roll"


def swap_halves(x_BNTH: jax.Array, by_matmul: bool) -> jax.Array:
  """roll(x, H/2) over the last axis, [x2, x1], exactly, in float32. by_matmul: as the product with the [H, H]
  permutation matrix (one nonzero term per output, accumulated in float32: exact for bfloat16 and, at HIGHEST
  precision, float32 inputs), which XLA:TPU fuses with apply_rope's products into one full-width pass; a roll there
  is two 64-lane slices and a concatenate that XLA:TPU writes out between three fusions (docs/tpu.md). Otherwise
  jnp.roll. An inf or NaN in a row spreads over that row's lanes by the product (inf x 0), where the roll keeps it
  in its two."""
  H = x_BNTH.shape[-1]
  if not by_matmul:
    return jnp.roll(x_BNTH, H // 2, axis=-1).astype(jnp.float32)
  perm_HH = np.roll(np.eye(H, dtype=np.float32), H // 2, axis=1)  # x @ perm = roll(x, H/2)
  return jnp.einsum("...h,hg->...g", x_BNTH, jnp.asarray(perm_HH, x_BNTH.dtype), preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST)


def apply_rope(x_BNTH: jax.Array, cos_BTH: jax.Array, sin_signed_BTH: jax.Array,
               by_matmul: bool | None = None) -> jax.Array:
  """x [B, N, T, H], heads-first rows (every attention core's), rotated by cos and the sign-folded sin [B, T, H]
  (fold_sign): x * cos + roll(x, H/2) * sin_signed in float32, HF's x * cos + rotate_half(x) * sin bit for bit
  (the negation moves from x's half to sin's, and is exact). One full-width pass: the halves are swapped on the
  MXU on TPU (swap_halves; by_matmul, the `rope_swap` key through models/context, forces one or the other). The gradient is the same rotation by the opposite angle, swapping the halves of the
  cotangent as it comes (as the rotate-half formula's, bit for bit: both round to x's dtype once)."""
  with jax.named_scope("rope"):
    by_matmul = platform() == "tpu" if by_matmul is None else by_matmul
    return _rotate(x_BNTH, cos_BTH, sin_signed_BTH, by_matmul)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotate(x_BNTH, cos_BTH, sin_signed_BTH, by_matmul: bool):
  xf = x_BNTH.astype(jnp.float32)
  y = xf * cos_BTH[:, None] + swap_halves(x_BNTH, by_matmul) * sin_signed_BTH[:, None]
  return y.astype(x_BNTH.dtype)


def _rotate_fwd(x_BNTH, cos_BTH, sin_signed_BTH, by_matmul):
  return _rotate(x_BNTH, cos_BTH, sin_signed_BTH, by_matmul), (x_BNTH, cos_BTH, sin_signed_BTH)


def _rotate_bwd(by_matmul, res, g_BNTH):
  x_BNTH, cos_BTH, sin_signed_BTH = res
  gf = g_BNTH.astype(jnp.float32)
  if by_matmul:
    # d/dx: the transpose of the rotation by angle a is the rotation by -a: cos, and the folded sin negated.
    dx = _rotate(g_BNTH, cos_BTH, -sin_signed_BTH, by_matmul)
  else:
    # The rotate-half formula's own transpose, g cos + [u2, 0] + [0, -u1] with u = g sin, written as autodiff
    # wrote it: XLA:CPU's LLVM contracts its multiply-adds into FMAs as it did for the former apply_rope, so the
    # gradient stays bit-identical at every optimization level (the rotation by -a rounds one add differently).
    half = x_BNTH.shape[-1] // 2
    u = gf * fold_sign(sin_signed_BTH)[:, None]  # fold_sign undoes itself: the plain sin
    pad = [(0, 0)] * (u.ndim - 1)
    dx = (gf * cos_BTH[:, None] + jnp.pad(u[..., half:], pad + [(0, half)])
          + jnp.pad(-u[..., :half], pad + [(half, 0)])).astype(g_BNTH.dtype)
  # The tables' own cotangents (the context computes them from integer positions, so XLA drops these).
  dcos = jnp.sum(gf * x_BNTH.astype(jnp.float32), axis=1).astype(cos_BTH.dtype)
  dsin = jnp.sum(gf * swap_halves(x_BNTH, by_matmul), axis=1).astype(sin_signed_BTH.dtype)
  # A custom VJP returns its primals' types: under explicit sharding each cotangent takes its input's sharding
  # (the products above take the sharded operand's, where an input came in whole).
  return tuple(_like(d, a) for d, a in ((dx, x_BNTH), (dcos, cos_BTH), (dsin, sin_signed_BTH)))


def _like(d: jax.Array, a: jax.Array) -> jax.Array:
  if not is_explicit() or jax.typeof(d).sharding.spec == jax.typeof(a).sharding.spec:
    return d
  return jax.sharding.reshard(d, jax.typeof(a).sharding.spec)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def apply_rope_interleave(x_BNTH: jax.Array, cos_BTH: jax.Array, sin_signed_BTH: jax.Array) -> jax.Array:
  """RoPE on adjacent pairs (x0, x1), (x2, x3), ... (transformers' apply_rotary_pos_emb_interleave): pair i
  turns by the angle of cos[..., i] (the first half of the rotate-half layout), and the output is laid out
  de-interleaved, [x_even', x_odd']. Queries and keys are both laid out so, which leaves their dot products
  those of the interleaved rotation. x [B, N, T, H] (heads-first rows, as apply_rope's); cos and the sign-folded
  sin as apply_rope takes them, whose second half is sin's own."""
  with jax.named_scope("rope"):
    half = x_BNTH.shape[-1] // 2
    cos, sin = cos_BTH[:, None, :, :half], sin_signed_BTH[:, None, :, half:]
    xf = x_BNTH.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x_BNTH.dtype)


# --- YaRN (DeepSeek-V3, Qwen long-context): frequencies and angles straight from the positions. ---

def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_attention_factor(scaling: dict) -> float:
  """The cos/sin magnitude YaRN applies (transformers' _compute_yarn_parameters): attention_factor when given,
  else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (non-zero), else
  mscale(factor)."""
  if scaling.get("attention_factor") is not None:
    return float(scaling["attention_factor"])
  factor = float(scaling["factor"])
  mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
  if mscale and mscale_all_dim:
    return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
  return _yarn_mscale(factor)


def softmax_mscale(scaling: dict | None) -> float:
  """The factor on MLA's softmax scale (transformers' yarn_apply_mscale): mscale(factor, mscale_all_dim) ** 2
  when the rope is scaled and mscale_all_dim is set (non-zero), else 1. A second YaRN correction, beside the
  attention factor that cos and sin carry."""
  if not scaling or not scaling.get("mscale_all_dim"):
    return 1.0
  return _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def yarn_inv_frequencies(head_dim: int, theta: float, scaling: dict) -> jax.Array:
  """[head_dim // 2] YaRN inverse frequencies: interpolated (divided by factor) below the
  beta_slow rotation count over the original context, kept above beta_fast, ramped between."""
  # float32 NumPy on constants, as transformers computes them: XLA would contract the blend below into fused
  # multiply-adds, an ulp off in the ramp's frequencies, which at position 163,839 moves cos by 3e-5.
  factor = np.float32(scaling["factor"])
  old_len = float(scaling["original_max_position"])
  beta_fast, beta_slow = float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0))
  # theta ** (2i / head_dim) correctly rounded to float32 (torch's float32 pow is; NumPy's is not always).
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  pos_freqs = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)
  extrapolated, interpolated = np.float32(1.0) / pos_freqs, np.float32(1.0) / (factor * pos_freqs)

  def dim_of(rotations: float) -> float:  # the dimension index that turns `rotations` times over old_len
    return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(dim_of(beta_fast)), 0)
  high = min(math.ceil(dim_of(beta_slow)), head_dim - 1)
  high = high + 0.001 if low == high else high  # a zero-width ramp would divide by zero
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0.0, 1.0)
  keep = np.float32(1.0) - ramp  # 1: extrapolate (high frequency), 0: interpolate (low frequency)
  return jnp.asarray(interpolated * (np.float32(1.0) - keep) + extrapolated * keep, dtype=jnp.float32)


def is_yarn(scaling: dict | None) -> bool:
  return bool(scaling) and scaling.get("rope_type", scaling.get("type")) == "yarn"


def freqs_at(positions_BT: jax.Array, head_dim: int, theta: float, scaling: dict | None = None
             ) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, head_dim] (rotate-half layout) for these positions, for every rope kind.

  The angles are computed from the positions: no [max_position, head_dim] table is built and then
  indexed (with YaRN's 163,840 positions that table is 5M elements per layer per step, nearly all
  of it thrown away). For YaRN, cos and sin carry the attention factor.
  """
  if not is_yarn(scaling):
    return rope_angles(positions_BT, inv_frequencies(head_dim, theta, scaling))
  cos, sin = rope_angles(positions_BT, yarn_inv_frequencies(head_dim, theta, scaling))
  a = yarn_attention_factor(scaling)
  return cos * a, sin * a
