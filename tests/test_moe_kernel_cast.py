"""The expert kernels' cast to the compute dtype stays in the layer loop (nn/kernel_cast.py cast_bits), by the one rule of
every kernel: the moe part hands the layer Context.cast (tests/test_kernel_cast.py holds the rule's train steps, MoE
included, to astype's bit for bit).

XLA:TPU's bfloat16-propagation pass turns a float32 stack that a loop only slices and converts to bfloat16
into a bfloat16 stack converted before the loop: a whole-stack copy of every layer's expert kernels, in the
forward and again in the backward (issue 45's MoE table, docs/compile.md). cast_bits rounds by integer ops, which have
no bfloat16 form: bit-identical to astype (the reference), gradient too."""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.nn.kernel_cast import cast_bits
from meshlm.nn.moe import dropless

from moe_helpers import settings


def _float32_cases() -> np.ndarray:
  """Random bit patterns (every exponent: zeros, subnormals, infinities, NaNs) and the rounding edges."""
  bits = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 16, dtype=np.uint64).astype(np.uint32)
  f = np.finfo(np.float32)
  # 1 + 2^-8: a tie that rounds down to even; 1 + 3 * 2^-8: a tie that rounds up; max: rounds to inf.
  edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, f.max, -f.max, f.tiny, 1e-45, -1e-45, 1.0,
                    1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20], np.float32)
  return np.concatenate([bits.view(np.float32), edges])


def _truncate(w):
  """A deliberately wrong cast: the high 16 bits, rounding toward zero."""
  u = jax.lax.bitcast_convert_type(w, jnp.uint32)
  return jax.lax.bitcast_convert_type((u >> 16).astype(jnp.uint16), jnp.bfloat16)


def test_cast_bits_is_astype_bit_for_bit_and_so_is_its_gradient():
  x = _float32_cases()
  ref = np.asarray(jax.jit(lambda w: w.astype(jnp.bfloat16))(x))
  nan = np.isnan(x)

  def same(fn) -> bool:
    got = np.asarray(jax.jit(fn)(x))
    return bool((np.isnan(got.astype(np.float32)) == nan).all()
                and (got[~nan].view(np.uint16) == ref[~nan].view(np.uint16)).all())

  assert same(cast_bits)
  assert not same(_truncate)  # the check can fail
  g = jnp.asarray(np.random.default_rng(1).standard_normal(64), jnp.bfloat16)
  w = jnp.asarray(x[:64])
  got = jax.vjp(cast_bits, w)[1](g)[0]
  want = jax.vjp(lambda v: v.astype(jnp.bfloat16), w)[1](g)[0]
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_retired_knob_of_a_saved_config_is_dropped():
  """model.parts.moe.kernel_cast (convert | bits) is read nowhere now (the expert kernels follow Context.cast): a saved
  config holding it loads to the same section as one without it."""
  from meshlm.config import load_config
  from meshlm.models.ffns import moe as F
  from meshlm.models.model import resolve
  plain = F.knobs(resolve(load_config("model=mixtral-tiny")).m)
  for value in ("convert", "bits"):
    assert F.knobs(resolve(load_config("model=mixtral-tiny", f"model.parts.moe.kernel_cast={value}")).m) == plain
  assert "kernel_cast" not in F.MoEConfig.model_fields


L, E, D, F, A = 3, 2, 128, 256, 32  # layers, experts, embed, mlp, routed rows


# What Context.cast does in training (float32 to bfloat16 by integer rounding); the control, astype.
CASTS = {"per_layer": lambda w, dt: cast_bits(w), "astype": lambda w, dt: w.astype(dt)}


def _layers(kernels, xs_AD, sizes_E, cast: str):
  """A layer scan of expert layers over float32 stacks [L, E, D, F], rows in bfloat16. The forward alone (one
  compile per arm in seconds): the backward's loop casts its recomputed layer the same way."""
  knobs, opts = settings(E, 2, grouped_matmul="ragged", cast=CASTS[cast])

  def layer(x, k):
    return x + dropless.expert_rows(x, sizes_E, *k, knobs, opts), None
  return jax.lax.scan(layer, xs_AD, kernels)[0]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")
def test_tpu_layer_scan_holds_no_bfloat16_copy_of_the_kernel_stacks():
  from meshlm.parallel import topology as TP
  sharding = jax.sharding.SingleDeviceSharding(TP.devices(TP.parse("v5p:1x1x1"))[0])
  S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
  args = ((S((L, E, D, F), jnp.float32), S((L, E, D, F), jnp.float32), S((L, E, F, D), jnp.float32)),
          S((A, D), jnp.bfloat16), S((E,), jnp.int32))
  stacks = {}
  for cast in CASTS:
    hlo = jax.jit(_layers, static_argnums=3).lower(*args, cast).compile().as_text()
    stacks[cast] = set(re.findall(rf"bf16\[{L},{E},\d+,\d+\]", hlo))  # a bfloat16 value of a whole stack
  assert stacks["per_layer"] == set()
  # Control: astype's cast is hoisted out of the loops, whole stacks in bfloat16.
  assert stacks["astype"] == {f"bf16[{L},{E},{D},{F}]", f"bf16[{L},{E},{F},{D}]"}
