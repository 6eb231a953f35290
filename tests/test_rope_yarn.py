"""YaRN rotary angles computed from positions: bit-identical to indexing the full table a table-based
implementation builds (here, as transformers does: an outer product of all positions with the frequencies,
duplicated, cos and sin times the attention factor), and matching an independent float64 reference of the YaRN
formulas."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.nn.rope import freqs_at, yarn_attention_factor, yarn_inv_frequencies

# DeepSeek-V3's rope: 163,840 = 40 x 4,096 positions, qk_rope_head_dim 64.
TABLE_ROWS = 163_840
HEAD_DIM = 64
THETA = 10000.0
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def _numpy_yarn_inv_freq(dim: int, base: float, s: dict) -> np.ndarray:
  """The YaRN frequency formulas (DeepSeek-V3 / HF _compute_yarn_parameters), in float64."""
  pos = base ** (np.arange(0, dim, 2) / dim)
  def corr(r):
    return dim * math.log(s["original_max_position"] / (r * 2 * math.pi)) / (2 * math.log(base))
  low = max(math.floor(corr(s["beta_fast"])), 0)
  high = min(math.ceil(corr(s["beta_slow"])), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  extra = 1 - ramp
  return (1 / (s["factor"] * pos)) * (1 - extra) + (1 / pos) * extra


def rope_table(rows: int, dim: int, theta: float, scaling: dict) -> tuple[jax.Array, jax.Array]:
  """The whole [rows, dim] cos/sin table, built as a table-based implementation builds it (not through freqs_at)."""
  inv = yarn_inv_frequencies(dim, theta, scaling)  # [dim / 2], checked against the formula below
  freqs = jnp.outer(jnp.arange(rows, dtype=jnp.float32), inv)  # [rows, dim / 2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  a = yarn_attention_factor(scaling)
  return jnp.cos(emb) * a, jnp.sin(emb) * a


@pytest.fixture(scope="module")
def table():
  cos, sin = jax.jit(lambda: rope_table(TABLE_ROWS, HEAD_DIM, THETA, YARN))()
  return np.asarray(cos), np.asarray(sin)


@pytest.mark.parametrize("where", ["bottom", "middle", "top"])
def test_freqs_at_equals_table_rows_bit_for_bit(table, where):
  start = {"bottom": 0, "middle": TABLE_ROWS // 2 - 3, "top": TABLE_ROWS - 7}[where]
  pos = np.arange(start, start + 7, dtype=np.int32)
  positions = np.stack([pos, pos[::-1]])  # [2, 7]: both orders, so no row is read by accident
  cos, sin = jax.jit(lambda p: freqs_at(p, HEAD_DIM, THETA, YARN))(positions)
  t_cos, t_sin = table
  np.testing.assert_array_equal(np.asarray(cos), t_cos[positions])
  np.testing.assert_array_equal(np.asarray(sin), t_sin[positions])
  # Control: the rows next to them differ (the equality reads the right rows, and the angles move).
  assert not np.array_equal(np.asarray(cos), t_cos[np.minimum(positions + 1, TABLE_ROWS - 1)])


def test_yarn_frequencies_match_the_formula():
  got = np.asarray(yarn_inv_frequencies(HEAD_DIM, THETA, YARN))
  np.testing.assert_allclose(got, _numpy_yarn_inv_freq(HEAD_DIM, THETA, YARN), rtol=2e-6)
  # High frequencies are kept, low ones divided by the factor.
  assert got[0] == pytest.approx(1.0)
  assert got[-1] == pytest.approx(THETA ** (-(HEAD_DIM - 2) / HEAD_DIM) / YARN["factor"], rel=1e-5)


def test_yarn_attention_factor_scales_cos_and_sin():
  # mscale == mscale_all_dim cancels (DeepSeek-V3); otherwise 0.1 ln(factor) + 1 style ratios.
  assert yarn_attention_factor(YARN) == 1.0
  s = YARN | {"mscale_all_dim": 0.0}
  assert yarn_attention_factor(s) == pytest.approx(0.1 * math.log(40.0) + 1.0)
  pos = np.array([[0, 5, 100_000]], np.int32)
  cos, sin = freqs_at(pos, HEAD_DIM, THETA, s)
  # The float32 angles jax multiplies, then cos/sin in float64: only the trig rounding is left.
  inv = np.asarray(yarn_inv_frequencies(HEAD_DIM, THETA, s))
  ang = (pos[..., None].astype(np.float32) * np.concatenate([inv, inv])).astype(np.float64)
  a = yarn_attention_factor(s)
  np.testing.assert_allclose(np.asarray(cos), np.cos(ang) * a, rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(sin), np.sin(ang) * a, rtol=0, atol=2e-6)


def test_freqs_at_builds_no_table():
  """The lowered function holds nothing of the table's size: every value is at most [B, T, H]."""
  from meshlm.analysis.census import blowups
  from meshlm.analysis.stablehlo import parse
  positions = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  good = parse(jax.jit(lambda p: freqs_at(p, HEAD_DIM, THETA, YARN)).lower(positions).as_text(debug_info=True))
  assert max(op.out_elements for op in good.ops) <= 2 * 64 * HEAD_DIM
  assert blowups(good) == []
  # The detector does find the table when a function builds it and then indexes it.
  def via_table(p):
    cos, _ = rope_table(TABLE_ROWS, HEAD_DIM, THETA, YARN)
    return jnp.take(cos, p, axis=0)
  bad = parse(jax.jit(via_table).lower(positions).as_text(debug_info=True))
  found = blowups(bad)
  assert found and max(b["elements"] for b in found) == TABLE_ROWS * HEAD_DIM // 2
