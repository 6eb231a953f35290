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
  assert [D.resolve(i, on) for i, on in (("auto", "tpu"), ("auto", "cpu"), ("pallas", "cpu"), ("xla", "tpu"))] == [
      "pallas", "xla", "pallas", "xla"]
  pallas = D.Decode("pallas", 128)
  assert pallas.for_size(512) == "pallas" and pallas.for_size(96) == "pallas"
  assert pallas.for_size(1000) == "xla"  # a ring of 1000 slots: no block of a multiple of 16 slots divides it
  assert D.block_for(1000, 128) is None and D.block_for(96, 128) == 96 and D.block_for(4096, 128) == 128
  assert D.block_for(4096, 200) == 128 and D.block_for(1040, 128) == 80


def test_generate_with_the_kernel_equals_the_xla_path():
  """The whole sampler with the kernel (and its tiled K/V write, kv_cache.write_by_blocks) on gemma2-tiny: soft-capped
  GQA, a 48-slot ring on the local layers that wraps (positions past 48), blocks of 16 slots, rows of different
  lengths: the same greedy tokens as the xla path, log-probs within float32 noise."""
  import meshlm
  from meshlm.models import generate as G
  prompts = [[1, 2, 3, 4, 5], list(range(7, 47))]
  out = {}
  for impl in ("xla", "pallas"):
    cfg = meshlm.load_config("model=gemma2-tiny", f"decode_attention_impl={impl}", "decode_attention_block=16",
                             "train.compute_dtype=float32")
    params = meshlm.init_params(cfg, jax.random.key(0))
    out[impl] = G.generate(cfg, params, prompts, max_new_tokens=20, stop_tokens=())
  assert out["pallas"].token_lists() == out["xla"].token_lists()
  np.testing.assert_allclose(out["pallas"].logprobs, out["xla"].logprobs, atol=1e-5)


def test_the_tiled_write_equals_the_scatter():
  """kv_cache.write_by_blocks (interpret mode) against the scatter it replaces under the kernel, on a stack of 3
  layers' caches [L, B, K, C, H] with the rows' slots in different tiles (and one in the last); a slot off by one
  differs."""
  L, B, K, C, H = 3, 4, 2, 32, 8
  rng = np.random.default_rng(0)
  cache = jnp.asarray(rng.standard_normal((L, B, K, C, H)), jnp.float32)
  rows = jnp.asarray(rng.standard_normal((L, B, K, 1, H)), jnp.float32)
  slots = kv_cache.decode_slots(jnp.asarray([3, 8, 31, 44], jnp.int32), C)  # the last one wrapped: slot 12
  axes = ("layers",) + tuple(kv_cache.CACHE_AXES)
  want = kv_cache.write_rows(cache, rows, slots, axes, 3)
  got, off = jax.jit(lambda c, r, s: (kv_cache.write_by_blocks(c, r, s, 1, 3),
                                      kv_cache.write_by_blocks(c, r, (s + 1) % C, 1, 3)))(cache, rows, slots.write_slot)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(off), np.asarray(want))
