"""Explicit equals auto: the issue's 20-step runs under both shard modes, compared step by step.

For each mesh (fsdp=4, data=2,fsdp=2, fsdp=2,tensor=2) and compute dtype (float32, bfloat16) it runs

  meshlm train model=llama2-tiny cpu_devices=4 <mesh> train.steps=20 train.compute_dtype=<dtype> shard_mode=<mode>

for mode in explicit and auto (a fresh process and run_dir each), reads every step's loss from
metrics.jsonl and prints a markdown table of the largest |explicit - auto| loss difference.
Float32 must stay within 1e-5 (reassociation only); bfloat16 is expected near 1e-4.

  .venv/bin/python benchmarks/explicit_auto_parity.py [--steps 20] [--keep DIR] [key=value ...]

Timing does not matter here, only the numbers, but each run takes tens of seconds on CPU (12 runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BIN = os.path.join(os.path.dirname(sys.executable), "meshlm")
MESHES = {
    "fsdp=4": ["mesh.fsdp=4"],
    "data=2,fsdp=2": ["mesh.data=2", "mesh.fsdp=2"],
    "fsdp=2,tensor=2": ["mesh.fsdp=2", "mesh.tensor=2"],
}
DTYPES = ("float32", "bfloat16")
MODES = ("explicit", "auto")
F32_BOUND = 1e-5  # the bound for float32; a sharding bug shows up as 1e-3 or more


def command(mesh: list[str], dtype: str, mode: str, steps: int, extra: list[str], model: str = "llama2-tiny") -> list[str]:
  return [f"model={model}", "cpu_devices=4", *mesh, f"train.steps={steps}", f"train.compute_dtype={dtype}",
          f"shard_mode={mode}", *extra]


def run(args: list[str], run_dir: str) -> list[float]:
  """Losses per step of one `meshlm train` process in a fresh run_dir."""
  cmd = [BIN, "train", *args, f"run_dir={run_dir}"]
  proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  if proc.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--model", default="llama2-tiny")
  ap.add_argument("--mesh", action="append", choices=list(MESHES), help="only these meshes (default: all three)")
  ap.add_argument("--dtype", action="append", choices=DTYPES, help="only these compute dtypes (default: both)")
  ap.add_argument("--keep", help="write the run directories here (default: a temporary folder, removed)")
  ap.add_argument("overrides", nargs="*", help="extra key=value for every run, e.g. train.sample_tokens=0")
  a = ap.parse_args()
  if a.keep and os.path.exists(a.keep) and os.listdir(a.keep):
    raise SystemExit(f"--keep {a.keep}: not empty; a run_dir with checkpoints would resume instead of training")
  root = a.keep or tempfile.mkdtemp(prefix="parity-")
  results = []
  for mesh_name, mesh in MESHES.items():
    if a.mesh and mesh_name not in a.mesh:
      continue
    for dtype in DTYPES:
      if a.dtype and dtype not in a.dtype:
        continue
      losses = {}
      for mode in MODES:
        run_dir = os.path.join(root, f"{mesh_name.replace(',', '_').replace('=', '')}-{dtype}-{mode}")
        print(f"running {mesh_name} {dtype} {mode} ...", file=sys.stderr, flush=True)
        losses[mode] = run(command(mesh, dtype, mode, a.steps, a.overrides, a.model), run_dir)
      diffs = [abs(x - y) for x, y in zip(losses["explicit"], losses["auto"])]
      if len(diffs) != a.steps or len(losses["auto"]) != a.steps:
        raise SystemExit(f"{mesh_name} {dtype}: expected {a.steps} logged steps, got "
                         f"{len(losses['explicit'])} explicit and {len(losses['auto'])} auto")
      worst = max(range(len(diffs)), key=diffs.__getitem__)
      results.append((mesh_name, dtype, diffs, worst, losses))
  if not a.keep:
    import shutil
    shutil.rmtree(root, ignore_errors=True)

  shown = " ".join(["meshlm train", *command(["<mesh>"], "<dtype>", "<explicit|auto>", a.steps, a.overrides, a.model)])
  print(f"Command: `{shown}`, one fresh process per run; losses from metrics.jsonl.\n")
  print("| model | mesh | compute dtype | steps | max abs loss diff | at step | step-0 diff | final loss (explicit / auto) | verdict |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  failed = False
  for mesh_name, dtype, diffs, worst, losses in results:
    if dtype == "float32":
      ok = diffs[worst] <= F32_BOUND
      failed |= not ok
      verdict = f"{'pass' if ok else 'FAIL'} (<= {F32_BOUND:g})"
    else:
      verdict = "reported (expect ~1e-4)"
    print(f"| {a.model} | {mesh_name} | {dtype} | {len(diffs)} | {diffs[worst]:.3g} | {worst} | {diffs[0]:.3g} | "
          f"{losses['explicit'][-1]:.5f} / {losses['auto'][-1]:.5f} | {verdict} |")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
