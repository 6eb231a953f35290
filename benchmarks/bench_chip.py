"""Explicit against auto on one TPU chip, from one shared state (`meshlm bench`, docs/tpu.md): a driver for a short
chip session.

  python3 benchmarks/bench_chip.py OUT [--runs qwen3-0.6b-b8,moe12-b8,gdn-0.6b-b2] [--budget 240] [--dry-run]
  python3 benchmarks/bench_chip.py OUT --set tiny          # the same flow on CPU (llama2-tiny), seconds

Each run is one `meshlm bench` process, arms `explicit` (the baseline) and `auto`, guarded by `timeout`: the models of
benchmarks/chip.py (QWEN3_06B at its 28 layers, its MoE twin MOE_12, the GDN hybrid GDN_06B; seq 2048, bf16 compute,
float32 parameters and AdamW, remat=full). The two arms take one state layout, so they step one state in turn and the
chip holds one copy (the report's `states` and `pairs` say so; `state_copies` must be 0). Every run does at least 6
rounds (a 95% interval on auto / explicit), then adds rounds until the interval's half-width is 0.1% or the run's
--max-seconds of rounds have passed. A run's cap is the smaller of its own and what is left of --budget; one that
cannot start within the budget is skipped and says so.

Writes OUT/NAME.json (the bench's JSON report), OUT/NAME.log (its stderr) and OUT/bench_chip.jsonl (one line per
run: command, exit code, wall seconds, and the report's ratio, interval, medians, rounds, states and pairs), and
prints a markdown table for docs/tpu.md.

Expected on a v5e (probe 1's compile and step times, plus ~15 s to open the chip per process): qwen3-0.6b-b8 ~70 s,
moe12-b8 ~80 s, gdn-0.6b-b2 ~175 s (its two compiles are ~70 s each), so the three need two calls within 4 minutes
each: `--runs qwen3-0.6b-b8,moe12-b8`, then `--runs gdn-0.6b-b2`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chip import GDN_06B, MOE_12, QWEN3_06B  # noqa: E402  (the chip rows' model overrides, one definition)

ARMS = ("--arm", "explicit:shard_mode=explicit", "--arm", "auto:shard_mode=auto")


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  overrides: tuple[str, ...]
  cap_s: int  # timeout for the whole process: opening the chip, two compiles, warm-up and rounds
  max_seconds: int  # of rounds, after the first 6 (bench --max-seconds)


SETS: dict[str, list[Run]] = {
    "v5e": [
        Run("qwen3-0.6b-b8", QWEN3_06B + ("train.per_device_batch_size=8", "remat=full"), cap_s=120, max_seconds=25),
        Run("moe12-b8", MOE_12 + ("train.per_device_batch_size=8", "remat=full"), cap_s=120, max_seconds=25),
        # Batch 2: at batch 4 the hybrid needs 16.4 GB of the chip's 15.7 GiB (docs/tpu.md).
        Run("gdn-0.6b-b2", GDN_06B + ("train.per_device_batch_size=2", "remat=full"), cap_s=230, max_seconds=20),
    ],
    "tiny": [
        Run("llama2-tiny", ("model=llama2-tiny", "model.num_layers=1", "train.seq_len=16",
                            "train.per_device_batch_size=1"), cap_s=300, max_seconds=5),
    ],
}


def command(run: Run, python: str) -> list[str]:
  return [python, "-m", "meshlm.cli", "bench", *run.overrides, *ARMS, "--reps", "6", "--warmup", "1",
          "--target-ci", "0.001", "--max-seconds", str(run.max_seconds), "--json"]


def summary(report: dict) -> dict:
  """The run's line: auto / explicit with its interval, both medians, rounds, and how the arms held their state."""
  auto, explicit = report["arms"].get("auto", {}), report["arms"].get("explicit", {})
  return {"ratio": auto.get("ratio"), "ratio_ci": auto.get("ratio_ci"), "explicit_s": explicit.get("median_s"),
          "auto_s": auto.get("median_s"), "rounds": report.get("rounds"), "stop": report.get("stop", {}).get("reason"),
          "states": report.get("states"), "pairs": report.get("pairs"), "state_copies": report.get("state_copies"),
          "errors": {n: a["error"] for n, a in report["arms"].items() if a.get("error")}}


def table(lines: list[dict]) -> str:
  rows = ["| run | explicit ms | auto ms | auto / explicit [95%] | rounds | state |",
          "| --- | --- | --- | --- | --- | --- |"]
  for r in lines:
    if r.get("ratio") is None:
      rows.append(f"| {r['name']} | {r.get('why', 'failed')} | | | | |")
      continue
    ci = r["ratio_ci"] or [float("nan")] * 2
    rows.append(f"| {r['name']} | {r['explicit_s'] * 1e3:.1f} | {r['auto_s'] * 1e3:.1f} | {r['ratio']:.4f} "
                f"[{ci[0]:.4f}, {ci[1]:.4f}] | {r['rounds']} | {r['pairs'].get('auto')} ({len(r['states'])} state) |")
  return "\n".join(rows)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out", help="folder for the JSON reports, logs and bench_chip.jsonl")
  ap.add_argument("--set", default="v5e", choices=sorted(SETS))
  ap.add_argument("--runs", default="", help="comma-separated run names of the set (default: all, in order)")
  ap.add_argument("--budget", type=float, default=240.0, help="seconds for all runs together")
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  a = ap.parse_args()
  runs = SETS[a.set]
  if a.runs:
    names = a.runs.split(",")
    unknown = [n for n in names if n not in {r.name for r in runs}]
    if unknown:
      ap.error(f"--runs: unknown {unknown[0]!r}; the set {a.set} has {', '.join(r.name for r in runs)}")
    runs = [r for r in runs if r.name in names]
  src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), src) if p)}
  if not a.dry_run:
    os.makedirs(a.out, exist_ok=True)
  t0, lines = time.perf_counter(), []
  for run in runs:
    left = a.budget - (0.0 if a.dry_run else time.perf_counter() - t0)
    cap = int(min(run.cap_s, left))
    cmd = ["timeout", "-k", "10", str(cap), *command(run, a.python)]
    print(shlex.join(cmd), file=sys.stderr, flush=True)
    if a.dry_run:
      continue
    line = {"name": run.name, "command": shlex.join(cmd), "cap_s": cap}
    if cap < 30:
      line.update(rc=None, why=f"skipped: {left:.0f} s of the budget left")
    else:
      start = time.perf_counter()
      with open(os.path.join(a.out, f"{run.name}.json"), "w") as out, \
           open(os.path.join(a.out, f"{run.name}.log"), "w") as log:
        rc = subprocess.call(cmd, stdout=out, stderr=log, env=env)
      line.update(rc=rc, wall_s=round(time.perf_counter() - start, 1))
      try:
        with open(os.path.join(a.out, f"{run.name}.json")) as f:
          line.update(summary(json.load(f)))
      except (OSError, ValueError):
        line["why"] = f"timed out after {cap} s" if rc in (124, 137) else f"exit {rc}, no report (see {run.name}.log)"
    lines.append(line)
    with open(os.path.join(a.out, "bench_chip.jsonl"), "a") as f:
      f.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
  if lines:
    print(table(lines))
  return 0 if all(line.get("rc") == 0 for line in lines) else 1


if __name__ == "__main__":
  sys.exit(main())
