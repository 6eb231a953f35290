"""benchmarks/chip.py (the train-step, causality and decode benchmark a TPU user runs) on CPU with its tiny rows, and
benchmarks/profile_summary.py on a hand-made trace. One run of the tiny set serves every test of the module."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import chip  # noqa: E402
import profile_summary as PS  # noqa: E402

BROKEN = chip.Row("broken", ("model=llama2-tiny", "model.no_such_key=1"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("chip") / "rows.jsonl"
  lines: list[str] = []
  rows = [chip.SETS["tiny"][0], BROKEN, *chip.SETS["tiny"][1:]]
  records = chip.run(rows, str(out), steps=2, warmup=1, decode_reps=1, matmul_n=128, log=lines.append)
  return records, out, lines


def test_every_row_is_a_json_line_as_it_finishes(run):
  records, out, lines = run
  written = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["kind"] for r in written] == ["backend", "train", "train", "causal", "decode"]
  assert [json.loads(line) for line in lines] == written  # printed and written alike
  assert written[0]["platform"] == "cpu" and written[0]["matmul_tflops_per_s"] > 0


def test_train_row_reports_time_throughput_and_mfu(run):
  records, _, _ = run
  head, r = records[0], records[1]
  assert r["name"] == "llama2-tiny" and "error" not in r
  assert r["tokens"] == 8 * 32  # 8 devices x 1 row x 32 positions
  assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
  assert r["compile_s"] > 0 and r["memory"]["temp_bytes"] > 0
  # MFU against the measured matmul: model FLOPs per token x tokens/s over the devices, over the matmul's FLOP/s.
  achieved = r["model_flops_per_token"] * r["tokens_per_s"] / head["devices"]
  assert r["mfu_vs_matmul"] == pytest.approx(achieved / (head["matmul_tflops_per_s"] * 1e12))
  assert r["mfu"] is None  # a CPU has no published peak
  assert len(r["losses"]) == 1 + 2 + 1  # warm-up, the timed singles, the back-to-back run's last
  assert r["resolved"] == {"attention_impl": "xla", "flash_block": None, "splash_backward": None,
                           "splash_blocks": None, "rope_swap": "roll", "layer_cast": "bits",
                           "remat_attention": "recompute", "scatter_leading": "none", "loss": "materialized"}


def test_a_failed_row_is_recorded_and_the_next_runs(run):
  records, _, _ = run
  bad = records[2]
  assert bad["name"] == "broken" and "no_such_key" in bad["error"]
  assert "step_s" not in bad
  assert records[3]["kind"] == "causal" and "error" not in records[3]


def test_causality_check_and_its_power(run):
  records, _, _ = run
  r = records[3]
  assert r["causal"] is True and all(v["diff"] == 0 for v in r["positions"].values())
  # The control: a token inside the counted span moves the loss, so the check could see a leak.
  assert abs(r["control_diff"]) > 1e-4


def test_decode_row_counts_what_a_step_reads(run):
  records, _, _ = run
  r = records[4]
  assert "error" not in r and r["tokens"] == 8 * 4 and r["tokens_per_s"] > 0
  cfg_params = r["weight_bytes"] / 4  # llama2-tiny computes in float32
  assert cfg_params == int(cfg_params) and r["cache_bytes_allocated_per_step"] >= r["cache_bytes_per_step"] > 0
  assert "roofline_tokens_per_s" not in r  # no published bandwidth for a CPU


@pytest.mark.parametrize("swap_by_matmul", [False, True], ids=["roll", "matmul"])
def test_rope_row_compares_with_rotate_half_and_sees_a_difference(monkeypatch, swap_by_matmul):
  from meshlm.nn import rope as R
  row = chip.Row("rope", (), kind="rope", shape=(2, 3, 33, 64), rope_swap="matmul" if swap_by_matmul else "roll")
  r = chip.rope_row(row)
  assert r["bit_identical"] is True and set(r["rope"]) == {"bfloat16", "float32"}
  # Its power: the roll without the sign fold (apply_rope handed the plain sin) is another rotation, and the row says so.
  monkeypatch.setattr(R, "fold_sign", lambda sin: sin)
  r = chip.rope_row(row)
  assert r["bit_identical"] is False and r["rope"]["float32"]["forward_max_diff"] > 0.1


def test_table_and_rows_by_name():
  recs = [{"kind": "backend", "device_kind": "TPU v5 lite", "platform": "tpu", "jax": "0", "libtpu": "0",
           "date": "d", "matmul_n": 8, "matmul_tflops_per_s": 150.0, "published_peak_tflops": 197.0},
          {"kind": "train", "name": "a", "error": "ValueError: x"}]
  text = chip.table(recs)
  assert "| a | failed: ValueError: x |" in text and "published peak 197" in text
  assert chip.main(["--set", "tiny", "--only", "nope"]) == 2
  assert chip.main(["--set", "nope"]) == 2


def test_finish_uses_the_published_peak():
  info = {"device_kind": "TPU v5 lite", "devices": 1}
  rec = chip.finish({"kind": "train", "step_s": 1.0, "tokens_per_s": 1000.0, "model_flops_per_token": 1e9},
                    info, matmul=1e14)
  assert rec["mfu"] == pytest.approx(1e12 / 197e12) and rec["mfu_vs_matmul"] == pytest.approx(0.01)
  dec = chip.finish({"kind": "decode", "seconds": 1.0, "batch": 2, "tokens_per_s": 100.0, "weight_bytes": 819e9,
                     "cache_bytes_per_step": 0.0, "cache_bytes_allocated_per_step": 819e9}, info, None)
  assert dec["roofline_tokens_per_s"] == pytest.approx(2.0) and dec["of_roofline"] == pytest.approx(50.0)
  assert dec["roofline_allocated_tokens_per_s"] == pytest.approx(1.0)


def _trace(ops):
  ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "X", "name": "jit_step", "pid": 1, "tid": 3, "dur": 1000},
        {"ph": "X", "name": "python", "pid": 9, "tid": 1, "dur": 5000}]
  t, line = 0, []
  for o in ops:  # back to back unless an op gives its own start
    line.append({"ph": "X", "pid": 1, "tid": 2, "ts": t, **o})
    t = line[-1]["ts"] + o["dur"]
  return ev + line


def test_profile_summary_reads_the_device_op_line():
  ops = [{"name": "splash_mha_fwd.1", "dur": 300, "args": {"tf_op": "jit(f)/layers/attn/splash_attention/x"}},
         {"name": "convolution_add_fusion.3", "dur": 200, "args": {"tf_op": "jit(f)/layers/mlp/down/dot"}},
         {"name": "fusion.7", "dur": 100, "args": {"tf_op": "jit(f)/layers/attn/rope/neg"}},
         {"name": "all-reduce.1", "dur": 50, "args": {}},
         {"name": "copy.2", "dur": 50, "args": {}}]
  s = PS.summarize(_trace(ops), top=10, steps=1)
  assert s["line"] == "/device:TPU:0 / XLA Ops" and s["device_us_per_step"] == 700  # the module and host lines left out
  kinds = {r["name"]: r["us_per_step"] for r in s["by_kind"]}
  assert kinds == {"custom-call (splash, Pallas)": 300, "matmul (dot/convolution fusion)": 200,
                   "other fusion (elementwise)": 100, "collective": 50, "copy / transpose": 50}
  scopes = {r["name"]: r["us_per_step"] for r in s["by_scope"]}
  assert scopes["layers/attn/splash_attention"] == 300 and scopes["(no scope)"] == 100
  # Named scopes at any depth, the innermost listed one: splash inside attn, the rope op in attn, the rest other.
  named = {r["name"]: r["us_per_step"] for r in PS.summarize(_trace(ops), scopes=("attn", "splash_attention"))[
      "by_named_scope"]}
  assert named == {"splash_attention": 300, "attn": 100, "(other)": 300}
  assert PS.summarize(_trace(ops))["by_named_scope"] == []  # none asked for
  # Per step: a trace of two steps halves every figure.
  assert PS.summarize(_trace(ops), steps=2)["device_us_per_step"] == 350


def test_profile_summary_counts_a_loop_by_its_own_time():
  # A while op spans the ops of its body on the same line: it counts only the time no op inside it covers.
  ops = [{"name": "while.1", "ts": 0, "dur": 100, "args": {}},
         {"name": "fusion.1", "ts": 10, "dur": 30, "args": {}},
         {"name": "convolution.2", "ts": 50, "dur": 40, "args": {}},
         {"name": "fusion.3", "ts": 120, "dur": 5, "args": {}}]
  s = PS.summarize(_trace(ops))
  assert s["device_us_per_step"] == 105
  assert {r["name"]: r["us_per_step"] for r in s["by_op"]} == {"while.1": 30, "convolution.2": 40, "fusion.1": 30,
                                                               "fusion.3": 5}
