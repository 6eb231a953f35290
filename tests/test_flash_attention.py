"""attention_impl=flash: the blockwise kernel (nn/flash_attention.py) against the xla reference
(nn/attention.gqa_attention with attention_mask), forward and every gradient, for each mask kind, each with a
negative control; the blocks it visits; no [T, T] tensor in its program; the key's resolution and errors; and a few
tiny presets training to the xla losses under explicit sharding with nothing blocked (explicit = auto under flash).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.analysis.golden import shrink
from meshlm.errors import ConfigError
from meshlm.nn import flash_attention as FA
from meshlm.nn.attention import attention_mask, gqa_attention, resolve_impl, CPU_FLASH_FROM

import conformance as C

# Float32: the kernel sums the same terms in another order (blocks, an online softmax). Measured at most
# 1.9e-6 (forward and gradients, values of order 1); a wrong block, segment or soft-cap moves them by 0.9 or more.
ATOL = 1e-5
T, BLOCK = 37, 8  # 5 blocks, the last ragged (37 = 4 x 8 + 5): every case runs the in-kernel padding
SEGMENTS = np.array([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34])
# name: (N, K, H, Hv, window, softcap, segments)
CASES = {
    "causal_gqa": (4, 2, 8, 8, None, None, False),
    "window": (4, 2, 8, 8, 11, None, False),
    "segments": (4, 2, 8, 8, None, None, True),
    "softcap": (4, 2, 8, 8, None, 1.5, False),
    "mla_dims": (3, 3, 12, 8, None, None, False),  # every head its own key (G = 1), qk 12 wide, v 8
    "all": (4, 1, 8, 6, 9, 2.0, True),
    # The window's lower edge 2 + 2 x BLOCK back: the first query of a block sees one key of the block lo below it
    # (its last), so a lower bound one block too high skips a block the window reaches (the mutation audit's miss).
    "window_edge": (4, 2, 8, 8, 2 + 2 * BLOCK, None, False),
}


def attention_inputs(case: str, N: int, K: int, H: int, Hv: int, T: int):
  """Heads-first rows (every core's): q [2, N, T, H], k [2, K, T, H], v [2, K, T, Hv] and the output's cotangent
  [2, N, T, Hv], seeded by the case's name (test_splash_attention's cases draw theirs here too)."""
  ks = jax.random.split(jax.random.key(len(case)), 4)
  q = jax.random.normal(ks[0], (2, N, T, H))
  k = jax.random.normal(ks[1], (2, K, T, H))
  v = jax.random.normal(ks[2], (2, K, T, Hv))
  ct = jax.random.normal(ks[3], (2, N, T, Hv))  # the output's cotangent
  return q, k, v, ct


def _inputs(case: str):
  N, K, H, Hv, _, _, _ = CASES[case]
  return attention_inputs(case, N, K, H, Hv, T)


def _value_and_grads(fn, q, k, v, ct):
  """(out, dq, dk, dv) of fn, one jitted program (traced now: a monkeypatched helper takes effect). Unjitted, each
  primitive of the forward and the backward compiled on its own: up to 60 compiles for one case."""
  def value_and_grads(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(ct)
  return jax.jit(value_and_grads)(q, k, v, ct)


@functools.cache
def _reference(case: str):
  """(out, dq, dk, dv) of the xla core: gqa_attention against the materialized mask."""
  _, _, H, _, window, softcap, segs = CASES[case]
  seg = jnp.asarray(SEGMENTS) if segs else None
  fn = lambda q, k, v: gqa_attention(q, k, v, attention_mask(seg, T, window), scale=H ** -0.5,  # noqa: E731
                                     softcap=softcap)
  return _value_and_grads(fn, *_inputs(case))


def _errors(case: str) -> list[float]:
  """max |flash - xla| of out, dq, dk, dv (the kernel traced now: a monkeypatched helper takes effect)."""
  _, _, H, _, window, softcap, segs = CASES[case]
  seg = jnp.asarray(SEGMENTS) if segs else None
  fn = lambda q, k, v: FA.flash_attention(q, k, v, seg, scale=H ** -0.5, softcap=softcap,  # noqa: E731
                                          window=window, block=BLOCK)
  got = _value_and_grads(fn, *_inputs(case))
  return [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, _reference(case))]


@pytest.mark.parametrize("case", list(CASES))
def test_flash_equals_xla_forward_and_gradients(case):
  errs = _errors(case)
  print(f"{case}: max |flash - xla| out, dq, dk, dv = {errs}")
  assert max(errs) < ATOL, errs


@pytest.mark.parametrize("case, patch, wrong", [
    # A wrong block offset: every key block read one position late.
    ("causal_gqa", "_key_offset", lambda real: lambda j, b: real(j, b) + 1),
    # A block the window reaches skipped: the lowest visible key block dropped.
    ("window", "_key_blocks", lambda real: lambda st, i: (real(st, i)[0] + 1, real(st, i)[1])),
    # The window's lower bound off by one position ((i b - window + 2) // b): it skips the block at the window's
    # lower edge only when that edge is a block's last key (window = 2 + a multiple of the block).
    ("window_edge", "_key_blocks", lambda real: lambda st, i: (jnp.maximum(i * st.block - st.window + 2, 0)
                                                                // st.block, real(st, i)[1])),
    # A dropped segment reset: documents see each other.
    ("segments", "_same_segment", lambda real: lambda sq, sk: jnp.ones(sq.shape + sk.shape[-1:], bool)),
    # The soft-cap's derivative missing from the backward (the forward still caps).
    ("softcap", "_scores", lambda real: lambda st, q, k: (real(st, q, k)[0], None)),
])
def test_a_broken_kernel_fails_the_comparison(monkeypatch, case, patch, wrong):
  monkeypatch.setattr(FA, patch, wrong(getattr(FA, patch)))
  errs = _errors(case)
  print(f"{case} with a broken {patch}: max |flash - xla| out, dq, dk, dv = {errs}")
  assert max(errs) > 100 * ATOL, errs
  if patch == "_scores":
    assert errs[0] < ATOL, "only the backward is broken: the forward must still agree"


@pytest.mark.parametrize("n, b, window", [(6, 4, None), (6, 4, 1), (6, 4, 5), (6, 4, 9), (5, 8, 8), (7, 3, 20)])
def test_visited_blocks_are_exactly_those_with_a_visible_pair(n, b, window):
  """Forward (key blocks per query block) and backward (query blocks per key block) visit exactly the block pairs
  the causal/window mask leaves non-empty: causal is n (n + 1) / 2 of the n^2 pairs."""
  st = FA._Static(1.0, None, window, b, n * b, False)
  dense = np.asarray(attention_mask(None, n * b, window))[0, 0, 0]
  want = {(i, j) for i in range(n) for j in range(n) if dense[i * b:(i + 1) * b, j * b:(j + 1) * b].any()}
  fwd = {(i, j) for i in range(n) for j in range(*map(int, FA._key_blocks(st, i)))}
  bwd = {(i, j) for j in range(n) for i in range(*map(int, FA._query_blocks(st, j, n)))}
  assert fwd == want == bwd
  if window is None:
    assert len(want) == n * (n + 1) // 2


def _largest(jaxpr) -> int:
  """The most elements of any value in a jaxpr, its sub-jaxprs (loop bodies, the custom VJP) included."""
  sizes = [int(np.prod(v.aval.shape)) for e in jaxpr.eqns for v in e.outvars if hasattr(v.aval, "shape")]
  for e in jaxpr.eqns:
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          sizes.append(_largest(inner))
  return max(sizes, default=0)


def test_no_tensor_grows_with_t_squared():
  """The flash forward and backward hold at most [B, K, G, block, block] scores; the xla core holds [.., T, T]."""
  Tl, b = 256, 16
  q, k, v = (jnp.zeros((1, 2, Tl, 8)),) * 3
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v))  # noqa: E731
  flash = lambda q, k, v: FA.flash_attention(q, k, v, scale=1.0, block=b)  # noqa: E731
  xla = lambda q, k, v: gqa_attention(q, k, v, attention_mask(None, Tl, None), scale=1.0)  # noqa: E731
  got = {name: _largest(jax.make_jaxpr(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v).jaxpr)
         for name, fn in (("flash", flash), ("xla", xla))}
  assert got["xla"] >= 2 * Tl * Tl  # the control: the reference's scores are there
  assert got["flash"] <= 2 * Tl * 8 * 2, got  # O(T): the padded inputs and outputs, no [T, T]


def test_auto_resolves_per_platform_and_length():
  assert resolve_impl("auto", 128, "cpu") == "xla"  # the tiny presets keep their numbers
  assert resolve_impl("auto", CPU_FLASH_FROM, "cpu") == "flash"
  assert resolve_impl("auto", CPU_FLASH_FROM - 1, "cpu") == "xla"
  assert resolve_impl("auto", 128, "gpu") == resolve_impl("auto", 128, "tpu", context=2) == "flash"
  assert resolve_impl("xla", 1 << 20, "tpu") == "xla" and resolve_impl("flash", 8, "cpu") == "flash"
  with pytest.raises(ConfigError, match=r"^attention_impl: .*'fast'"):
    meshlm.load_config("attention_impl=fast")


def test_the_reports_name_the_core_each_program_runs():
  """census and compile report the resolved core (config_summary; compile passes its topology's platform)."""
  from meshlm.analysis.census import config_summary
  tiny = meshlm.load_config("model=llama2-tiny")
  assert config_summary(tiny)["attention_impl"] == "xla" and config_summary(tiny, "gpu")["attention_impl"] == "flash"
  n = CPU_FLASH_FROM
  long = meshlm.load_config("model=llama2-tiny", f"train.seq_len={n}", f"model.max_position={n}")
  assert config_summary(long, "cpu")["attention_impl"] == "flash"
  assert config_summary(meshlm.load_config("attention_impl=xla"), "gpu")["attention_impl"] == "xla"


# --- the train step: flash equals xla, nothing blocked ---------------------------------------------------

# gemma2's soft-cap + sliding window + query scalar on fsdp=4, packed rows: the context's plumbing (the mask as a
# description for flash, materialized for xla) in a whole step. Every attention part under every core against xla
# is tests/test_attention_conformance.py's; every family training under flash, explicit equal to auto and nothing
# blocked, tests/test_conformance.py's.
PRESETS = ("gemma2-tiny",)


@functools.cache
def compiled(preset: str, impl: str, mode: str):
  """(the parity train step, compiled, its census) of a preset under attention_impl=impl and shard_mode=mode."""
  step, lowered, census = C.lowered_step((f"model={preset}", *shrink(preset), f"attention_impl={impl}"), mode)
  return step, lowered.compile(), census


@pytest.mark.parametrize("preset", PRESETS)
def test_flash_trains_to_the_xla_losses_with_nothing_blocked(preset):
  (*flash, census), (*xla, _) = compiled(preset, "flash", "explicit"), compiled(preset, "xla", "explicit")
  got = C.stepped_pair(flash, xla)
  print(f"{preset}: flash vs xla, explicit, fsdp=4: {got}")
  C.assert_pair(got)
  assert len(set(got["a"]["loss"].tolist())) == C.PARITY_STEPS, f"the losses do not move: {got['a']['loss']}"
  blocked = census["stablehlo"]["transpose_of_dot"]["blocked"]
  assert blocked == 0, census["stablehlo"]["transpose_of_dot"]["pairs"]


# Every parameter's gradient under flash against xla, per attention part (packed rows, the window and soft-cap):
# tests/test_attention_conformance.py.


def test_generate_with_a_flash_prefill_equals_recomputing(monkeypatch):
  """Sampling under flash: the prefill's core is flash (the decode steps keep their cached path), and greedy
  generate equals one flash forward over prompt + completion; gemma2-tiny's prompts cross its window (48)."""
  import meshlm.nn.attention as A
  traced = []
  def counted(*args, **kw):
    traced.append(kw["window"])
    return FA.flash_attention(*args, **kw)
  monkeypatch.setattr(A, "flash_attention", counted)
  cfg = meshlm.load_config("model=gemma2-tiny", "attention_impl=flash", "train.compute_dtype=float32")
  out = C.greedy(cfg, params := meshlm.init_params(cfg, jax.random.key(0)))
  assert set(traced) == {None, cfg.model.sliding_window}, traced  # the prefill ran flash, global and local layers
  print(C.check_generate_equals_recompute(cfg, params, out))
