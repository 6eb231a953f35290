"""The pure parts of benchmarks/table.py, depth.py, maxtext_vs_meshlm.py, ep_collectives.py and compile_rows.py:
formatting, the docs section replacement, the verdict column, the depth ratio, the MFU arithmetic, the collectives
read from HLO text and the compile rows' selection and table. Nothing here times or compiles anything."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import compile_rows  # noqa: E402
import depth  # noqa: E402
import maxtext_vs_meshlm as mt  # noqa: E402
import table  # noqa: E402
from meshlm.bench.stats import arm_stats, paired, ratios, verdict  # noqa: E402


def bench_report(base_s: list[float], per_arm: dict[str, list[float]], failed: dict[str, str] | None = None) -> dict:
  """A bench report shaped as harness.run's, from per-round times, through the real statistics."""
  arms = {table.BASELINE: arm_stats(base_s)}
  for name, ts in per_arm.items():
    arms[name] = arm_stats(ts) | paired(base_s, ts)
  for name, err in (failed or {}).items():
    arms[name] = {"median_s": None, "spread": None, "reps": [], "error": err}
  return {"arms": arms, "ratios": ratios(arms), "verdict": verdict(arms), "rounds": len(base_s),
          "stop": {"reason": "rounds"}}


def census_row(transposes=40, copies=100, blocked=0, count=6, nbytes=3 << 20, temp=5 << 20, blowups=()):
  return {"hlo.transposes": transposes, "hlo.copies": copies, "stablehlo.transpose_of_dot.blocked": blocked,
          "collectives.count": count, "collectives.bytes": nbytes,
          "memory": {"temp": temp, "argument": 2 << 20, "output": 2 << 20}, "blowups": list(blowups), "scan_layout": 0}


BASE9 = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0]


def synthetic_rows() -> list[dict]:
  slow = [t * 1.05 for t in BASE9]  # every round 5% slower: the interval is [1.05, 1.05]
  noisy = [t * r for t, r in zip(BASE9, [0.97, 1.03, 0.98, 1.02, 1.01, 0.99, 1.04, 0.96, 1.0])]
  row_slow = {"preset": "llama2-tiny", "bench": bench_report(BASE9, {"explicit": slow, "explicit-auto_axes": noisy,
                                                                      "explicit-noflags": noisy}),
              "census": {"auto": census_row(), "explicit": census_row(transposes=32, copies=98),
                         "explicit-auto_axes": census_row(count=8, nbytes=4 << 20),
                         "explicit-noflags": census_row(blocked=13, blowups=[
                             {"op": "stablehlo.multiply", "shape": [163840, 32], "scope": "rope"}])}}
  row_same = {"preset": "qwen3-tiny", "bench": bench_report(BASE9, {"explicit": noisy, "explicit-auto_axes": noisy},
                                                             failed={"explicit-noflags": "XlaRuntimeError: boom"}),
              "census": {"auto": census_row(), "explicit": census_row(), "explicit-auto_axes": census_row()}}
  return [row_slow, row_same, {"preset": "mixtral-tiny", "error": "mesh: no"}]


# ------------------------------------------------------------------------------------------ table

def test_tiny_presets_come_from_the_registry():
  from meshlm.config import preset_names
  names = table.tiny_presets()
  assert {"llama2-tiny", "mixtral-tiny", "qwen3-moe-tiny", "gemma3-tiny"} <= set(names)
  assert "llama2-7b" not in names and names == sorted(names)
  assert set(names) < set(preset_names())


def test_markdown_from_a_synthetic_result():
  md = table.render_markdown(synthetic_rows(), header="HEAD\n")
  lines = md.splitlines()
  assert lines[0] == "HEAD"
  step_rows = [l for l in lines if l.startswith("| llama2-tiny | ") and l.count("|") == 8]
  assert len(step_rows) == 1
  cells = [c.strip() for c in step_rows[0].strip("|").split("|")]
  # explicit: every round 1.05 -> ratio and both ends 1.050, slower, and the verdict column's finding.
  assert cells[1] == "1.050 [1.050, 1.050] **slower**"
  assert cells[-1].startswith("**finding: explicit slower by 5.0%**")
  assert cells[-3] == "9"
  noisy = [c.strip() for c in next(l for l in lines if l.startswith("| qwen3-tiny | ")).strip("|").split("|")]
  v = paired(BASE9, [t * r for t, r in zip(BASE9, [0.97, 1.03, 0.98, 1.02, 1.01, 0.99, 1.04, 0.96, 1.0])])
  lo, hi = v["ratio_ci"]
  assert lo < 1 < hi
  assert noisy[1] == f"{v['ratio']:.3f} [{lo:.3f}, {hi:.3f}] ±{v['half_width']:.1%}, no difference"
  assert noisy[3] == "failed: XlaRuntimeError: boom"
  assert noisy[-1] == f"no difference at ±{v['half_width']:.1%}"
  assert "| mixtral-tiny | failed: mesh: no |" in md
  # Census: auto absolute, the others as deltas; memory in binary units; the blow-up named.
  census = {tuple(c.strip() for c in l.strip("|").split("|")[:2]): [c.strip() for c in l.strip("|").split("|")[2:]]
            for l in lines if l.count("|") == 12 and not l.startswith("| preset") and not l.startswith("| ---")}
  assert census[("llama2-tiny", "auto")][:5] == ["40", "100", "0", "6", "3.0 MiB"]
  assert census[("llama2-tiny", "explicit")][:5] == ["-8", "-2", "0", "0", "0"]
  assert census[("llama2-tiny", "explicit-auto_axes")][:5] == ["0", "0", "0", "+2", "+1.0 MiB"]
  assert census[("llama2-tiny", "explicit-noflags")][2] == "+13"
  assert census[("llama2-tiny", "explicit")][5:8] == ["5.0 MiB", "2.0 MiB", "2.0 MiB"]
  assert census[("llama2-tiny", "explicit-noflags")][8] == "1: multiply [163840, 32] in rope"
  assert census[("llama2-tiny", "auto")][8] == "none"
  assert census[("qwen3-tiny", "explicit-noflags")][8] == "not compiled"


@pytest.mark.parametrize("factor, word", [(1.05, "slower"), (0.95, "faster"), (None, "none")])
def test_verdict_column(factor, word):
  """A finding only when explicit's interval excludes 1 on the slow side (the negative controls: the
  same shift to the fast side, and an interval that covers 1)."""
  mix = [0.97, 1.03, 0.98, 1.02, 1.01, 0.99, 1.04, 0.96, 1.0]
  arm = [t * (factor or r) for t, r in zip(BASE9, mix)]
  text = table.finding(bench_report(BASE9, {"explicit": arm}))
  assert text.startswith("**finding") == (word == "slower")
  assert ("faster" in text) == (word == "faster")
  assert text.startswith("no difference at ±") == (word == "none")


def test_verdict_column_failures_and_too_few_rounds():
  assert table.finding(bench_report(BASE9, {}, failed={"explicit": "OOM"})) == "explicit failed: OOM"
  assert table.finding(bench_report(BASE9[:4], {"explicit": BASE9[:4]})) == "too few rounds"
  r = bench_report(BASE9, {"explicit": BASE9})
  r["arms"]["auto"]["error"] = "boom"
  assert table.finding(r) == "auto failed: boom"


def test_section_replacement_is_idempotent_and_keeps_the_rest():
  before = "# Performance\n\nintro\n\n## Table\n\n"
  after = "\n## Next section\n\nkeep me\n"
  text = f"{before}{table.BEGIN}\nnot measured yet\n{table.END}{after}"
  once = table.replace_section(text, "| new | table |\n")
  assert once == f"{before}{table.BEGIN}\n| new | table |\n{table.END}{after}"
  assert table.replace_section(once, "| new | table |\n") == once
  assert "not measured yet" not in once
  # A body without a final newline still leaves the end marker on its own line.
  assert table.replace_section(text, "x") == f"{before}{table.BEGIN}\nx\n{table.END}{after}"
  # No markers: appended with them, and a second write replaces rather than appends again.
  plain = "# Doc\n\ntext"
  appended = table.replace_section(plain, "T\n")
  assert appended.startswith(plain + "\n") and appended.endswith(f"{table.BEGIN}\nT\n{table.END}\n")
  assert table.replace_section(appended, "T\n") == appended
  assert table.replace_section(appended, "U\n").count(table.BEGIN) == 1


def test_section_replacement_refuses_a_lone_marker():
  with pytest.raises(ValueError, match="without the other"):
    table.replace_section(f"a\n{table.BEGIN}\nb\n", "T")
  with pytest.raises(ValueError, match="without the other"):
    table.replace_section(f"a\n{table.END}\nb\n", "T")


def test_census_summary_sums_collectives():
  result = {"hlo": {"transposes": 3, "copies": 5, "collectives": {
                "all-gather": {"count": 4, "bytes": 100, "calls": []},
                "reduce-scatter": {"count": 2, "bytes": 50, "calls": []}}},
            "stablehlo": {"transpose_of_dot": {"blocked": 1}},
            "memory": {"temp_size_in_bytes": 7, "argument_size_in_bytes": 8, "output_size_in_bytes": 9},
            "blowups": [{"op": "stablehlo.iota", "shape": [4], "scope": "s", "line": 3, "ratio": 9.0}],
            "scan_layout": []}
  s = table.census_summary(result)
  assert (s["collectives.count"], s["collectives.bytes"]) == (6, 150)
  assert (s["hlo.transposes"], s["hlo.copies"], s["stablehlo.transpose_of_dot.blocked"]) == (3, 5, 1)
  assert s["memory"] == {"temp": 7, "argument": 8, "output": 9}
  assert s["blowups"] == [{"op": "stablehlo.iota", "shape": [4], "scope": "s"}]


def test_unknown_preset_is_one_line_and_exit_2(capsys, tmp_path):
  assert table.main(["--presets", "llama2-tiny,nope-tiny", "--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "'nope-tiny' is not a tiny preset" in err[0]
  assert not os.listdir(tmp_path)


# ------------------------------------------------------------------------------------------ depth

def depth_row(d, cell, compile_s, instrs=100, scan=True, layout=(), cpu=None):
  cpu = compile_s / 2 if cpu is None else cpu
  return {"depth": d, "cell": cell, "scan": scan, "lower_s": 0.5, "compile_s": compile_s - 0.5,
          "lower_cpu_s": 0.25, "compile_cpu_s": cpu - 0.25,
          "hlo_instructions": instrs, "stablehlo_ops": 2 * instrs, "scan_layout": list(layout)}


def test_depth_compile_ratio_deepest_over_shallowest():
  rows = [depth_row(2, "scan-axis0-explicit", 4.0), depth_row(8, "scan-axis0-explicit", 4.4),
          depth_row(32, "scan-axis0-explicit", 5.2, instrs=110, cpu=3.0),
          depth_row(2, "unrolled-axis0-explicit", 4.0, scan=False), depth_row(32, "unrolled-axis0-explicit", 40.0,
                                                                              instrs=1600, scan=False),
          depth_row(4, "scan-axis1-auto", 2.0), depth_row(16, "scan-axis1-auto", 2.8)]
  g = depth.growth(rows)
  assert g["scan-axis0-explicit"] == {"shallow": 2, "deep": 32, "ratio": pytest.approx(5.2 / 4.0)}
  assert g["unrolled-axis0-explicit"]["ratio"] == pytest.approx(10.0)
  assert (g["scan-axis1-auto"]["shallow"], g["scan-axis1-auto"]["deep"]) == (4, 16)
  lines = depth.summary_lines(rows)
  # 5.2 / 4.0 = 1.3 exactly: within the bound (flat); 2.8 / 2.0 = 1.4: not flat; unrolled is not judged.
  assert "**1.30** (flat)" in lines[0] and "HLO instructions x1.10" in lines[0]
  assert "in CPU seconds 1.50" in lines[0]  # 3.0 / (4.0 / 2): the CPU-seconds ratio is its own
  assert depth.growth(rows, depth.compile_cpu)["scan-axis0-explicit"]["ratio"] == pytest.approx(1.5)
  assert "unrolled: expected to grow" in lines[1] and "HLO instructions x16.00" in lines[1]
  assert "**1.40** (NOT flat (> 1.3x))" in lines[2]


def test_depth_growth_skips_cells_with_one_depth_or_no_compile():
  rows = [depth_row(2, "a", 3.0), {"depth": 4, "cell": "a", "error": "x"}]
  assert depth.growth(rows) == {}


def test_layout_verdict():
  assert depth.layout_verdict({"scan": True, "scan_layout": []}) == "ok: every stack layer-major"
  assert depth.layout_verdict({"scan": True, "scan_layout": [{}, {}]}) == "**2 stacks not layer-major**"
  assert depth.layout_verdict({"scan": False, "scan_layout": []}) == "n/a (unrolled)"
  assert depth.layout_verdict({"scan": True}) == "-"


def test_depth_cells_baseline_first_and_distinct():
  cs = depth.cells()
  assert cs[0] == ("scan-axis0-explicit", ["scan_layers=true", "param_scan_axis=0", "shard_mode=explicit"])
  assert len({n for n, _ in cs}) == len(cs) == 8


# ---------------------------------------------------------------------------------- MaxText / MFU

TINY = dict(embed=4, mlp=6, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10, seq=3, per_device_batch=1)


def test_flops_per_token_hand_count():
  # q 4x(2x2) = 16, k and v 4x(1x2) = 8 each, o (2x2)x4 = 16, gate/up/down 3 x 4x6 = 72: 120 per layer;
  # head 4x10 = 40: 160 matmul parameters, 6 x 160 = 960. Attention: 12 x 1 layer x 2 heads x 2 x seq 3 = 144,
  # halved for the causal mask (72) unless causal=False.
  assert mt.flops_per_token(TINY) == 960 + 72
  assert mt.flops_per_token(TINY, causal=False) == 960 + 144
  assert mt.flops_per_step(TINY) == (960 + 72) * 1 * mt.DEVICES * 3
  # Negative control: grouped-query heads count: with kv_heads = heads the count moves by 6 x 2 x 4 x 2.
  assert mt.flops_per_token(TINY | {"kv_heads": 2}) == 960 + 72 + 6 * 16


def test_flops_per_token_matches_meshlm_parameter_shapes():
  """The formula's matmul parameters are the model's: every rank >= 2 kernel of a llama config at the
  compute geometry's sizes (layer axis aside), minus the embedding table (a lookup, not a matmul)."""
  from meshlm.config import load_config
  from meshlm.models.params import param_specs
  from meshlm import spec as S
  import jax
  g = mt.GEOMETRIES["compute"]
  cfg = load_config(*mt.meshlm_base(g))
  specs = param_specs(cfg)
  total = 0
  for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=S.is_spec)[0]:
    dims = [n for n, a in zip(s.shape, s.axes) if a != "layers"]
    layers = math.prod(n for n, a in zip(s.shape, s.axes) if a == "layers")
    if len(dims) >= 2 and "embed" != jax.tree_util.keystr(path).strip("[]'"):
      total += layers * math.prod(dims)
  attention = 12 * g["layers"] * g["heads"] * g["head_dim"] * g["seq"]
  assert mt.flops_per_token(g, causal=False) == 6 * total + attention
  assert (cfg.model.embed_dim, cfg.model.mlp_dim, cfg.model.num_layers, cfg.model.vocab_size) == (512, 1376, 4, 4096)
  assert cfg.train.per_device_batch_size * 4 == 8 and cfg.train.seq_len == 256 and cfg.mesh.fsdp == 4


def test_mfu_arithmetic():
  rate, frac = mt.mfu(step_flops=2e9, step_s=0.5, peak_flops_per_s=16e9)
  assert (rate, frac) == (4e9, 0.25)
  results = {"a": ([1.0, 2.0, 3.0], [0.5, 0.4, 0.6]), "b": ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])}
  md = mt.mfu_table(results, "b", step_flops=2e9, peak=16e9).splitlines()
  assert md[2] == "| a | 2.00 | 100.0% | 0.5000 | 40.0% | 0.500 | 4.0 | 25.0% |"
  assert md[3] == "| b | 1.00 | 0.0% | 1.0000 | 0.0% | 1.000 | 2.0 | 12.5% |"


def test_reference_geometry_is_the_old_command_line():
  """The reference geometry's derived keys give the same config as the script's former literal list."""
  from meshlm.config import load_config
  old = ["model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1",
         "train.seq_len=128", "train.sample_tokens=0", "data.source=synthetic"]
  assert load_config(*mt.meshlm_base(mt.GEOMETRIES["reference"])) == load_config(*old)
  assert load_config(*mt.meshlm_base(mt.GEOMETRIES["compute"])) != load_config(*old)
  assert mt.MAXTEXT_BASE[:10] == ["dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=128",
                                  "base_emb_dim=256", "base_num_decoder_layers=2", "base_num_query_heads=8",
                                  "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=768", "vocab_size=512"]


def test_maxtext_log_lines():
  """MaxText 0.2.5's lines: a step's seconds, and its start-up FLOP split; other lines are None."""
  line = ("I1130 13:45:01 metric_logger.py:240] completed step: 7, seconds: 2.000, TFLOP/s/device: 0.025, "
          "Tokens/s/device: 256.0, total_weights: 2048, loss: 8.3, lm_loss: 8.3, perplexity: 4000.0")
  assert mt.parse_step_line(line) == (7, 2.0)
  assert mt.parse_step_line("completed profiler activation/deactivation step: 3") is None
  split = mt.SPLIT_LINE.search(" split as 98.28% learnable weight flops and 1.72% attention flops")
  assert split and float(split.group(2)) == 1.72


def test_attention_share():
  # TINY: weights 960, attention 144 full or 72 causal.
  assert mt.attention_share(TINY) == pytest.approx(100 * 72 / 1032)
  assert mt.attention_share(TINY, causal=False) == pytest.approx(100 * 144 / 1104)


def test_table_cells_are_the_median_spread_and_paired_ratio():
  """benchmarks/moe_vs_dense.py prints these cells per arm."""
  from meshlm.bench.stats import table_cells
  base = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  arm = [2.0, 2.2, 1.8, 2.0, 2.0, 2.1, 1.9]
  med, spread, ratio, ci = table_cells(base, arm, 1e3, ".2f")
  assert (med, spread, ratio) == ("2000.00", "20%", "2.000")
  lo, hi = (float(v) for v in ci.strip("[]").split(", "))
  assert lo <= 2.0 <= hi and lo >= 1.8 and hi <= 2.2
  # Too few rounds for an interval: an empty cell. A different base moves the ratio (control).
  assert table_cells([1.0], [2.0])[3] == ""
  assert table_cells([2.0] * 7, arm)[2] == "1.000"


def test_moe_layer_arm_specs():
  """benchmarks/moe_vs_dense.py --arm NAME=key:value,...: the keywords reach moe_mlp typed (the variants the
  merged moe_grouped_matmul.py --layer ran: the reference, split gate/up, argsort unsort, block rows)."""
  import moe_vs_dense
  assert moe_vs_dense.parse_arm("reference=impl:reference") == ("reference", {"impl": "reference"})
  assert moe_vs_dense.parse_arm("v=fused_gate_up:false,block_rows:32,router_dtype:bfloat16") == (
      "v", {"fused_gate_up": False, "block_rows": 32, "router_dtype": "bfloat16"})
  assert moe_vs_dense.parse_arm("plain=") == ("plain", {})
  # Control: a value that is not a bool, int or float stays a string ("False" is not "false").
  assert moe_vs_dense.parse_arm("x=grad_barrier:False") == ("x", {"grad_barrier": "False"})


# A hand-written optimized-HLO module: an all-to-all in a 3-trip loop, a ragged-all-to-all and an async all-gather pair.
EP_HLO = """HloModule m, entry_computation_layout={()->f32[]}

%body (p: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %p = (s32[], bf16[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,4]{1,0} get-tuple-element(%p), index=1
  %a = bf16[8,4]{1,0} all-to-all(%x), dimensions={0}
  ROOT %t = (s32[], bf16[8,4]{1,0}) tuple(%i, %a)
}

%cond (p: (s32[], bf16[8,4])) -> pred[] {
  %p = (s32[], bf16[8,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: bf16[8,4], z: bf16[16,4], o: s32[2]) -> f32[] {
  %x = bf16[8,4]{1,0} parameter(0)
  %z = bf16[16,4]{1,0} parameter(1)
  %o = s32[2]{0} parameter(2)
  %r = bf16[16,4]{1,0} ragged-all-to-all(%x, %z, %o, %o, %o, %o), replica_groups={{0,1}}
  %ags = (bf16[8,4]{1,0}, bf16[16,4]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = bf16[16,4]{1,0} all-gather-done(%ags)
  %init = (s32[], bf16[8,4]{1,0}) tuple(%o, %x)
  %w = (s32[], bf16[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %c = f32[] constant(0)
}
"""


def test_ep_collectives_counts_ragged_all_to_all_and_loops():
  """benchmarks/ep_collectives.py's collectives(): per kind the instructions per step (a loop body times its trips, an
  async pair once) and the bytes of each result's largest array (a ragged-all-to-all's: its receive buffer)."""
  import ep_collectives
  got = ep_collectives.collectives(EP_HLO)
  assert {k: (v["count"], v["bytes"]) for k, v in got.items()} == {
      "all-to-all": (3, 3 * 8 * 4 * 2), "ragged-all-to-all": (1, 16 * 4 * 2), "all-gather": (1, 16 * 4 * 2)}
  assert got["ragged-all-to-all"]["shapes"] == ["bf16[16,4]{1,0}"]
  # Control: without the loop's trip count the body counts once.
  assert ep_collectives.collectives(EP_HLO.replace('"n":"3"', '"n":"1"'))["all-to-all"]["count"] == 1


def compile_report(attention: str, peak_gib: float) -> dict:
  """A `meshlm compile --json` report with the fields compile_rows.row reads (no census: its columns are "-")."""
  g = 1 << 30
  return {"topology": {"name": "v5p-8"},
          "config": {"mesh": {"fsdp": 4, "tensor": 1}, "shard_mode": "explicit", "attention_impl": attention,
                     "seq_len": 8192},
          "programs": {"train": {"compile_s": 69.4, "memory": {"peak_bytes": peak_gib * g, "hbm_bytes": 95.73 * g,
                                                               "fits": True, "temp_bytes": 18.06 * g},
                                 "roofline": {"bound_s": 1.0044, "bound_by": "compute", "mfu_at_bound": 0.9146}}}}


def test_compile_rows_selection_and_table(tmp_path, capsys):
  """--rows picks rows in the order given, an unknown name exits 2 in one line naming it, and --table writes one
  line per row with a report (the attention core among its cells), none for a row without one."""
  assert compile_rows.selected(["out"]) == list(compile_rows.ROWS)
  assert compile_rows.selected(["out", "--rows", "qwen3_v5p8_auto,dsv3_v5p512"]) == ["qwen3_v5p8_auto", "dsv3_v5p512"]
  with pytest.raises(SystemExit) as e:
    compile_rows.selected(["out", "--rows", "dsv3_v5p512,nope"])
  assert e.value.code == 2 and capsys.readouterr().err.strip().startswith("compile_rows: --rows nope: not a row")
  (tmp_path / "llama3_v5p8_explicit.json").write_text(json.dumps(compile_report("splash", 36.91)))
  (tmp_path / "qwen3_v5p8_auto.json").write_text("")
  lines = compile_rows.table(str(tmp_path)).splitlines()
  assert len(lines) == 3 and lines[0].count("|") == lines[2].count("|") == 15, lines
  assert lines[2] == ("| llama3_v5p8_explicit | v5p-8 | fsdp=4 | explicit | splash | 8192 | 69 | 36.91 / 95.73 | yes "
                      "| 18.06 | 1,004 (com) | 91% | - | - |")
  assert compile_rows.row("x", compile_report("xla", 36.91)).split(" | ")[4] == "xla"
