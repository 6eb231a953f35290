"""Bit-identical losses across a refactor: every tiny preset, 20 steps, float32, fsdp=4.

Runs `meshlm train` from two source trees (this one and a reference commit checked out into a
temporary git worktree) as fresh processes and compares the per-step losses bit for bit:

  .venv/bin/python benchmarks/same_numbers.py --ref de1dd4e [--presets llama2-tiny,gemma3-tiny] [--steps 20]

Prints one row per preset (max |diff|, and whether every loss is bit-identical) and exits 1 when a
preset differs. `--save FILE` / `--load FILE` keep one side's losses to skip rerunning it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def tiny_presets() -> list[str]:
  """Every tiny preset of this tree (the dense, MoE, GDN and MLA ones), from its presets folder."""
  folder = os.path.join(ROOT, "src", "meshlm", "config", "presets")
  return sorted(n[:-5] for n in os.listdir(folder) if n.endswith("-tiny.yaml"))


PRESETS = tiny_presets()


def run(src: str, preset: str, steps: int) -> list[str]:
  """Losses of one run as float.hex strings (exact)."""
  with tempfile.TemporaryDirectory() as run_dir:
    cmd = [sys.executable, "-m", "meshlm.cli", "train", f"model={preset}", "cpu_devices=4", "mesh.fsdp=4",
           f"train.steps={steps}", "train.compute_dtype=float32", "train.per_device_batch_size=2",
           "train.seq_len=64", "train.sample_tokens=0", "data.source=synthetic", f"run_dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "src"), JAX_PLATFORMS="cpu")
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      return [float(json.loads(line)["loss"]).hex() for line in f if line.strip()]


def side(src: str, presets: list[str], steps: int) -> dict[str, list[str]]:
  out = {}
  for p in presets:
    out[p] = run(src, p, steps)
    print(f"  {p}: {len(out[p])} losses from {src}", file=sys.stderr)
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--ref", help="reference commit (checked out into a temporary worktree)")
  ap.add_argument("--load", help="reference losses saved earlier with --save")
  ap.add_argument("--save", help="write the reference losses here")
  ap.add_argument("--presets", default=",".join(PRESETS))
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--only-ref", action="store_true", help="with --save: record the reference side and stop")
  args = ap.parse_args()
  presets = args.presets.split(",")
  if args.load:
    with open(args.load) as f:
      ref = json.load(f)
  else:
    with tempfile.TemporaryDirectory() as tmp:
      tree = os.path.join(tmp, "ref")
      subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, args.ref], check=True,
                     capture_output=True)
      try:
        ref = side(tree, presets, args.steps)
      finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    if args.save:
      with open(args.save, "w") as f:
        json.dump(ref, f, indent=1)
      if args.only_ref:
        return 0
  new = side(ROOT, presets, args.steps)
  bad = 0
  print("| preset | steps | max abs diff | bit-identical |\n| --- | --- | --- | --- |")
  for p in presets:
    a = [float.fromhex(x) for x in ref[p]]
    b = [float.fromhex(x) for x in new[p]]
    same = ref[p] == new[p]
    diff = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
    bad += not same
    print(f"| {p} | {len(b)} | {diff:.3g} | {'yes' if same else 'NO'} |")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
