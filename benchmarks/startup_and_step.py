"""Time from `meshlm train` starting to its first finished step, and the median step time.

Runs the CLI as a user would (a fresh process each rep), watches metrics.jsonl for the first
step, and reads every step's `step_time_s` from it (the wall time between finished steps). Prints a markdown table with medians and the
spread between reps ((max - min) / median).

  .venv/bin/python benchmarks/startup_and_step.py --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.join(os.path.dirname(sys.executable), "meshlm")
BASE = ["model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1",
        "train.seq_len=128", "train.sample_tokens=0"]
ARMS = {
    "llama2-tiny (float32, unrolled: the preset)": [],
    "bfloat16, unrolled": ["train.compute_dtype=bfloat16"],
    "bfloat16, scanned (the preset before 2026-11-30)": ["train.compute_dtype=bfloat16", "scan_layers=true"],
    "float32, unrolled, vocab 32000": ["model.vocab_size=32000"],
}


def launch(args: list[str], steps: int, binary: str = BIN) -> tuple[float, list[float]]:
  """Runs `binary train ARGS train.steps=STEPS` in a fresh process: (seconds from launch to the first
  metrics.jsonl line, every step's step_time_s)."""
  with tempfile.TemporaryDirectory() as run_dir:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cmd = [binary, "train", *args, f"train.steps={steps}", f"run_dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while first is None and proc.poll() is None:
      if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
        first = time.perf_counter() - t0
      time.sleep(0.01)
    _, err = proc.communicate()
    if proc.returncode:
      raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    with open(metrics) as f:
      rows = [json.loads(l) for l in f]
    if first is None:  # finished between polls
      first = rows[0]["time_to_first_step_s"]
    return first, [r["step_time_s"] for r in rows]


def one_run(extra: list[str], steps: int) -> tuple[float, float]:
  first, times = launch([*BASE, *extra], steps)
  return first, statistics.median(times[3:])  # skip the first steps: compile and warm-up


def spread(xs: list[float]) -> float:
  return (max(xs) - min(xs)) / statistics.median(xs)


def print_table(results: dict[str, tuple[list[float], list[float]]], ratio_to: str | None = None) -> None:
  """Markdown: per arm, the medians and spreads of (start-to-first-step times, per-run step times),
  and with ratio_to, each arm's step time over that arm's."""
  base = statistics.median(results[ratio_to][1]) if ratio_to else None
  print("| arm | start to first step (median, s) | spread | step time (median of per-run medians, s) | spread |"
        + (f" step vs {ratio_to} |" if base else ""))
  print("| --- | --- | --- | --- | --- |" + (" --- |" if base else ""))
  for name, (firsts, steps) in results.items():
    print(f"| {name} | {statistics.median(firsts):.2f} | {spread(firsts):.1%} | "
          f"{statistics.median(steps):.4f} | {spread(steps):.1%} |"
          + (f" {statistics.median(steps) / base:.3f} |" if base else ""))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--steps", type=int, default=30)
  args = ap.parse_args()
  print(f"command: meshlm train {' '.join(BASE)} train.steps={args.steps}  (+ arm keys), {args.reps} reps, arms interleaved")
  results = {name: ([], []) for name in ARMS}
  for _ in range(args.reps):
    for name, extra in ARMS.items():
      first, step = one_run(extra, args.steps)
      results[name][0].append(first)
      results[name][1].append(step)
  print_table(results)


if __name__ == "__main__":
  main()
