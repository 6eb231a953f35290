"""Explicit vs auto step time for docs/performance.md: wraps `meshlm bench` and prints the table.

Run on a quiet machine (nothing else using the cores):
  .venv/bin/python benchmarks/explicit_vs_auto.py [--reps 7] [--model llama2-tiny] [--out runs/bench]
It runs the issue's four arms (auto, explicit with each weight_grad_impl, explicit without the
flags) in one interleaved bench, writes the JSON and a PNG under --out, and prints a markdown
table with the command, reps and spread, ready to paste into docs/performance.md.
"""
import argparse
import json
import os
import platform
import subprocess
import sys

ARMS = [
    "auto:shard_mode=auto",
    "explicit:shard_mode=explicit",
    "explicit-auto_axes:shard_mode=explicit,weight_grad_impl=auto_axes",
    "explicit-noflags:shard_mode=explicit,lm_head_weight_grad_in_kernel_order=false,dense_weight_grad_in_kernel_order=false",
]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="llama2-tiny")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--steps-per-rep", type=int, default=5)
  ap.add_argument("--out", default="runs/bench-explicit-vs-auto")
  ap.add_argument("overrides", nargs="*", help="extra key=value, e.g. train.compute_dtype=float32")
  a = ap.parse_args()
  os.makedirs(a.out, exist_ok=True)
  base = [f"model={a.model}", "cpu_devices=4", "mesh.fsdp=4", *a.overrides]
  cmd = [os.path.join(os.path.dirname(sys.executable), "meshlm"), "bench", *base]
  for arm in ARMS:
    cmd += ["--arm", arm]
  cmd += ["--reps", str(a.reps), "--steps-per-rep", str(a.steps_per_rep), "--json", "--plot", os.path.join(a.out, "bench.png")]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  sys.stderr.write(proc.stderr)
  if proc.returncode not in (0, 1) or not proc.stdout.strip():
    return proc.returncode or 1
  report = json.loads(proc.stdout)
  with open(os.path.join(a.out, "bench.json"), "w") as f:
    json.dump(report, f, indent=2, sort_keys=True)
  shown = " ".join(c if " " not in c else repr(c) for c in ["meshlm", *cmd[1:]])
  print(f"Command: `{shown}`  ")
  print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; reps {a.reps} of {a.steps_per_rep} steps each, arms interleaved.\n")
  print("| arm | median step (s) | spread | vs auto | verdict |")
  print("| --- | --- | --- | --- | --- |")
  for name, arm in report["arms"].items():
    if arm.get("error"):
      print(f"| {name} | failed: {arm['error']} | | | |")
      continue
    v = report["verdict"].get(name, {}).get("verdict", "baseline")
    print(f"| {name} | {arm['median_s']:.4f} | {arm['spread']:.1%} | {report['ratios'][name]:.3f} | {v} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
