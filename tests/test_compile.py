"""meshlm compile: the programs compiled for a topology, from abstract inputs (nothing runs).

The CPU topology (fake host devices) needs nothing beyond the lock; the TPU tests need libtpu (the `tpu`
extra, which `make test` installs, so under CI they must run). Each module-scoped fixture compiles once.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import io
import json
import math

import pytest

from meshlm.cli import main

# A llama with every dimension a whole number of TPU tiles per device under fsdp=4, so the executable's argument
# buffers are the shard shapes' bytes up to the allocator's rounding: llama3-8b's layout, smaller.
# Vocab, mlp and sequence are one tile per device: the v5p compile takes about 5 s, 13 s with each of them twice
# as large.
SMALL_LLAMA = ["model=llama3-8b", "model.num_layers=2", "model.embed_dim=512", "model.mlp_dim=512",
               "model.vocab_size=512", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=128",
               "train.seq_len=128", "train.per_device_batch_size=2", "mesh.fsdp=4"]


def compile_json(*args: str) -> dict:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = main(["compile", *args, "--json"])
  report = json.loads(out.getvalue())
  report["exit"] = code
  return report


def hand_count_llama(vocab, d, layers, heads, kv_heads, head_dim, mlp, fsdp, batch_rows, seq, shard_norms=False):
  """Bytes per device of the train step's inputs, counted from the geometry alone: float32 parameters, every
  matrix split over fsdp along its embed dim and the RMSNorm scales whole (RULES gives them no mesh axis);
  AdamW's two moments shaped as the parameters plus two int32 counts (its own and its schedule's); the int32
  step; five batch fields of [rows, seq] 4-byte elements split over the devices."""
  per_layer = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d + 3 * d * mlp
  matrices = 2 * vocab * d + layers * per_layer
  norms = 2 * layers * d + d
  params = 4 * (matrices // fsdp + (norms // fsdp if shard_norms else norms))
  return {"params": params, "opt_state": 2 * params + 8, "step": 4, "batch": 5 * 4 * batch_rows * seq // fsdp}


# --------------------------------------------------------------------------------- the CPU topology

@pytest.fixture(scope="module")
def cpu_report():
  # llama2-tiny: vocab 512, embed 256, 2 layers, 8 heads (4 kv) of 32, mlp 768, 8 rows of 128 per device.
  return compile_json("model=llama2-tiny", "topology=cpu:4", "mesh.fsdp=4", "hbm_gib=1")


def test_cpu_topology_arguments_are_the_hand_count(cpu_report):
  """The executable's own argument bytes (memory_analysis) equal the hand count of parameters, optimizer
  state, step and batch per device; XLA:CPU pads nothing, so exactly."""
  mem = cpu_report["programs"]["train"]["memory"]
  hand = hand_count_llama(512, 256, 2, 8, 4, 32, 768, fsdp=4, batch_rows=32, seq=128)
  assert mem["argument_bytes"] == sum(hand.values())
  # loss_impl=auto at 32 x 128 x 512 logits: the materialized head (models/logprobs.loss_path)
  assert cpu_report["config"]["loss_impl"] == "auto" and cpu_report["config"]["loss_path"] == "materialized"
  assert {k: v for k, v in mem["arguments_by_input"].items() if v} == hand
  assert cpu_report["config"]["attention_impl"] == "xla"  # auto on CPU below the crossover (128 < 1024)
  # Negative controls: norms split like the matrices, or no optimizer state, are other numbers.
  wrong = hand_count_llama(512, 256, 2, 8, 4, 32, 768, fsdp=4, batch_rows=32, seq=128, shard_norms=True)
  assert mem["argument_bytes"] != sum(wrong.values())
  assert mem["argument_bytes"] != sum(hand.values()) - hand["opt_state"]
  # The state is donated: the outputs reuse the state's buffers (all but the batch's and a few scalars).
  assert mem["alias_bytes"] >= hand["params"] + hand["opt_state"]
  assert mem["peak_bytes"] == mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
  assert mem["fits"] is True and mem["hbm_bytes"] == 1 << 30 and cpu_report["exit"] == 0


def test_cpu_topology_report_carries_census_roofline_and_time(cpu_report):
  p = cpu_report["programs"]["train"]
  assert p["compile_s"] > 0
  census = p["census"]
  assert census["hlo"]["collectives"]["all-gather"]["count"] > 0  # FSDP gathers the kernels
  assert census["stablehlo"]["transpose_of_dot"]["blocked"] == 0  # tests/golden/census says so for llama2-tiny
  r = p["roofline"]
  # llama2-tiny is unrolled (scan_layers=false): no loop, so the HLO count and XLA's agree; XLA also counts the
  # elementwise FLOPs (measured: 11.27 of XLA's 11.39 GFLOP).
  assert 0.97 < r["flops"] / r["xla_cost_analysis"]["flops"] <= 1.0
  assert 0.9 < r["model_flops"] / r["flops"] < 1.0  # 6 N per token + attention, under what the HLO does
  assert "bound_s" not in r  # no published peak for fake CPU devices
  assert cpu_report["chip"]["kind"] == "cpu" and cpu_report["chip"]["devices"] == 4


def test_cpu_topology_does_not_fit_exits_1():
  # The same step in 4 MiB per device: the inputs alone are 5.3 MiB.
  report = compile_json("model=llama2-tiny", "topology=cpu:4", "mesh.fsdp=4", "hbm_gib=0.004", "--no-census")
  assert report["programs"]["train"]["memory"]["fits"] is False and report["exit"] == 1


TINY = ["model=llama2-tiny", "model.num_layers=1", "train.seq_len=32", "topology=cpu:4", "mesh.fsdp=4"]


def test_fit_finds_the_largest_batch_that_fits():
  """hbm_gib between the peaks of batches 5 and 6 (measured here: the peak grows with the batch); the search
  must land on 5, having seen 6 fail."""
  probe = {b: compile_json(*TINY, f"train.per_device_batch_size={b}", "--no-census")["programs"]["train"]["memory"]
           ["peak_bytes"] for b in (5, 6)}
  assert probe[5] < probe[6]
  hbm = (probe[5] + probe[6]) / 2 / (1 << 30)
  report = compile_json(*TINY, "train.per_device_batch_size=4", f"hbm_gib={hbm}", "--fit", "--no-census")
  fit = report["fit"]
  assert fit["best"] == 5 and report["config"]["per_device_batch_size"] == 5
  seen = {int(t["overrides"][0].split("=")[1]): t for t in fit["tried"]}
  assert list(seen) == [4, 8, 6, 5]  # doubling from 4, then bisection
  assert all(t["fits"] == (b <= 5) for b, t in seen.items())  # every try agrees with the answer
  assert seen[5]["peak_bytes"] == probe[5] and seen[6]["peak_bytes"] == probe[6]  # the same programs
  assert report["programs"]["train"]["memory"]["peak_bytes"] == probe[5]
  assert report["programs"]["train"]["memory"]["fits"] and report["exit"] == 0


def test_with_rl_the_sampler_compiles_the_rollouts_rows():
  """--program rl,decode: the decode loop samples the rollout's rl.prompts_per_step x rl.num_generations rows (here 2 x
  4 = 8 over 4 devices: 2 per device, its cache rows 2), as meshlm rl does; the header names no train batch. Control:
  decode alone compiles for train.per_device_batch_size (8 per device)."""
  args = ("model=llama2-tiny", "topology=cpu:4", "mesh.fsdp=4", "train.seq_len=48", "rl.max_new_tokens=16",
          "rl.prompts_per_step=2", "rl.num_generations=4", "model.num_layers=1", "--no-census")
  from meshlm.commands.compile import render
  report = compile_json(*args, "--program", "rl,decode")
  text = render(report)
  assert "per_device_batch_size" not in text.splitlines()[0] and "[decode] 2 rows per device" in text, text
  # The decode loop's trip count is a runtime value: the decode roofline is one trip of it (the step), named, and
  # no loop is left unread; decode alone compiles no prefill.
  programs = report["programs"]
  assert set(programs) == {"rl", "decode"}
  assert programs["decode"]["roofline"]["step_loop"] and programs["decode"]["roofline"]["unread_loops"] == []
  assert programs["rl"]["roofline"]["unread_loops"] == []
  assert "loops counted once per start" not in text and "one decode step (a trip of the token loop" in text, text
  assert text.count("collective instructions in the text") == 2
  # The decode loop's cache, [B, K, C, H] for K and V per layer: 1 layer x 2 x rows per device x 4 kv heads x 64 x 32.
  cache = lambda rows: 2 * rows * 4 * 64 * 32 * 4  # noqa: E731
  assert report["programs"]["decode"]["memory"]["arguments_by_input"]["cache"] == cache(2)
  alone = compile_json(*args, "--program", "decode")["programs"]["decode"]
  assert alone["rows_per_device"] == 8 and alone["memory"]["arguments_by_input"]["cache"] == cache(8)


def test_sampler_programs_cache_is_the_hand_count():
  """--program prefill,decode compiles both; the decode loop's cache argument is [B, K, C, H] per layer for K and V,
  rows split over fsdp: 2 layers x 2 x (32 / 4 rows) x 4 kv heads x C x 32. --program decode alone compiles the
  decode loop only, from the prefill's traced output types (explicit sharding: their shardings are in the types),
  to the same program: the same memory and roofline. Under auto it compiles the prefill for them, and reports it."""
  args = ("model=llama2-tiny", "topology=cpu:4", "mesh.fsdp=4", "train.seq_len=48", "rl.max_new_tokens=16",
          "--no-census")
  report = compile_json(*args, "--program", "prefill,decode")
  assert set(report["programs"]) == {"prefill", "decode"}
  cache_len = 64  # the bucket of 48 + 16
  mem = report["programs"]["decode"]["memory"]
  assert mem["arguments_by_input"]["cache"] == 2 * 2 * 8 * 4 * cache_len * 32 * 4
  assert mem["alias_bytes"] >= mem["arguments_by_input"]["cache"]  # donated: written in place
  assert report["programs"]["prefill"]["memory"]["arguments_by_input"]["params"] == 1840128
  alone = compile_json(*args, "--program", "decode")["programs"]
  assert set(alone) == {"decode"}
  same = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "arguments_by_input")
  assert {k: alone["decode"]["memory"][k] for k in same} == {k: mem[k] for k in same}
  assert alone["decode"]["roofline"]["bytes"] == report["programs"]["decode"]["roofline"]["bytes"]
  auto = compile_json(*args, "shard_mode=auto", "--program", "decode")["programs"]
  assert set(auto) == {"prefill", "decode"}


# ---------------------------------------------------------------------------------------- errors and help

def _error(capsys, *args) -> str:
  assert main(["compile", *args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  return err[0]


def test_without_libtpu_a_tpu_topology_is_one_line(capsys, monkeypatch):
  from meshlm.parallel import topology
  monkeypatch.setattr(topology, "has_libtpu", lambda: False)
  msg = _error(capsys, "model=llama2-tiny", "topology=v5p:2x2x1", "mesh.fsdp=4")
  assert "libtpu" in msg and "meshlm[tpu]" in msg and "topology=cpu:N" in msg


@pytest.mark.parametrize("args, words", [
    (["model=llama2-tiny"], "topology=NAME is required"),
    (["model=llama2-tiny", "topology=v5p-7"], "no standard v5p slice"),
    (["model=llama2-tiny", "topology=tpu"], "expected cpu:N"),
    # A GPU is named as one (with libtpu installed, libtpu's own refusal read "unknown chip"; without, "install it").
    (["model=llama2-tiny", "topology=gpu:8"], "topology=gpu:8: a GPU; meshlm compile compiles for TPU slices"),
    (["model=llama2-tiny", "topology=h100:8"], "topology=h100:8: a GPU;"),
    (["model=llama2-tiny", "topology=cpu:4", "cpu_devices=4"], "drop cpu_devices"),
    (["model=llama2-tiny", "topology=cpu:4", "--fit"], "give hbm_gib"),
    (["model=llama2-tiny", "topology=cpu:4", "--fit=speed"], "--fit=speed"),
    (["model=llama2-tiny", "topology=cpu:4", "--program", "train,sample"], "--program sample"),
    (["model=llama2-tiny", "topology=cpu:4", "hbm_gib=lots"], "hbm_gib='lots'"),
    (["model=llama2-tiny", "topology=cpu:3", "mesh.fsdp=4"], "mesh.fsdp=4 needs 4 devices but 3 are in use (set "
                                                             "topology= to a topology of that many devices"),
    (["model=llama2-tiny", "topology=cpu:4", "rl.prompts_per_step=3", "rl.num_generations=2", "--program", "rl"],
     "do not split over 4 devices"),
])
def test_bad_input_is_one_line(capsys, args, words):
  assert words in _error(capsys, *args)


def test_accelerator_types_name_chip_grids():
  from meshlm.parallel.topology import parse
  assert parse("v5p-8").grid == "v5p:2x2x1" and parse("v5p-8").chips == 4
  assert parse("v6e-8").grid == "v6e:2x4" and parse("v6e-8").chips == 8
  assert parse("tpu7x-256").grid == "tpu7x:4x4x8" and parse("tpu7x-256").chips == 128
  assert parse("v5p:4x4x8").chips == 128 and parse("cpu:4").platform == "cpu"


# -------------------------------------------------------------------------- HLO counts with trip counts

TPU_LIKE_LOOP = """HloModule m
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %n = s32[]{:T(128)} constant(BOUND)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}
%body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %one = s32[] constant(STEP)
  %k = s32[] add(%j, %one)
  %x = f32[8] get-tuple-element(%q), index=1
  %y = f32[8] multiply(%x, %x)
  ROOT %t = (s32[], f32[8]) tuple(%k, %y)
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %zero = s32[]{:T(128)} constant(START)
  %c = s32[]{:T(128)} copy(%zero)
  %init = (s32[], f32[8]) tuple(%c, %a)
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}
"""


def test_trip_count_from_the_condition_where_the_backend_prints_none():
  """XLA:TPU prints no known_trip_count; the count comes from `i < N`, the start value (through a copy) and the
  body's constant step."""
  from meshlm.analysis import hlo as H
  def trips(text):
    mod = H.parse(text)
    return mod.by_name["w"].trip_count, mod.multipliers.get("body")
  loop = lambda bound, start, step: TPU_LIKE_LOOP.replace("BOUND", str(bound)).replace(  # noqa: E731
      "START", str(start)).replace("STEP", str(step))
  assert trips(loop(32, 0, 1)) == (32, 32)
  assert trips(loop(32, 2, 1)) == (30, 30)
  assert trips(loop(4, 0, 2)) == (2, 2) and trips(loop(5, 0, 2)) == (3, 3)  # XLA:TPU's windowed einsums step by 2
  # Negative controls: a bound read from the state, a start that is not a constant, or an update that is not a
  # constant step, has no count.
  dynamic = loop(0, 0, 1).replace("%n = s32[]{:T(128)} constant(0)", "%n = s32[] get-tuple-element(%p), index=0")
  assert trips(dynamic) == (None, 1)
  assert trips(loop(32, 0, 1).replace("%zero = s32[]{:T(128)} constant(0)", "%zero = s32[] convert(%a)")) == (None, 1)
  assert trips(loop(32, 0, 1).replace("%k = s32[] add(%j, %one)", "%k = s32[] multiply(%j, %one)")) == (None, 1)


def _scanned_matmuls(layers: int):
  """A scan of `layers` [64, 256] x [256, 256] matmuls, and the same loop unrolled, compiled on one CPU device."""
  import jax
  import jax.numpy as jnp
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  w = jax.ShapeDtypeStruct((layers, 256, 256), jnp.float32)
  scanned = jax.jit(lambda x, w: jax.lax.scan(lambda h, k: (jnp.tanh(h @ k), None), x, w)[0])
  def unrolled(x, w):
    for i in range(layers):
      x = jnp.tanh(x @ w[i])
    return x
  return scanned.lower(x, w).compile(), jax.jit(unrolled).lower(x, w).compile()


def test_flops_and_bytes_count_every_trip():
  """XLA's cost_analysis counts a scan's body once; the HLO count weighs it by the trip count, so a scan of 8
  matmuls counts what the unrolled 8 do (XLA's own figure for the unrolled program)."""
  from meshlm.analysis import cost as C
  from meshlm.analysis import hlo as H
  scanned, unrolled = _scanned_matmuls(8)
  mod = H.parse(scanned.as_text())
  matmuls = 8 * 2 * 64 * 256 * 256
  assert C.flops(mod) == matmuls
  xla_unrolled = unrolled.cost_analysis()["flops"]
  assert matmuls <= xla_unrolled < 1.01 * matmuls  # XLA adds the tanh's elementwise work (8 x 64 x 256)
  assert scanned.cost_analysis()["flops"] < matmuls / 4  # the undercount the HLO count exists to fix
  # Negative control: the same walk without the trip counts is XLA's undercount again.
  mod.multipliers.update({k: 1 for k in mod.multipliers})
  assert C.flops(mod) == matmuls / 8
  # Bytes: the unrolled program has no loop, so the estimate and XLA's bytes accessed describe the same
  # instructions (measured: within 1%).
  est, xla = C.traffic_bytes(H.parse(unrolled.as_text())), unrolled.cost_analysis()["bytes accessed"]
  assert abs(est / xla - 1) < 0.05, (est, xla)


# -------------------------------------------------------------------------------------- TPU through libtpu

tpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                         reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")


def blocked_but_scattered(tod: dict) -> list[dict]:
  """The census's blocked transpose-of-dot pairs (`stablehlo.transpose_of_dot`) other than the weight gradients XLA:TPU
  would all-reduce whole: on TPU down's and o's (their FSDP dim minor) are formed dy first, reduce-scattered with
  that dim leading, and the shard transposed into the kernel's order (nn/dense.scatter_order): a dot, its sharding,
  a transpose, by design (issue 55, item 2)."""
  return [p for p in tod["pairs"] if p["kind"] == "blocked"
          and not (p["weight_grad"] and p["scope"].endswith(("mlp/down backward", "attn/o backward")))]


@pytest.fixture(scope="module")
def tpu_run():
  """The report of `meshlm compile` for v5p:2x2x1, and the executable it read (its HLO text and XLA's cost)."""
  from meshlm.analysis import aot
  seen = []
  real = aot.lowered_of
  def keep(lowered, compiled):
    seen.append((compiled.as_text(), compiled.cost_analysis()))
    return real(lowered, compiled)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(aot, "lowered_of", keep)
    # The materialized attention core: the program's loops are the 2-layer scans alone, as the FLOP counts below
    # expect (auto is flash on TPU, whose block loops have data-dependent trip counts: test_tpu_flash_attention).
    report = compile_json(*SMALL_LLAMA, "topology=v5p:2x2x1", "attention_impl=xla")
  (hlo, cost), = seen
  return report, hlo, cost


@pytest.fixture(scope="module")
def tpu_report(tpu_run):
  return tpu_run[0]


@tpu
@pytest.mark.ci_must_run
def test_tpu_arguments_are_the_hand_count_within_rounding(tpu_report):
  """The v5p executable's argument bytes against the hand count: XLA:TPU rounds each buffer up to its tiles
  (measured: 1,524 bytes over, the scalars' padding), so within 4 KiB; the norms-split variant is 24 KB off."""
  mem = tpu_report["programs"]["train"]["memory"]
  hand = hand_count_llama(512, 512, 2, 4, 2, 128, 512, fsdp=4, batch_rows=8, seq=128)
  assert 0 <= mem["argument_bytes"] - sum(hand.values()) <= 4096
  wrong = hand_count_llama(512, 512, 2, 4, 2, 128, 512, fsdp=4, batch_rows=8, seq=128, shard_norms=True)
  assert not 0 <= mem["argument_bytes"] - sum(wrong.values()) <= 4096
  assert not 0 <= mem["argument_bytes"] - (sum(hand.values()) - hand["opt_state"]) <= 4096
  assert mem["peak_source"] == "memory_analysis.peak_memory_in_bytes" and 0 < mem["peak_bytes"]
  # libtpu's own limit for a v5p device: 95.73 GiB, as its refusals print it.
  assert tpu_report["chip"]["hbm_source"] == "compiler"
  assert abs(mem["hbm_bytes"] / (1 << 30) - 95.73) < 0.006
  assert mem["fits"] is True and tpu_report["chip"]["kind"] == "TPU v5" and tpu_report["exit"] == 0


@tpu
@pytest.mark.ci_must_run
def test_tpu_census_and_roofline(tpu_report):
  p = tpu_report["programs"]["train"]
  census = p["census"]
  assert census["hlo"]["collectives"]["all-gather"]["count"] > 0
  # explicit with the kernel-order flags: nothing blocked but the reduce-scattered down and o gradients, one each
  tod = census["stablehlo"]["transpose_of_dot"]
  assert blocked_but_scattered(tod) == [] and tod["blocked"] == 2, tod["pairs"]
  # Per step, the scanned layers' collectives count twice; in the text, once.
  per_step = sum(v["count"] for v in census["hlo"]["collectives"].values())
  assert 0 < sum(p["collective_instructions"].values()) < per_step
  r = p["roofline"]
  # The layers are scanned: XLA counts the body once, the HLO count twice (2 layers).
  assert r["flops"] > 1.3 * r["xla_cost_analysis"]["flops"]
  assert r["model_flops"] < r["flops"]
  assert r["bound_s"] == max(r["flops"] / 459e12, r["bytes"] / 2765e9)
  assert 0 < r["mfu_at_bound"] < 1


@tpu
@pytest.mark.ci_must_run
def test_tpu_convolution_flops_match_xla_counted_alike(tpu_run, monkeypatch):
  """XLA:TPU writes dots as convolutions with padded windows; counting only the window positions that read a
  real element, and every computation once as XLA's cost_analysis does, the count is XLA's up to its elementwise
  FLOPs (measured: 99.1% on llama3-8b for v5p). Negative control: counting every window position is far over."""
  from meshlm.analysis import cost as C
  from meshlm.analysis import hlo as H
  _, hlo, xla = tpu_run
  mod = H.parse(hlo)
  assert sorted(i.trip_count for i in mod.instrs() if i.opcode == "while") == [2, 2]  # the 2-layer scans
  mod.multipliers.update({k: 1 for k in mod.multipliers})
  assert 0.97 < C.flops(mod) / xla["flops"] <= 1.0
  monkeypatch.setattr(C, "_window_pairs", lambda out, inp, size, *rest: out * size)
  assert C.flops(mod) > 1.5 * xla["flops"]


# The attention cores' programs: what they check is the core's kernels and blocked pairs, one row per device compiles
# fastest.
ONE_ROW = ("train.per_device_batch_size=1",)


@tpu
@pytest.mark.ci_must_run
def test_tpu_flash_attention(tpu_report):
  """attention_impl=flash compiles the flash core for TPU (the report says which core each program used), with
  nothing blocked under explicit (but the reduce-scattered weight gradients: blocked_but_scattered); the xla run
  above says xla."""
  report = compile_json(*SMALL_LLAMA, *ONE_ROW, "topology=v5p:2x2x1", "attention_impl=flash")
  assert report["config"]["attention_impl"] == "flash" and tpu_report["config"]["attention_impl"] == "xla"
  assert report["exit"] == 0 and report["programs"]["train"]["memory"]["fits"] is True
  assert blocked_but_scattered(report["programs"]["train"]["census"]["stablehlo"]["transpose_of_dot"]) == []


@tpu
@pytest.mark.ci_must_run
def test_tpu_splash_attention(tpu_run, monkeypatch):
  """attention_impl=auto compiles the splash kernel for TPU: the report says splash and the executable holds the
  Mosaic kernel's custom calls (forward, dq and dkv per layer); the xla program above holds none. gqa projects q, k
  and v heads-first, every core's rows, so nothing is blocked under explicit (issue 44, item 7; but the
  reduce-scattered weight gradients, blocked_but_scattered). Control: the
  old layout (projections [B, T, N, H], transposed to the kernel and back: tokens_first_projections) leaves blocked
  pairs in the attention layer (3 here: q's, k's or v's transpose after its projection, and the output's cotangent
  before the kernel's backward)."""
  from meshlm.analysis import aot
  seen = []
  real = aot.lowered_of
  def keep(lowered, compiled):
    seen.append(compiled.as_text())
    return real(lowered, compiled)
  monkeypatch.setattr(aot, "lowered_of", keep)
  report = compile_json(*SMALL_LLAMA, *ONE_ROW, "topology=v5p:2x2x1")
  assert report["config"]["attention_impl"] == "splash" and report["exit"] == 0
  assert report["config"]["splash_backward"] == "fused"  # auto at one block
  assert report["programs"]["train"]["memory"]["fits"] is True
  (hlo,) = seen
  kernels = hlo.count('custom_call_target="tpu_custom_call"')
  assert kernels >= 2, kernels  # the forward and the fused backward
  assert 'custom_call_target="tpu_custom_call"' not in tpu_run[1]
  assert blocked_but_scattered(report["programs"]["train"]["census"]["stablehlo"]["transpose_of_dot"]) == []
  tokens_first_projections(monkeypatch)
  old = compile_json(*SMALL_LLAMA, *ONE_ROW, "topology=v5p:2x2x1")["programs"]["train"]["census"]["stablehlo"]
  blocked = [p["scope"] for p in blocked_but_scattered(old["transpose_of_dot"])]
  assert len(blocked) >= 2 and all(s.startswith("layers/attn") for s in blocked), old["transpose_of_dot"]


def tokens_first_projections(monkeypatch):
  """The mixers' dense as the layout before every core read heads-first rows: a projection into heads-first rows
  ("...->bnth") projects tokens-first ("...->btnh") and transposes to the core's rows after its dot, and the output
  projection ("bnth,nhd->btd") transposes the core's rows back before its dot (a negative control)."""
  import jax.numpy as jnp
  from meshlm.models import context
  real = context.bound_dense

  def bound(cfg):
    dense = real(cfg)

    def tokens_first(x, kernel, eqn, out_axes, **kw):
      ins, out = eqn.split("->")
      if out in ("bnth", "bkth"):
        y = dense(x, kernel, f"{ins}->bt{out[1]}h", (out_axes[0], out_axes[2], out_axes[1], out_axes[3]), **kw)
        return jnp.swapaxes(y, 1, 2)
      if eqn == "bnth,nhd->btd":
        return dense(jnp.swapaxes(x, 1, 2), kernel, "btnh,nhd->btd", out_axes, **kw)
      return dense(x, kernel, eqn, out_axes, **kw)
    return tokens_first
  monkeypatch.setattr(context, "bound_dense", bound)


# deepseek-v3-tiny on its one dense layer (MLA, then a dense MLP): one layer program, compiled in about 4 s.
MLA_SPLASH = ["model=deepseek-v3-tiny", "model.num_layers=1", "model.first_k_dense_replace=1",
              "train.per_device_batch_size=1", "mesh.fsdp=4", "topology=v5p:2x2x1"]


@tpu
@pytest.mark.ci_must_run
def test_tpu_splash_mla_has_nothing_blocked(monkeypatch):
  """MLA under splash (auto on TPU) projects q (q_b), k_nope (k_b) and v (v_b) heads-first, the kernel's own rows,
  and its output projection contracts the kernel's [B, N, T, Hv] as they are: nothing blocked under explicit (but
  the reduce-scattered weight gradients, blocked_but_scattered; issue
  44, item 7). Control: the old layout (rows [B, T, N, H], transposed to the kernel and back:
  tokens_first_projections) leaves blocked pairs in the attention layer (3 here: a projection's transpose after
  its dot, and the output's cotangent before the kernel's backward)."""
  report = compile_json(*MLA_SPLASH)
  assert report["config"]["attention_impl"] == "splash" and report["exit"] == 0
  assert report["config"]["splash_backward"] == "fused"  # auto at one block
  tod = report["programs"]["train"]["census"]["stablehlo"]["transpose_of_dot"]
  assert blocked_but_scattered(tod) == [], tod["pairs"]
  tokens_first_projections(monkeypatch)
  old = compile_json(*MLA_SPLASH)["programs"]["train"]["census"]["stablehlo"]["transpose_of_dot"]
  blocked = [p["scope"] for p in blocked_but_scattered(old)]
  assert len(blocked) >= 2 and all(s.startswith("layer_0/attn") for s in blocked), old["pairs"]


# The small llama with the blockwise loss: vocab 1024 gives the head kernel a shape, [512, 1024], that no other array
# of the program has (the embedding table is [1024, 512]); 128 positions in blocks of 32 are 4 blocks per row (at
# SMALL_LLAMA's 2 rows per device: 256 positions and 4 rows compiled for 13.4 s of CPU each, this 5-6 s).
HEAD_ONCE = [*SMALL_LLAMA, "model.vocab_size=1024", "topology=v5p:2x2x1", "attention_impl=xla", "loss_impl=blockwise",
             "loss_block=32"]


def _head_moves(report: dict, d: int = 512, v: int = 1024, fsdp: int = 4) -> tuple[dict, int]:
  """({collective kind: per-step count of those carrying the head kernel: [D, V] whole, its [D / fsdp, V] shard
  out of a reduce-scatter, or the row shards' partials of it exchanged, [..., D / fsdp, V]}, the per-step count of
  every collective in the blockwise loss's own scope)."""
  cols = report["programs"]["train"]["census"]["hlo"]["collectives"]
  dims = lambda shape: [int(n) for n in shape.split("[", 1)[1].split("]")[0].split(",") if n]  # noqa: E731
  head = lambda shape: dims(shape) == [d, v] or dims(shape)[-2:] == [d // fsdp, v]  # noqa: E731
  kernel = {k: sum(c["count"] for c in col["calls"] if head(c["shape"])) for k, col in cols.items()}
  in_loss = sum(c["count"] for col in cols.values() for c in col["calls"] if "lm_head_loss" in c["scope"])
  return kernel, in_loss


@tpu
@pytest.mark.ci_must_run
def test_tpu_blockwise_loss_moves_the_head_once_per_step(monkeypatch):
  """The blockwise loss gathers the head kernel once per step and reduces its weight gradient once (issue 55, item
  1): in the v5p program, one all-gather of bf16[512, 1024], one exchange of its partials (item 2), and no
  collective inside the loss's block loops. Control: the per-block form (the kernel left to the loop's dots, each
  block's gradient formed in the kernel's sharding) moves the head per block: 2 gathers per block, and the blocks'
  cotangents cross devices per block."""
  import jax
  from jax.sharding import PartitionSpec as P
  from meshlm.nn import head_loss
  report = compile_json(*HEAD_ONCE)
  assert report["config"]["loss_path"] == "blockwise" and report["exit"] == 0
  moves, in_loss = _head_moves(report)
  # The reduction: the row shards' partials exchanged to each device's slice (an all-to-all), summed there; never
  # an all-reduce of the whole kernel (issue 55, item 2).
  assert moves["all-gather"] == 1 and moves["all-to-all"] == 1 and moves["all-reduce"] == 0, moves
  assert in_loss == 1  # that exchange, after the loss's loops
  monkeypatch.setattr(head_loss, "_gathered", lambda opts, k: k)
  monkeypatch.setattr(head_loss, "_partials", lambda opts, x, k: (1, 1, P(None, None, None, None),
                                                                  P(None, None, *jax.typeof(k).sharding.spec)))
  moves, in_loss = _head_moves(compile_json(*HEAD_ONCE))
  assert moves["all-gather"] >= 2 * 4 and in_loss >= 4, (moves, in_loss)


# The small llama with every FSDP-sharded kernel a size of its own (elements): gate, up, down 512 x 1024; q, o 512 x
# 512; k, v 512 x 256; the embedding table and the head 768 x 512. The norms' [2, 512] are not FSDP-sharded.
RS_LLAMA = [*SMALL_LLAMA, "model.mlp_dim=1024", "model.vocab_size=768", "topology=v5p:2x2x1", "train.seq_len=64",
            "train.per_device_batch_size=1"]  # the weights' reductions; the fewest tokens compile fastest
RS_KERNELS = {"gate|up|down": 512 * 1024, "q|o": 512 * 512, "k|v": 512 * 256, "embed|lm_head": 768 * 512}


def _reductions(report: dict) -> dict[str, list[int]]:
  """{all-reduce, reduce-scatter: the element count of each call's result, once per step}."""
  cols = report["programs"]["train"]["census"]["hlo"]["collectives"]
  dims = lambda shape: [int(d) for d in shape.split("[", 1)[1].split("]")[0].split(",") if d]  # noqa: E731
  return {k: [math.prod(dims(c["shape"])) for c in cols[k]["calls"] for _ in range(c["count"])]
          for k in ("all-reduce", "reduce-scatter")}


@tpu
@pytest.mark.ci_must_run
def test_tpu_weight_gradients_are_reduce_scattered():
  """Every FSDP-sharded weight's gradient reaches its parameter sharding by a reduce-scatter in the v5p program, and
  none is all-reduced whole (issue 55, item 2), under explicit and auto: per step one reduce-scatter of each kernel's shard per layer (the
  embedding table's over V: its all-to-all to the D sharding follows), no all-reduce of a whole kernel's size.
  Control: without the dy-first form (scatter_leading=none, the program before) XLA:TPU all-reduces down's, o's and
  the embedding table's gradients whole, their FSDP dim being minor, and slices them."""
  whole = set(RS_KERNELS.values())
  for mode in ("explicit", "auto"):
    report = compile_json(*RS_LLAMA, f"shard_mode={mode}")
    assert report["exit"] == 0
    red = _reductions(report)
    assert not whole & set(red["all-reduce"]), (mode, red)
    shards = collections.Counter(red["reduce-scatter"])
    # 2 layers: gate, up, down; q, o; k, v; and the head (explicit: the table's over V, 192 x 512, also 1/4; auto
    # gathers the table's rows by an all-to-all and reduces nothing whole)
    want = {512 * 256: 6, 512 * 128: 4, 512 * 64: 4, 768 * 128: 2 if mode == "explicit" else 1}
    assert {n // 4: shards[n // 4] for n in whole} == want, (mode, shards)
  red = _reductions(compile_json(*RS_LLAMA, "scatter_leading=none"))
  # down's per layer and the table's (o's ride in down's all-reduce, a tuple the census names by its largest array)
  assert collections.Counter(n for n in red["all-reduce"] if n in whole) == {512 * 1024: 2, 768 * 512: 1}, red


def test_the_tpu_extra_and_make_tests_lock_pin_the_same_libtpu():
  import pathlib
  import re
  import tomllib
  root = pathlib.Path(__file__).resolve().parents[1]
  extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
  lock = [ln.strip() for ln in (root / "requirements-tpu.lock").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
  assert extra == lock == [lock[0]] and re.fullmatch(r"libtpu==[\d.]+", lock[0])
  assert "requirements-tpu.lock" in (root / "Makefile").read_text()
