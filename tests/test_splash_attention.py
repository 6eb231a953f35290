"""attention_impl=splash: the TPU Pallas splash kernel (nn/splash_attention.py), run here in Pallas interpret mode,
against the xla reference (nn/attention.gqa_attention with attention_mask), forward and every gradient, each mask
kind with a negative control; its shard_map over a mesh; the key's resolution and errors; MLA's heads-first rows
(deepseek-v3-tiny's logits and gradients); and a tiny preset training to the xla losses. The kernel compiled for TPU (the Mosaic custom call) is tests/test_compile.py's.

Interpret mode is slow (seconds per program): two kernel programs carry every feature between them, each compiled
once. Their negative controls compare the same kernel outputs against the reference with one feature wrong (a
window one wider, no segment ids, no soft-cap, the KV heads' grouping reversed): the kernel getting that feature
wrong would produce exactly that reference, and each is far outside the tolerance. One control breaks the
kernel's own window in the wrapper.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.analysis.golden import shrink
from meshlm.errors import ConfigError
from meshlm.nn import splash_attention as SP, splash_rule as SR
from meshlm.nn.attention import attention_mask, gqa_attention, resolve_impl
from meshlm.parallel.sharding import ShardingWarning

import conformance as C
from test_flash_attention import compiled, _value_and_grads, attention_inputs

# Float32: the kernel sums in another order (128-wide blocks, an online softmax) and scales q before its dot.
# Measured at most 2.2e-6 (values of order 1); a wrong window, segment, soft-cap or grouping moves them by 0.1 or more.
ATOL = 1e-5
T = 150  # padded to 256 inside: two 128-blocks, the second ragged
SEGMENTS = np.array([[0] * 40 + [1] * 80 + [2] * 30, [0] * 3 + [1] * 147])  # documents across the block boundary
# name: (N, K, H, Hv, window, softcap, segments)
CASES = {
    "causal_gqa": (4, 2, 8, 8, None, None, False),
    "window_segments_softcap": (4, 1, 8, 6, 9, 2.0, True),  # MQA, and v narrower than q/k (as MLA's)
}


def _inputs(case: str):
  N, K, H, Hv, _, _, _ = CASES[case]
  return attention_inputs(case, N, K, H, Hv, T)


def _reference(case: str, *, window=None, segments=None, softcap=None, regroup=False):
  """(out, dq, dk, dv) of the xla core with the case's features, any of them replaced by the keywords given."""
  _, _, H, _, w, cap, segs = CASES[case]
  window = w if window is None else window
  softcap = cap if softcap is None else softcap or None
  seg = jnp.asarray(SEGMENTS) if (segs if segments is None else segments) else None
  def fn(q, k, v):
    if regroup:  # query group g reads KV head K - 1 - g's keys and values
      k, v = k[:, ::-1], v[:, ::-1]
    return gqa_attention(q, k, v, attention_mask(seg, T, window), scale=H ** -0.5, softcap=softcap)
  return _value_and_grads(fn, *_inputs(case))


@functools.cache
def _splash(case: str, backward: str = "auto"):
  """(out, dq, dk, dv) of the splash core in interpret mode, one jit per case (auto: the fused backward at T's two
  blocks)."""
  _, _, H, Hv, window, softcap, segs = CASES[case]
  seg = jnp.asarray(SEGMENTS) if segs else None
  blocks = SR.Rule(T, on_tpu=False, backward=backward).blocks(H, Hv, softcap is not None)
  fn = lambda q, k, v: SP.splash_attention(q, k, v, seg, scale=H ** -0.5, softcap=softcap,  # noqa: E731
                                           window=window, blocks=blocks)
  return jax.jit(functools.partial(_value_and_grads, fn))(*_inputs(case))


def _errors(got, want) -> list[float]:
  return [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want)]


@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_xla_forward_and_gradients(case):
  errs = _errors(_splash(case), _reference(case))
  print(f"{case}: max |splash - xla| out, dq, dk, dv = {errs}")
  assert max(errs) < ATOL, errs


def test_the_two_kernel_backward_equals_xla_too():
  """splash_backward=split (a dq and a dkv kernel), on the case with every feature; auto is fused in interpret mode
  (the test above). The wrong-feature controls below fail the fused kernel alike."""
  case = "window_segments_softcap"
  assert SR.Rule(T, on_tpu=False).blocks(8, 6, True).fused
  errs = _errors(_splash(case, "split"), _reference(case))
  assert max(errs) < ATOL, errs
  assert max(_errors(_splash(case, "split"), _reference(case, window=10))) > 100 * ATOL


# The splash kernel inside the train step on a TPU v5e (JAX 0.10.2, libtpu 0.0.42.1, 2026-12-06; docs/tpu.md): the
# fused dkv blocks each (head_dim, soft-capped, seq, rows per device) ran at, or was refused at (18.61 MiB of 16).
CHIP_RAN = {(256, False, 8192, 1): (1024, 1024, 512),  # gemma3-4b, 6 layers
            (256, True, 2048, 4): (1024, 512, 512),  # gemma2-2b, 8 layers
            (256, True, 8192, 1): (1024, 512, 512),
            (128, False, 2048, 8): (1024, 1024, 1024),  # qwen3-0.6b
            (128, False, 4096, 2): (1024, 1024, 1024)}  # mistral-7b, 2 layers
CHIP_REFUSED = {(256, False, 2048, 4): (1024, 1024, 512)}  # gemma3-4b, 6 layers


def test_the_block_rule_fits_the_chips_vmem():
  """The rule (nn/splash_rule.Rule) against the chip: it keeps clear of the fused dkv blocks the v5e refused inside
  the train step, and picks none smaller than those it ran (CHIP_RAN: the rule's own picks, measured). Compiled
  alone, at head_dim 256, bf16, segment ids, 4 rows, the fused dkv kernel at 1024/1024/1024 needs more than 16 MiB
  (the control: the former rule picked it); at 8 rows 1024/1024/512 is over too; at 128 1024 everywhere fits at
  8 rows. What the keys override, splash_backward=auto deciding by the same estimate, and what the reports print."""
  from meshlm.analysis.census import config_summary
  MiB = SR.MiB
  for (qk, softcap, T, rows), ran in CHIP_RAN.items():
    b = SR.Rule(T, rows=rows).blocks(qk, qk, softcap)
    assert b.fused and (b.q_dkv, b.kv_dkv, b.kv_dkv_compute) == ran, (qk, softcap, T, rows, b)
  for (qk, softcap, T, rows), refused in CHIP_REFUSED.items():
    b = SR.Rule(T, rows=rows).blocks(qk, qk, softcap)
    assert (b.q_dkv, b.kv_dkv, b.kv_dkv_compute) != refused, (qk, softcap, T, rows, b)
    assert SR.estimate("dkv", *refused, qk, qk, 2, True, softcap, True, rows) > 16 * MiB
  assert SR.estimate("dkv", 1024, 1024, 1024, 256, 256, 2, True, False, True, rows=4) > 16 * MiB
  assert SR.estimate("dkv", 1024, 1024, 512, 256, 256, 2, True, False, True, rows=8) > 16 * MiB
  assert SR.estimate("dkv", 1024, 1024, 1024, 128, 128, 2, True, False, True, rows=8) <= 16 * MiB
  assert SR.estimate("fwd", 2048, 512, 512, 256, 256, 2, True, False) > 16 * MiB  # measured 19.4 MiB and more
  g8 = SR.Rule(2048, rows=8).blocks(256, 256, False)
  assert (g8.q_dkv, g8.kv_dkv, g8.kv_dkv_compute) not in ((1024, 1024, 1024), (1024, 1024, 512)), g8
  q3 = SR.Rule(8192, rows=2).blocks(128, 128, False)
  assert (q3.q, q3.q_dkv, q3.kv_dkv_compute, q3.fused) == (1024, 1024, 1024, True), q3  # fused at 8 blocks
  assert not SR.Rule(2048, rows=4, backward="split").blocks(256, 256, False).fused
  forced = SR.Rule(2048, keys=(("sa_block_q", 512), ("sa_block_kv_dkv_compute", 256))).blocks(128, 128, False)
  assert forced.q == 512 and forced.kv_dkv_compute == 256 and forced.kv == 1024
  assert SR.Rule(2048, vmem=32 * MiB, rows=4).blocks(256, 256, False).kv_dkv_compute == 1024  # v6e's 32 MiB
  assert SR.padded_length(2176) == 2304 and SR.padded_length(2000) == 2048 and SR.padded_length(150, 128) == 256
  assert SR.Rule(2176).blocks(128, 128, False).q == 256  # 2,304 in 256-blocks, not 2,176 in 128-blocks
  with pytest.raises(ConfigError, match="splash_backward"):
    meshlm.load_config("splash_backward=both")
  with pytest.raises(ConfigError, match=r"^sa_block_q: .*multiple of 128"):
    meshlm.load_config("sa_block_q=100")
  cfg = lambda *o: meshlm.load_config("model=gemma3-4b", *o)  # noqa: E731
  got = config_summary(cfg("train.seq_len=2048", "train.per_device_batch_size=4"), "tpu")
  assert got["splash_backward"] == "fused" and got["splash_blocks"]["256/256"]["dkv"] == [1024, 512, 512], got
  assert config_summary(cfg("splash_backward=split"), "tpu")["splash_backward"] == "split"
  assert config_summary(cfg("train.seq_len=8192"), "cpu")["splash_backward"] is None  # flash there


@pytest.mark.parametrize("key, fused", [("auto", True), ("split", False), ("fused", True)])
def test_the_key_reaches_the_kernel(monkeypatch, key, fused):
  """splash_backward from the config to the kernel the mixers build (models/context.attention_core's record ->
  gqa -> Context.attend -> splash_attention): llama2-tiny's forward at 96 positions (one interpret block: auto is fused), traced only."""
  seen = []
  real = SP._kernel
  monkeypatch.setattr(SP, "_kernel", lambda *a, **kw: seen.append(kw["blocks"].fused) or real(*a, **kw))
  cfg = meshlm.load_config("model=llama2-tiny", "attention_impl=splash", f"splash_backward={key}")
  params = jax.eval_shape(lambda: meshlm.init_params(cfg, jax.random.key(0)))
  toks = jnp.zeros((2, C.PARITY_SEQ), jnp.int32)
  jax.eval_shape(lambda p: meshlm.forward(cfg, p, toks, jnp.broadcast_to(jnp.arange(C.PARITY_SEQ), toks.shape)),
                 params)
  assert seen and set(seen) == {fused}, seen


@pytest.mark.parametrize("case, wrong", [
    ("window_segments_softcap", dict(window=10)),  # the window one position wider
    ("window_segments_softcap", dict(segments=False)),  # the segment ids dropped: documents see each other
    ("window_segments_softcap", dict(softcap=0.0)),  # no soft-cap
    ("causal_gqa", dict(regroup=True)),  # the query groups read the wrong KV heads
])
def test_a_wrong_feature_fails_the_comparison(case, wrong):
  errs = _errors(_splash(case), _reference(case, **wrong))
  print(f"{case} against the reference with {wrong}: max |splash - xla| out, dq, dk, dv = {errs}")
  assert max(errs) > 100 * ATOL, errs


def test_a_wrong_window_in_the_kernel_fails(monkeypatch):
  """The wrapper's LocalMask sides shifted by one (window sides (window, 0): one key too many) fail the forward."""
  real = SP._mask
  monkeypatch.setattr(SP, "_mask", lambda length, window: real(length, window and window + 1))
  case = "window_segments_softcap"
  _, _, H, _, window, softcap, _ = CASES[case]
  q, k, v, _ = _inputs(case)
  out = jax.jit(lambda q, k, v: SP.splash_attention(q, k, v, jnp.asarray(SEGMENTS), scale=H ** -0.5,
                                                    softcap=softcap, window=window))(q, k, v)
  err = float(jnp.max(jnp.abs(out - _reference(case)[0])))
  assert err > 100 * ATOL, err


def _mesh():
  from jax.sharding import AxisType
  return jax.make_mesh((1, 2, 2, 1, 1), ("data", "fsdp", "tensor", "expert", "context"),
                       axis_types=(AxisType.Auto,) * 5, devices=jax.devices()[:4])


def test_row_spec_splits_rows_and_the_heads_tensor_divides():
  from jax.sharding import PartitionSpec as P
  mesh = _mesh()
  assert SP.row_spec(mesh, 2, 2) == P("fsdp", "tensor", None, None)
  with warnings.catch_warnings():  # the ShardingWarning the mixers' own K/V projections already give
    warnings.simplefilter("ignore", ShardingWarning)
    assert SP.row_spec(mesh, 2, 1) == P("fsdp", None, None, None)  # one KV head: every head on each tensor device
  assert SP.row_spec(mesh, 1, 4) == P(None, "tensor", None, None)  # a row the batch axes do not divide stays whole


@pytest.mark.parametrize("case", list(CASES))
def test_under_a_mesh_equals_the_reference(case):
  """On fsdp=2 x tensor=2, in the shard_map: one row per fsdp device; causal_gqa's 2 KV heads split over tensor,
  the MQA case's one KV head whole (its 4 query heads with it), with its segment ids split as the rows."""
  _, _, H, _, window, softcap, segs = CASES[case]
  seg = jnp.asarray(SEGMENTS) if segs else None
  q, k, v, _ = _inputs(case)
  with jax.set_mesh(_mesh()):
    fn = jax.jit(lambda q, k, v: SP.splash_attention(q, k, v, seg, scale=H ** -0.5, softcap=softcap, window=window))
    text = fn.lower(q, k, v).as_text()
    out = fn(q, k, v)
  assert "sdy.manual_computation" in text
  err = float(jnp.max(jnp.abs(out - _reference(case)[0])))
  assert err < ATOL, err


def test_auto_resolves_to_splash_on_tpu_and_context_is_refused():
  assert resolve_impl("auto", 128, "tpu") == "splash" and resolve_impl("auto", 1 << 16, "tpu") == "splash"
  assert resolve_impl("auto", 128, "tpu", context=2) == "flash"  # the splash wrapper keeps the sequence whole
  assert resolve_impl("auto", 128, "gpu") == "flash" and resolve_impl("auto", 128, "cpu") == "xla"
  assert resolve_impl("splash", 128, "cpu") == "splash"  # allowed off TPU: interpret mode
  with pytest.raises(ConfigError, match=r"^attention_impl=splash with mesh.context=2: .*attention_impl=flash"):
    resolve_impl("splash", 128, "tpu", context=2)
  with pytest.raises(ConfigError, match=r"^attention_impl=splash with mesh.context=2: .*attention_impl=flash"):
    meshlm.load_config("attention_impl=splash", "mesh.context=2")
  assert meshlm.load_config("attention_impl=splash").attention_impl == "splash"


def test_the_reports_name_splash():
  from meshlm.analysis.census import config_summary
  cfg = meshlm.load_config("model=llama2-tiny")
  assert config_summary(cfg, "tpu")["attention_impl"] == "splash"
  # With the sequence split, auto is flash on TPU, which runs as ring attention (context_attention=ring).
  assert config_summary(meshlm.load_config("model=llama2-tiny", "mesh.context=2"), "tpu")["attention_impl"] == "ring"
  assert config_summary(meshlm.load_config("attention_impl=splash"), "cpu")["attention_impl"] == "splash"


# gemma2's soft-cap, sliding window (48, under the 96 positions trained) and query scalar, on fsdp=4 (the
# shard_map splits the rows), packed rows of two documents: the xla arm is tests/test_flash_attention.py's (the same
# config, trained once per process).
PRESET = "gemma2-tiny"


def test_splash_trains_to_the_xla_losses():
  splash = compiled(PRESET, "splash", "explicit")[:2]
  xla = compiled(PRESET, "xla", "explicit")[:2]  # cached when this process ran tests/test_flash_attention.py
  got = C.stepped_pair(splash, xla)
  print(f"{PRESET}: splash vs xla, explicit, fsdp=4: {got}")
  C.assert_pair(got)
  assert len(set(got["a"]["loss"].tolist())) == C.PARITY_STEPS, f"the losses do not move: {got['a']['loss']}"


# deepseek-v3-tiny on its one dense layer, narrower: MLA's q (q_lora), k_nope, v and interleaved YaRN RoPE on the
# kernel's heads-first rows, every head its own key (G = 1), qk 24 wide against v 16; two packed documents a row.
# "q": a plain query projection (q_lora_rank null, DeepSeek-V2-Lite's), the other einsum heads-first.
MLA_KEYS = ("model=deepseek-v3-tiny", "model.num_layers=1", "model.first_k_dense_replace=1", "model.embed_dim=64",
            "model.vocab_size=128", "train.compute_dtype=float32")
# (q_b, with q_lora, is tests/test_attention_conformance.py's mla row under splash.)
MLA_QUERY = {"q": ("model.parts.mla.q_lora_rank=null",)}


@functools.cache
def _mla_program(impl: str, query: str):
  """(cfg, jit(params -> (logits, d params))): meshlm.forward over packed rows and its VJP against a fixed
  cotangent; params are an argument, so one compile serves any values."""
  cfg = meshlm.load_config(*MLA_KEYS, *MLA_QUERY[query], f"attention_impl={impl}")
  T = C.PARITY_SEQ
  toks = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.model.vocab_size)
  col, cut = np.arange(T)[None], np.array([[40], [70]])
  seg, pos = jnp.asarray(np.where(col < cut, 1, 2)), jnp.asarray(np.where(col < cut, col, col - cut))
  ct = jax.random.normal(jax.random.key(2), (2, T, cfg.model.vocab_size))

  def value_and_grads(p):
    out, vjp = jax.vjp(lambda p: meshlm.forward(cfg, p, toks, pos, seg), p)
    return out, vjp(ct)[0]
  return cfg, jax.jit(value_and_grads)


def _relative(got, want) -> float:
  """max over leaves of |got - want| relative to the leaf's largest |want|."""
  return max(float(jnp.max(jnp.abs(a - b))) / (float(jnp.max(jnp.abs(b))) or 1.0)
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.mark.parametrize("query", list(MLA_QUERY))
def test_mla_under_splash_equals_xla_forward_and_gradients(query):
  """deepseek-v3-tiny's MLA under splash (q_b, k_b, v_b projected heads-first, o reading the kernel's rows as they
  are) equals the xla core's logits and every parameter's gradient within ATOL of each leaf's largest entry.
  Control: the xla model with k_b's heads reversed (query head n scoring key head N - 1 - n: what a head-order slip
  between the heads-first rows would compute) is far outside it; same program, other values, no compile."""
  cfg, xla = _mla_program("xla", query)
  params = jax.tree.map(np.asarray, meshlm.init_params(cfg, jax.random.key(0)))
  want, got = xla(params), _mla_program("splash", query)[1](params)
  errs = _relative(got[0], want[0]), _relative(got[1], want[1])
  print(f"deepseek-v3-tiny MLA ({query}): splash vs xla, max relative |diff| logits {errs[0]:.3g}, gradients {errs[1]:.3g}")
  assert max(errs) < ATOL, errs
  attn = params["layers"]["dense"]["attn"]
  wrong = params | {"layers": {"dense": params["layers"]["dense"] | {"attn": attn | {"k_b": attn["k_b"][:, :, ::-1]}}}}
  bad = xla(wrong)
  errs = _relative(got[0], bad[0]), _relative(got[1], bad[1])
  assert min(errs) > 100 * ATOL, errs


def test_generate_with_a_splash_prefill_equals_the_xla_forward(monkeypatch):
  """Sampling under splash: the prefill runs the kernel on heads-first rows (gated_gqa's q, gate, k and v, each
  projected so; the K/V rows go to the cache as they are, already its [B, Kv, T, H]), the decode steps keep their
  cached path, and greedy generate equals one xla forward over prompt + completion (the reference core), each
  token its argmax and each log-prob within XLA_LOGPROB_ATOL. qwen3.5-tiny at 2 layers [gdn, attention]: the output
  gate, partial rotary and q/k norms on heads-first rows. Control: the reference without the output gate fails."""
  import meshlm.nn.splash_attention as S
  from meshlm.models import api
  from meshlm.models.mixers import gqa
  traced, real = [], S.splash_attention
  def counted(*args, **kw):
    traced.append(args[0].shape)
    return real(*args, **kw)
  monkeypatch.setattr(S, "splash_attention", counted)
  keys = ("model=qwen3.5-tiny", *shrink("qwen3.5-tiny"), "train.compute_dtype=float32")
  cfg = meshlm.load_config(*keys, "attention_impl=splash")
  out = C.greedy(cfg, params := meshlm.init_params(cfg, jax.random.key(0)))
  assert traced and all(s[1] == cfg.model.num_heads for s in traced), traced  # [B, N, T, H] rows into the kernel
  # Across cores (the kernel's 128-blocks, the cached decode): measured 1.05e-5; a broken gate, rotary or cache
  # layout moves log-probs by 0.01 or more.
  monkeypatch.setattr(C, "LOGPROB_ATOL", XLA_LOGPROB_ATOL)
  monkeypatch.setattr(C, "TIE", XLA_LOGPROB_ATOL)
  reference = meshlm.load_config(*keys, "attention_impl=xla")
  print(C.check_generate_equals_recompute(reference, params, out))
  attend = gqa.attend
  with monkeypatch.context() as m:
    m.setattr(gqa, "attend", lambda *args, gate=None, **kw: attend(*args, **kw))
    api.clear_programs()
    with pytest.raises(AssertionError, match="log-probs differ|generate drew"):
      C.check_generate_equals_recompute(reference, params, out)
  api.clear_programs()


XLA_LOGPROB_ATOL = 1e-4
