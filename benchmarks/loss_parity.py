"""Same losses from two ways of training: explicit against auto sharding, or this tree against a commit.

Both modes run `meshlm train` as fresh processes (a fresh run_dir each), read every step's loss from
metrics.jsonl and compare the two runs step by step.

Explicit against auto (the default): for each mesh (fsdp=4, data=2,fsdp=2, fsdp=2,tensor=2) and compute dtype
(float32, bfloat16)

  meshlm train model=<model> cpu_devices=4 <mesh> train.steps=20 train.compute_dtype=<dtype> shard_mode=<mode>

for mode in explicit and auto; prints a markdown table of the largest |explicit - auto| loss difference.
Float32 must stay within 1e-5 (reassociation only); bfloat16 is expected near 1e-4. 12 runs of tens of seconds.

  .venv/bin/python benchmarks/loss_parity.py [--model <preset>] [--mesh fsdp=4] [--dtype float32] [key=value ...]

This tree against a commit (--ref or --load): every tiny preset (or --presets), 20 steps, float32, fsdp=4, from
this tree and from REV checked out into a temporary git worktree; the losses compared bit for bit (float.hex).
Prints one row per preset (max |diff|, bit-identical or not). `--save FILE` / `--load FILE` keep the
reference side's losses to skip rerunning it.

  .venv/bin/python benchmarks/loss_parity.py --ref de1dd4e [--presets llama2-tiny,gemma3-tiny] [--steps 20] \
      [key=value ...]

key=value: for both sides' runs (remat=full model.num_layers=8, say); a --load file saved with the same ones.

Both modes exit 1 when a float32 comparison fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {
    "fsdp=4": ["mesh.fsdp=4"],
    "data=2,fsdp=2": ["mesh.data=2", "mesh.fsdp=2"],
    "fsdp=2,tensor=2": ["mesh.fsdp=2", "mesh.tensor=2"],
}
DTYPES = ("float32", "bfloat16")
MODES = ("explicit", "auto")
F32_BOUND = 1e-5  # the bound for float32; a sharding bug shows up as 1e-3 or more
# The across-commit runs: small and synthetic, so that every tiny preset fits in minutes.
REF_KEYS = ("cpu_devices=4", "mesh.fsdp=4", "train.compute_dtype=float32", "train.per_device_batch_size=2",
            "train.seq_len=64", "train.sample_tokens=0", "data.source=synthetic")


def tiny_presets() -> list[str]:
  """Every tiny preset of this tree (the dense, MoE, GDN and MLA ones), from its presets folder."""
  folder = os.path.join(ROOT, "src", "meshlm", "config", "presets")
  return sorted(n[:-5] for n in os.listdir(folder) if n.endswith("-tiny.yaml"))


def train_losses(args: list[str], run_dir: str, src: str = ROOT) -> list[float]:
  """Losses per step of one `meshlm train` process in run_dir, from the source tree src (default: this one)."""
  cmd = [sys.executable, "-m", "meshlm.cli", "train", *args, f"run_dir={run_dir}"]
  env = dict(os.environ, PYTHONPATH=os.path.join(src, "src"), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  if proc.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


# ------------------------------------------------------------------------------------ explicit vs auto

def mode_command(mesh: list[str], dtype: str, mode: str, steps: int, extra: list[str], model: str) -> list[str]:
  return [f"model={model}", "cpu_devices=4", *mesh, f"train.steps={steps}", f"train.compute_dtype={dtype}",
          f"shard_mode={mode}", *extra]


def explicit_vs_auto(a: argparse.Namespace) -> int:
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
        losses[mode] = train_losses(mode_command(mesh, dtype, mode, a.steps, a.overrides, a.model), run_dir)
      diffs = [abs(x - y) for x, y in zip(losses["explicit"], losses["auto"])]
      if len(diffs) != a.steps or len(losses["auto"]) != a.steps:
        raise SystemExit(f"{mesh_name} {dtype}: expected {a.steps} logged steps, got "
                         f"{len(losses['explicit'])} explicit and {len(losses['auto'])} auto")
      worst = max(range(len(diffs)), key=diffs.__getitem__)
      results.append((mesh_name, dtype, diffs, worst, losses))
  if not a.keep:
    shutil.rmtree(root, ignore_errors=True)

  shown = " ".join(["meshlm train", *mode_command(["<mesh>"], "<dtype>", "<explicit|auto>", a.steps, a.overrides,
                                                  a.model)])
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


# ------------------------------------------------------------------------------ this tree vs a commit

def side(src: str, presets: list[str], steps: int, extra: list[str] = ()) -> dict[str, list[str]]:
  """Losses per preset as float.hex strings (exact), from the source tree src; extra: key=value for every run."""
  out = {}
  for p in presets:
    with tempfile.TemporaryDirectory() as run_dir:
      args = [f"model={p}", *REF_KEYS, f"train.steps={steps}", *extra]
      out[p] = [float(x).hex() for x in train_losses(args, run_dir, src)]
    print(f"  {p}: {len(out[p])} losses from {src}", file=sys.stderr)
  return out


def tree_vs_ref(a: argparse.Namespace) -> int:
  presets = a.presets.split(",") if a.presets else tiny_presets()
  if a.load:
    with open(a.load) as f:
      ref = json.load(f)
  else:
    with tempfile.TemporaryDirectory() as tmp:
      tree = os.path.join(tmp, "ref")
      subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, a.ref], check=True, capture_output=True)
      try:
        ref = side(tree, presets, a.steps, a.overrides)
      finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    if a.save:
      with open(a.save, "w") as f:
        json.dump(ref, f, indent=1)
      if a.only_ref:
        return 0
  new = side(ROOT, presets, a.steps, a.overrides)
  bad = 0
  print("| preset | steps | max abs diff | bit-identical |\n| --- | --- | --- | --- |")
  for p in presets:
    x, y = [float.fromhex(v) for v in ref[p]], [float.fromhex(v) for v in new[p]]
    same = ref[p] == new[p]
    diff = max(abs(u - v) for u, v in zip(x, y)) if len(x) == len(y) else float("inf")
    bad += not same
    print(f"| {p} | {len(y)} | {diff:.3g} | {'yes' if same else 'NO'} |")
  return 1 if bad else 0


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=20)
  mode = ap.add_argument_group("explicit against auto (the default)")
  mode.add_argument("--model", default="llama2-tiny")
  mode.add_argument("--mesh", action="append", choices=list(MESHES), help="only these meshes (default: all three)")
  mode.add_argument("--dtype", action="append", choices=DTYPES, help="only these compute dtypes (default: both)")
  mode.add_argument("--keep", help="write the run directories here (default: a temporary folder, removed)")
  ap.add_argument("overrides", nargs="*", help="extra key=value for every run, e.g. train.sample_tokens=0")
  ref = ap.add_argument_group("this tree against a commit")
  ref.add_argument("--ref", help="reference commit (checked out into a temporary worktree)")
  ref.add_argument("--load", help="reference losses saved earlier with --save")
  ref.add_argument("--save", help="write the reference losses here")
  ref.add_argument("--presets", help="comma-separated presets (default: every *-tiny preset)")
  ref.add_argument("--only-ref", action="store_true", help="with --save: record the reference side and stop")
  a = ap.parse_args()
  if a.ref or a.load:
    return tree_vs_ref(a)
  return explicit_vs_auto(a)


if __name__ == "__main__":
  sys.exit(main())
