"""nn/decode_attention.py: the Pallas decode kernel (interpret mode on CPU) against gqa_attention_decode, the xla
path, on the cache slots nn/kv_cache.decode_slots says a row reads: rows of different lengths, a ring that wrapped,
soft-cap, GQA ratios 1 and 2, a row read from the stacked cache in place; and a row length off by one fails."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.nn import attention as A, decode_attention as D, kv_cache

TOL = 2e-6  # float32: the online softmax sums in another order


def _case(seed, B, N, K, C, H, cur, L=1):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return f(B, N, 1, H), f(B, K, 1, H), f(B, K, 1, H), f(L, B, K, C, H), f(L, B, K, C, H), jnp.asarray(cur, jnp.int32)


# (name, B, N, K, C, H, rows' new positions, softcap, layers in the stack, block): full caches never wrap (C > cur).
CASES = [
    ("gqa2-full", 3, 4, 2, 64, 8, [1, 17, 63], None, 1, 16),
    ("mha-softcap", 2, 2, 2, 48, 8, [30, 47], 5.0, 1, 16),
    ("ring-wrapped", 4, 4, 2, 32, 8, [7, 32, 45, 95], None, 1, 16),  # a window of 32 slots; rows 2-4 wrapped
    ("stacked-row", 2, 4, 2, 32, 8, [9, 31], 3.0, 3, 16),  # layer 1 of a stack of 3, read in place
]


def _pair(case, cur_shift=0):
  """(kernel, reference) outputs of one case; the kernel told each row's position + cur_shift."""
  name, B, N, K, C, H, cur, softcap, L, block = case
  q, k, v, kc, vc, cur = _case(len(name), B, N, K, C, H, cur, L)
  scale = H ** -0.5
  layer = L // 2
  slots = kv_cache.decode_slots(cur, C)
  mask = A.decode_mask(slots.read_mask, slots.write)
  ref = A.gqa_attention_decode(q, k, v, kc[layer], vc[layer], mask, scale=scale, softcap=softcap)
  rows = (kv_cache.LayerRow(kc, jnp.int32(layer)), kv_cache.LayerRow(vc, jnp.int32(layer))) if L > 1 else (
      kc[0], vc[0])
  out = D.decode_attention(q, k, v, *rows, cur + cur_shift, scale=scale, softcap=softcap, block=block,
                           interpret=True)
  return out, ref


@pytest.fixture(scope="module")
def outputs():
  # One jit for every case (and the broken variant): one compile for the module.
  return jax.jit(lambda: ([_pair(c) for c in CASES], _pair(CASES[0], cur_shift=1)))()


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_kernel_equals_the_xla_path(outputs, i):
  out, ref = outputs[0][i]
  assert out.shape == ref.shape
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL, rtol=TOL)


def test_a_row_length_off_by_one_fails(outputs):
  # The control: told one slot more per row (the slot being written, which holds nothing yet), the kernel must differ.
  out, ref = outputs[1]
  assert float(jnp.max(jnp.abs(out - ref))) > 1e-3


def test_resolve_routes_by_platform_and_block():
  assert D.resolve("auto", 512, 128, on="tpu") == "pallas"
  assert D.resolve("auto", 512, 128, on="cpu") == "xla"
  assert D.resolve("pallas", 512, 128, on="cpu") == "pallas"
  assert D.resolve("xla", 512, 128, on="tpu") == "xla"
  assert D.resolve("auto", 1000, 128, on="tpu") == "xla"  # 1000 slots: no block of 16k slots divides it
  assert D.block_for(1000, 128) is None and D.block_for(96, 128) == 96 and D.block_for(4096, 128) == 128
  assert D.block_for(4096, 200) == 128
