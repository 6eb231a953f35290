"""The explicit-vs-auto table for every tiny preset: step-time ratio with its 95% interval, census
deltas against auto, compiled memory and the blow-up detector, per preset and arm.

  .venv/bin/python benchmarks/table.py --smoke     # llama2-tiny, tiny shapes, 6 rounds: ~2 min
  .venv/bin/python benchmarks/table.py --target-ci 0.015 --max-seconds 300 --docs docs/bench-table.md
  make bench-table                                 # the full run, as above: up to ~1 h for 9 presets

Rows: every preset named `*-tiny` in the preset registry (`meshlm presets`), so new families join
by adding a preset. Arms (ARMS): auto; explicit (the default: both kernel-order flags on,
weight_grad_impl=custom_vjp); explicit with weight_grad_impl=auto_axes; explicit with both
kernel-order flags off. Each row is one `meshlm bench` run (bench.harness.run: ABBA rounds, the
median of per-round ratios against auto with its order-statistics 95% interval, rounds added
until --target-ci or --max-seconds). Each arm is compiled once: the census (analysis.census_of)
reads the executable that is timed. Writes --out/table.md, table.json and table.png; with --docs
PATH, the markdown also replaces the section between BEGIN and END in PATH (appended, markers
included, if PATH has none) and the plot goes beside PATH as bench-table.png, linked from the section. key=value arguments override the base config of every row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any

ARMS = [
    ("auto", ["shard_mode=auto"]),
    ("explicit", ["shard_mode=explicit"]),
    ("explicit-auto_axes", ["shard_mode=explicit", "weight_grad_impl=auto_axes"]),
    ("explicit-noflags", ["shard_mode=explicit", "lm_head_weight_grad_in_kernel_order=false",
                          "dense_weight_grad_in_kernel_order=false"]),
]
BASELINE = ARMS[0][0]
# Global batch 16 on 4 fake devices, float32 in every preset: the llama2-tiny setting.
BASE = ["cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=4", "train.compute_dtype=float32"]
SMOKE = ["train.per_device_batch_size=1", "train.seq_len=32"]
BEGIN = "<!-- bench-table:begin (benchmarks/table.py writes this section; edits inside are replaced) -->"
END = "<!-- bench-table:end -->"
# Census fields shown as deltas against auto: column title -> dotted census path (or a sum's name).
CENSUS_COLUMNS = {
    "HLO transposes": "hlo.transposes",
    "HLO copies": "hlo.copies",
    "blocked pairs": "stablehlo.transpose_of_dot.blocked",
    "collectives": "collectives.count",
    "collective bytes": "collectives.bytes",
}
MEMORY_COLUMNS = {"temp": "temp_size_in_bytes", "argument": "argument_size_in_bytes", "output": "output_size_in_bytes"}


def tiny_presets() -> list[str]:
  from meshlm.config import preset_names
  return [n for n in preset_names() if n.endswith("-tiny")]


# ------------------------------------------------------------------------------ measuring (slow)

def measure_row(preset: str, base: list[str], *, reps: int, warmup: int, steps_per_rep: int,
                target_ci: float | None, max_seconds: float | None, timer: str, log=None) -> dict[str, Any]:
  """One preset: the bench report of the four arms and each arm's census summary."""
  from meshlm.analysis.arms import build_arms, prepare_devices
  from meshlm.analysis.census import census_of, lowered_of
  from meshlm.bench.harness import TIMERS, compile_arm, run
  arms = build_arms([f"model={preset}", *base], [f"{n}:{','.join(o)}" for n, o in ARMS])
  prepare_devices(arms)
  censuses: dict[str, dict] = {}

  def prepare(arm):
    c = compile_arm(arm, TIMERS[timer])
    censuses[arm.name] = census_summary(census_of(lowered_of(c.lowered, c.compiled)))
    censuses[arm.name]["compile_s"] = c.lower_s + c.compile_s
    return c.runner

  report = run(arms, reps, warmup, log=log, prepare=prepare, steps_per_rep=steps_per_rep, target_ci=target_ci,
               max_seconds=max_seconds, timer=timer)
  return {"preset": preset, "bench": report, "census": censuses}


def census_summary(result: dict[str, Any]) -> dict[str, Any]:
  """The census fields the table shows, from a full census dict."""
  from meshlm.analysis.census import field
  out = {path: field(result, path) for path in CENSUS_COLUMNS.values() if not path.startswith("collectives.")}
  cols = result["hlo"]["collectives"]
  out["collectives.count"] = sum(c["count"] for c in cols.values())
  out["collectives.bytes"] = sum(c["bytes"] for c in cols.values())
  out["memory"] = {k: result.get("memory", {}).get(v) for k, v in MEMORY_COLUMNS.items()}
  out["blowups"] = [{k: b[k] for k in ("op", "shape", "scope")} for b in result.get("blowups", [])]
  out["scan_layout"] = len(result.get("scan_layout", []))
  return out


# ----------------------------------------------------------------------------- formatting (pure)

def fmt_bytes(n: int | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n} B"


def fmt_delta(value, base, as_bytes: bool = False) -> str:
  """'+3', '-12', '0', or '-' when either side is missing."""
  if value is None or base is None:
    return "-"
  d = value - base
  if d == 0:
    return "0"
  return ("+" if d > 0 else "-") + (fmt_bytes(abs(d)) if as_bytes else f"{abs(d):,}")


def ratio_cell(v: dict[str, Any] | None) -> str:
  """'0.987 [0.975, 1.002] ±1.4%, no difference' from a bench verdict entry."""
  if v is None:
    return "-"
  if v.get("ratio") is None:
    return v.get("verdict", "failed")
  text = f"{v['ratio']:.3f}"
  if v.get("ratio_ci"):
    lo, hi = v["ratio_ci"]
    text += f" [{lo:.3f}, {hi:.3f}]"
  word = v["verdict"]
  if word.startswith("no difference"):
    word = f"±{v['half_width']:.1%}, no difference"
  elif word in ("slower", "faster"):
    word = f"**{word}**"
  return f"{text} {word}"


def finding(bench: dict[str, Any]) -> str:
  """The verdict column: a finding when explicit (the default) is slower than auto with an interval
  that excludes 1; otherwise what the interval says about explicit."""
  arms = bench.get("arms", {})
  if arms.get(BASELINE, {}).get("error"):
    return f"auto failed: {arms[BASELINE]['error']}"
  v = bench.get("verdict", {}).get("explicit")
  if v is None or v.get("ratio") is None:
    err = arms.get("explicit", {}).get("error")
    return f"explicit failed: {err}" if err else "explicit failed"
  if v["verdict"] == "slower":
    return f"**finding: explicit slower by {v['ratio'] - 1:.1%}** (interval excludes 1)"
  if v["verdict"] == "faster":
    return f"explicit faster by {1 - v['ratio']:.1%}"
  if v.get("ratio_ci") is None:
    return "too few rounds"
  return f"no difference at ±{v['half_width']:.1%}"


def blowup_cell(blowups: list[dict] | None) -> str:
  if blowups is None:
    return "-"
  if not blowups:
    return "none"
  shown = "; ".join(f"{b['op'].removeprefix('stablehlo.')} {b['shape']} in {b['scope']}" for b in blowups[:2])
  return f"{len(blowups)}: {shown}" + (" ..." if len(blowups) > 2 else "")


def render_markdown(rows: list[dict[str, Any]], header: str = "") -> str:
  """Two tables: step-time ratios with the verdict column, then census deltas and compiled memory."""
  names = [n for n, _ in ARMS]
  out = [header] if header else []
  out += ["| preset | " + " | ".join(f"{n} / auto" for n in names[1:]) + " | rounds | stop | verdict (explicit) |",
          "| --- " * (len(names) + 3) + "|"]
  for row in rows:
    if row.get("error"):
      out.append(f"| {row['preset']} | failed: {row['error']} |" + " |" * (len(names) + 1))
      continue
    b = row["bench"]
    cells = [ratio_cell(b.get("verdict", {}).get(n)) if not b["arms"].get(n, {}).get("error")
             else f"failed: {b['arms'][n]['error']}" for n in names[1:]]
    out.append(f"| {row['preset']} | " + " | ".join(cells) + f" | {b.get('rounds', 0)} | {b['stop']['reason']} | "
               f"{finding(b)} |")
  out += ["", "Census against auto (auto's row: absolute counts; other rows: the arm minus auto) and the compiled "
          "step's memory (`compiled.memory_analysis()`, per device):", "",
          "| preset | arm | " + " | ".join(CENSUS_COLUMNS) + " | " + " | ".join(f"{m} bytes" for m in MEMORY_COLUMNS)
          + " | blow-ups |", "| --- " * (len(CENSUS_COLUMNS) + len(MEMORY_COLUMNS) + 3) + "|"]
  for row in rows:
    if row.get("error"):
      continue
    c = row["census"]
    base = c.get(BASELINE, {})
    for n in names:
      if n not in c:
        out.append(f"| {row['preset']} | {n} | " + " | ".join("-" for _ in CENSUS_COLUMNS) + " | "
                   + " | ".join("-" for _ in MEMORY_COLUMNS) + " | not compiled |")
        continue
      if n == BASELINE:
        counts = [fmt_bytes(c[n][p]) if p.endswith("bytes") else f"{c[n][p]:,}" if c[n][p] is not None else "-"
                  for p in CENSUS_COLUMNS.values()]
      else:
        counts = [fmt_delta(c[n][p], base.get(p), p.endswith("bytes")) for p in CENSUS_COLUMNS.values()]
      mem = [fmt_bytes(c[n]["memory"].get(m)) for m in MEMORY_COLUMNS]
      out.append(f"| {row['preset']} | {n} | " + " | ".join(counts) + " | " + " | ".join(mem) + " | "
                 + blowup_cell(c[n].get("blowups")) + " |")
  return "\n".join(out) + "\n"


def replace_section(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
  """text with everything between the begin and end markers replaced by body; the markers and the
  rest of the text are kept byte for byte. Without markers, the section is appended at the end."""
  body = body if body.endswith("\n") else body + "\n"
  i = text.find(begin)
  j = text.find(end, i + len(begin)) if i >= 0 else -1
  if i < 0 or j < 0:
    if (i < 0) != (text.find(end) < 0) or (i >= 0 and j < 0):
      raise ValueError(f"found one of the markers without the other: {begin!r} / {end!r}")
    sep = "" if not text or text.endswith("\n") else "\n"
    return f"{text}{sep}\n{begin}\n{body}{end}\n"
  return text[:i + len(begin)] + "\n" + body + text[j:]


def plot(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
  """A forest plot: one line per preset, each non-baseline arm's ratio to auto with its 95% interval."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [n for n, _ in ARMS][1:]
  rows = [r for r in rows if not r.get("error")]
  fig, ax = plt.subplots(figsize=(8.0, 1.2 + 0.55 * max(len(rows), 1)), dpi=120, layout="constrained")
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for k, n in enumerate(names):
    ys, xs, lo, hi = [], [], [], []
    for i, r in enumerate(rows):
      v = r["bench"].get("verdict", {}).get(n)
      if not v or v.get("ratio") is None:
        continue
      y = len(rows) - 1 - i - (k - 1) * 0.22  # the arms top to bottom in legend order
      ci = v.get("ratio_ci") or [v["ratio"], v["ratio"]]
      ys.append(y), xs.append(v["ratio"]), lo.append(v["ratio"] - ci[0]), hi.append(ci[1] - v["ratio"])
    ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", ms=4, capsize=3, color=colors[k % len(colors)], label=f"{n} / auto")
  ax.axvline(1.0, color="black", lw=0.8, ls="--")
  ax.set_yticks(range(len(rows)), [r["preset"] for r in reversed(rows)])
  ax.set_xlabel("step time / auto (median of per-round ratios, 95% interval)")
  ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(names), frameon=False)
  fig.suptitle(title or "explicit vs auto, every tiny preset", fontsize=10)
  fig.savefig(path)
  plt.close(fig)


# ------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--presets", help="comma-separated presets (default: every *-tiny preset)")
  ap.add_argument("--reps", type=int, default=12, help="rounds per row; the fewest before --target-ci may stop")
  ap.add_argument("--target-ci", type=float, help="add rounds until every arm's half-width is at most this")
  ap.add_argument("--max-seconds", type=float, default=300.0, help="per row: the time budget of --target-ci")
  ap.add_argument("--steps-per-rep", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--timer", choices=("wall", "cpu"), default="wall")
  ap.add_argument("--out", default="runs/bench-table", help="folder for table.md, table.json, table.png")
  ap.add_argument("--docs", help="a markdown file whose bench-table section is replaced (docs/bench-table.md)")
  ap.add_argument("--smoke", action="store_true", help="llama2-tiny only, global batch 4, seq 32, 6 rounds of 1 step")
  ap.add_argument("overrides", nargs="*", help="key=value for every row, after the base "
                  f"({' '.join(BASE)})")
  a = ap.parse_args(argv)
  from meshlm.errors import ConfigError
  known = tiny_presets()
  presets = a.presets.split(",") if a.presets else (["llama2-tiny"] if a.smoke else known)
  unknown = [p for p in presets if p not in known]
  if unknown:
    print(f"--presets: {unknown[0]!r} is not a tiny preset; tiny presets: {', '.join(known)}", file=sys.stderr)
    return 2
  base = [*BASE, *(SMOKE if a.smoke else []), *a.overrides]
  reps, steps = (6, 1) if a.smoke else (a.reps, a.steps_per_rep)
  target = None if a.smoke else a.target_ci
  if a.docs and not os.path.isfile(a.docs):
    print(f"--docs {a.docs}: no such file", file=sys.stderr)
    return 2
  os.makedirs(a.out, exist_ok=True)
  rows = []
  for p in presets:
    print(f"table: {p}", file=sys.stderr)
    try:
      rows.append(measure_row(p, base, reps=reps, warmup=a.warmup, steps_per_rep=steps, target_ci=target,
                              max_seconds=a.max_seconds if target else None, timer=a.timer))
    except ConfigError as e:  # a preset the base config does not fit: its row says why, the others still run
      print(f"table: {p}: {e}", file=sys.stderr)
      rows.append({"preset": p, "error": str(e)})
  cmd = " ".join(["benchmarks/table.py", *(argv if argv is not None else sys.argv[1:])])
  when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  stop = (f"rounds added until every half-width <= {target:.1%} or {a.max_seconds:g} s per row"
          if target else f"{reps} rounds per row")
  header = (f"Command: `.venv/bin/python {cmd}` ({when}; {platform.machine()}, {os.cpu_count()} cores). "
            f"Base config: `{' '.join(base)}`; each row `model=<preset>` plus the arm's keys; {steps} step(s) per "
            f"visit, {stop}, timer {a.timer}. Cells: median of per-round ratios to auto [95% interval, order "
            "statistics of the median] and the verdict.\n")
  png = os.path.join(a.out, "table.png")
  if a.docs:  # the docs' copy of the plot sits beside the docs file, and the section links it
    png = os.path.join(os.path.dirname(a.docs), "bench-table.png")
    header += f"\n![explicit vs auto, every tiny preset]({os.path.basename(png)})\n"
  md = render_markdown(rows, header)
  with open(os.path.join(a.out, "table.md"), "w") as f:
    f.write(md)
  with open(os.path.join(a.out, "table.json"), "w") as f:
    json.dump({"command": cmd, "base": base, "rows": rows}, f, indent=2, sort_keys=True, default=str)
  plot(rows, png)
  if a.docs:
    with open(a.docs) as f:
      text = f.read()
    with open(a.docs, "w") as f:
      f.write(replace_section(text, md))
  print(md)
  return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
