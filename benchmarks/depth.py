"""Depth sweep: compile time, step time and compiled memory of a llama-style model from 2 to 32 layers,
scanned and unrolled, param_scan_axis 0 and 1, under both shard modes; the scan-stack layout
detector's verdict on every cell.

  .venv/bin/python benchmarks/depth.py --smoke    # tiny widths, depths 2 and 4: 16 compiles, 4-10 min
  .venv/bin/python benchmarks/depth.py --reps 9   # the full sweep, llama2-tiny widths: 40 compiles, ~30-45 min
  (--depths, --layouts, --axes, --modes restrict the grid)

For each depth, the cells (layout x param_scan_axis x shard mode) are the arms of one
`bench.harness.run` (ABBA rounds, ratios against the first cell, scanned / axis 0 / explicit, with
their 95% interval); every arm is compiled once by `bench.harness.compile_arm`, which times the
lowering and XLA's compile, and the census (analysis.census_of) reads that executable: the
scan-stack layout detector (`scan_layout`: stacked arrays of a scanned loop whose layout does not
keep the layer axis major), the instruction counts and the memory. The goal the issue sets: under
scan, compile time at the deepest depth within 1.3x of the shallowest. The summary states that
ratio per scanned cell and, beside it, how much the optimized HLO grew (what grows when compile
time does). Writes --out/depth.md, depth.json and depth.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any

DEPTHS = [2, 4, 8, 16, 32]
BASE = ["model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1", "train.seq_len=128",
        "train.compute_dtype=float32"]
SMOKE = ["model.embed_dim=64", "model.mlp_dim=128", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
         "model.vocab_size=256", "train.seq_len=32"]
SMOKE_DEPTHS = [2, 4]
FLAT = 1.3  # the bound on compile(deepest) / compile(shallowest) under scan


def cell_name(scan: bool, axis: int, mode: str) -> str:
  return f"{'scan' if scan else 'unrolled'}-axis{axis}-{mode}"


def cells(layouts=(True, False), axes=(0, 1), modes=("explicit", "auto")) -> list[tuple[str, list[str]]]:
  """(name, overrides) per cell; the first (scanned, axis 0, explicit, by default) is the baseline."""
  return [(cell_name(s, a, m), [f"scan_layers={str(s).lower()}", f"param_scan_axis={a}", f"shard_mode={m}"])
          for s in layouts for a in axes for m in modes]


# ------------------------------------------------------------------------------ measuring (slow)

def measure_depth(depth: int, base: list[str], cell_list, *, reps: int, warmup: int, steps_per_rep: int,
                  timer: str, log=None) -> list[dict[str, Any]]:
  """Every cell at one depth: compile seconds, step time and its paired ratio, memory, census counts."""
  from meshlm.analysis.arms import build_arms, prepare_devices
  from meshlm.analysis.census import census_of, lowered_of
  from meshlm.bench.harness import TIMERS, compile_arm, run
  arms = build_arms([*base, f"model.num_layers={depth}"], [f"{n}:{','.join(o)}" for n, o in cell_list])
  prepare_devices(arms)
  info: dict[str, dict] = {}

  def prepare(arm):
    c = compile_arm(arm, TIMERS[timer])
    r = census_of(lowered_of(c.lowered, c.compiled))
    info[arm.name] = {"lower_s": c.lower_s, "compile_s": c.compile_s, "lower_cpu_s": c.lower_cpu_s,
                      "compile_cpu_s": c.compile_cpu_s,
                      "memory": {k: r["memory"].get(f"{k}_size_in_bytes") for k in ("temp", "argument", "output")},
                      "scan_layout": r["scan_layout"], "while_loops": len(r["hlo"]["while_loops"]),
                      "hlo_instructions": sum(r["hlo"]["op_counts"].values()),
                      "stablehlo_ops": sum(r["stablehlo"]["op_counts"].values())}
    return c.runner

  report = run(arms, reps, warmup, log=log, prepare=prepare, steps_per_rep=steps_per_rep, timer=timer)
  out = []
  for name, overrides in cell_list:
    a = report["arms"][name]
    row = {"depth": depth, "cell": name, "scan": "scan_layers=true" in overrides,
           "axis": int(overrides[1].split("=")[1]), "mode": overrides[2].split("=")[1],
           "step_s": a.get("median_s"), "spread": a.get("spread"), "error": a.get("error"),
           "ratio": a.get("ratio"), "ratio_ci": a.get("ratio_ci"), "rounds": report["rounds"]}
    row.update(info.get(name, {}))
    out.append(row)
  return out


# ----------------------------------------------------------------------------- formatting (pure)

def compile_total(row: dict[str, Any]) -> float | None:
  """Wall seconds from the traced step to the executable: lowering + XLA's compile."""
  if row.get("lower_s") is None or row.get("compile_s") is None:
    return None
  return row["lower_s"] + row["compile_s"]


def compile_cpu(row: dict[str, Any]) -> float | None:
  """The same in this process's CPU seconds: what the compile costs, without the waits for a core
  that another process holds (on a shared machine the wall time mostly measures the others)."""
  if row.get("lower_cpu_s") is None or row.get("compile_cpu_s") is None:
    return None
  return row["lower_cpu_s"] + row["compile_cpu_s"]


def layout_verdict(row: dict[str, Any]) -> str:
  """The scan-stack layout detector's verdict on one cell."""
  if row.get("scan_layout") is None:
    return "-"
  if not row["scan"]:
    return "n/a (unrolled)" if not row["scan_layout"] else f"{len(row['scan_layout'])} stacks not layer-major"
  if not row["scan_layout"]:
    return "ok: every stack layer-major"
  return f"**{len(row['scan_layout'])} stacks not layer-major**"


def growth(rows: list[dict[str, Any]], key=compile_total) -> dict[str, dict[str, Any]]:
  """Per cell: key(deepest) / key(shallowest) over the depths measured, with both depths.

  The issue's flatness check is this ratio for compile_total under scan, against FLAT."""
  by_cell: dict[str, dict[int, float]] = {}
  for r in rows:
    v = key(r)
    if v is not None:
      by_cell.setdefault(r["cell"], {})[r["depth"]] = v
  out = {}
  for cell, vals in by_cell.items():
    lo, hi = min(vals), max(vals)
    if lo == hi or not vals[lo]:
      continue
    out[cell] = {"shallow": lo, "deep": hi, "ratio": vals[hi] / vals[lo]}
  return out


def render_markdown(rows: list[dict[str, Any]], header: str = "") -> str:
  out = [header] if header else []
  out += ["| layers | cell | compile s (lower + XLA) | compile CPU s | step s (spread) | step / first cell "
          "[95% interval] | temp | argument | output | HLO instructions | scan-stack layout |",
          "| --- " * 11 + "|"]
  from table import fmt_bytes  # the same directory
  for r in rows:
    if r.get("error"):
      out.append(f"| {r['depth']} | {r['cell']} | failed: {r['error']} |" + " |" * 8)
      continue
    ct = compile_total(r)
    ratio = "1 (baseline)" if r.get("ratio") is None else f"{r['ratio']:.3f}" + (
        f" [{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}]" if r.get("ratio_ci") else "")
    mem = [fmt_bytes(r.get("memory", {}).get(k)) for k in ("temp", "argument", "output")]
    cpu = compile_cpu(r)
    out.append(f"| {r['depth']} | {r['cell']} | {ct:.2f} | {'-' if cpu is None else f'{cpu:.2f}'} | {r['step_s']:.4f} "
               f"({r['spread']:.0%}) | {ratio} | " + " | ".join(mem) + f" | {r['hlo_instructions']:,} | "
               f"{layout_verdict(r)} |")
  out.append("")
  out += summary_lines(rows)
  return "\n".join(out) + "\n"


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
  """Compile time deepest / shallowest per scanned cell, against FLAT, and what grew beside it."""
  comp = growth(rows)
  cpu = growth(rows, compile_cpu)
  instrs = growth(rows, lambda r: r.get("hlo_instructions"))
  shlo = growth(rows, lambda r: r.get("stablehlo_ops"))
  lines = []
  for cell, g in comp.items():
    scanned = cell.startswith("scan")
    verdict = ("flat" if g["ratio"] <= FLAT else f"NOT flat (> {FLAT}x)") if scanned else "unrolled: expected to grow"
    on_cpu = f"; in CPU seconds {cpu[cell]['ratio']:.2f}" if cell in cpu else ""
    what = (f"; HLO instructions x{instrs[cell]['ratio']:.2f}, StableHLO ops x{shlo[cell]['ratio']:.2f}"
            if cell in instrs and cell in shlo else "")
    lines.append(f"- {cell}: compile at {g['deep']} layers / at {g['shallow']} layers = **{g['ratio']:.2f}** "
                 f"({verdict}){on_cpu}{what}")
  return lines


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Compile time and step time against depth, one line per cell (log2 depth axis)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_c, ax_p, ax_s) = plt.subplots(1, 3, figsize=(13, 4.2), dpi=120, layout="constrained")
  names = list(dict.fromkeys(r["cell"] for r in rows))
  depths = sorted({r["depth"] for r in rows})
  for n in names:
    rs = sorted((r for r in rows if r["cell"] == n and not r.get("error")), key=lambda r: r["depth"])
    style = "-" if n.startswith("scan") else ":"
    d = [r["depth"] for r in rs]
    ax_c.plot(d, [compile_total(r) for r in rs], style, marker="o", ms=3, label=n)
    ax_p.plot(d, [compile_cpu(r) for r in rs], style, marker="o", ms=3, label=n)
    ax_s.plot(d, [r["step_s"] * 1e3 for r in rs], style, marker="o", ms=3, label=n)
  for ax, y in ((ax_c, "compile time (wall s, lower + XLA)"), (ax_p, "compile time (CPU s, lower + XLA)"),
                (ax_s, "step time (ms, median)")):
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(x) for x in depths])
    ax.minorticks_off()
    ax.set_xlabel("layers")
    ax.set_ylabel(y)
    ax.set_ylim(bottom=0)
  ax_c.legend(fontsize=7)
  fig.suptitle("depth sweep: solid = scanned, dotted = unrolled", fontsize=10)
  fig.savefig(path)
  plt.close(fig)


# ------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--depths", help=f"comma-separated layer counts (default {','.join(map(str, DEPTHS))})")
  ap.add_argument("--modes", default="explicit,auto")
  ap.add_argument("--axes", default="0,1")
  ap.add_argument("--layouts", default="scan,unrolled")
  ap.add_argument("--reps", type=int, default=9, help="bench rounds per depth")
  ap.add_argument("--steps-per-rep", type=int, default=2)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--timer", choices=("wall", "cpu"), default="wall")
  ap.add_argument("--out", default="runs/bench-depth")
  ap.add_argument("--smoke", action="store_true", help="tiny widths, depths 2 and 4, 6 rounds of 1 step")
  ap.add_argument("overrides", nargs="*", help=f"key=value after the base ({' '.join(BASE)})")
  a = ap.parse_args(argv)
  try:
    depths = [int(d) for d in a.depths.split(",")] if a.depths else (SMOKE_DEPTHS if a.smoke else DEPTHS)
    axes = tuple(int(x) for x in a.axes.split(","))
  except ValueError:
    print("--depths/--axes: expected comma-separated integers", file=sys.stderr)
    return 2
  layouts = tuple({"scan": True, "unrolled": False}.get(x) for x in a.layouts.split(","))
  modes = tuple(a.modes.split(","))
  if None in layouts or not set(modes) <= {"explicit", "auto"} or not set(axes) <= {0, 1} or min(depths) < 1:
    print("--layouts: scan,unrolled; --modes: explicit,auto; --axes: 0,1; --depths: positive", file=sys.stderr)
    return 2
  base = [*BASE, *(SMOKE if a.smoke else []), *a.overrides]
  reps, steps = (6, 1) if a.smoke else (a.reps, a.steps_per_rep)
  cell_list = cells(layouts, axes, modes)
  os.makedirs(a.out, exist_ok=True)
  rows: list[dict[str, Any]] = []
  from meshlm.errors import ConfigError
  for d in depths:
    print(f"depth: {d} layers", file=sys.stderr)
    try:
      rows += measure_depth(d, base, cell_list, reps=reps, warmup=a.warmup, steps_per_rep=steps, timer=a.timer)
    except ConfigError as e:
      print(f"depth: {e}", file=sys.stderr)
      return 2
  cmd = " ".join(["benchmarks/depth.py", *(argv if argv is not None else sys.argv[1:])])
  when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  header = (f"Command: `.venv/bin/python {cmd}` ({when}; {platform.machine()}, {os.cpu_count()} cores). Base: "
            f"`{' '.join(base)}` plus `model.num_layers=N` and the cell's keys; {reps} rounds of {steps} step(s) "
            f"per depth, the cells interleaved; step ratio against {cell_list[0][0]} at the same depth.\n")
  md = render_markdown(rows, header)
  with open(os.path.join(a.out, "depth.md"), "w") as f:
    f.write(md)
  with open(os.path.join(a.out, "depth.json"), "w") as f:
    json.dump({"command": cmd, "base": base, "rows": rows}, f, indent=2, sort_keys=True, default=str)
  plot(rows, os.path.join(a.out, "depth.png"))
  print(md)
  return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  sys.exit(main())
