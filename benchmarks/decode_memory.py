"""A decode step's memory and speed at a real size, this tree against a reference commit, in one run.

  .venv/bin/python benchmarks/decode_memory.py --ref c2c6337 [--model qwen3-0.6b] [--batch 8] [--cache 512]
      [--steps 8] [--reps 2]

Each side runs in a fresh process (the reference from a temporary git worktree), alternating
ref, new, ref, new, ...: one jitted decode step (decoder.decode, the cache donated) after a prefill of
a 32-token prompt into a cache of --cache slots, float32, one device. Each process prints the cache's
bytes, the compiled step's memory_analysis() (a temp near the cache's size means the step copies the
cache) and the median wall time of --steps decode steps after 2 warm-up steps; the table gives decode
tokens/s (batch / step time) per rep and the new/ref ratio of the medians. `--child` is the per-process
measurement (it works with both decoder APIs: before and after the layer interface).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(model: str, batch: int, cache_len: int, steps: int) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  import meshlm
  from meshlm.models import decoder
  from meshlm.models.params import init_params
  from meshlm.parallel.mesh import make_mesh
  cfg = meshlm.load_config(f"model={model}", "train.compute_dtype=float32", "cpu_devices=1", "mesh.fsdp=1")
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  block = np.ones((batch, 32), np.int32)
  lengths = np.full(batch, 32, np.int32)

  def prefill(p, t, n):
    return decoder.prefill(cfg, p, t, n, cache_len)[1]  # old API: (logits, cache); new: (logits, cache, side)

  def step(p, tok, pos, cache):
    out = decoder.decode(cfg, p, tok, pos, cache)
    return jnp.argmax(out[0], axis=-1).astype(jnp.int32), out[1]

  with jax.set_mesh(mesh):
    cache = jax.jit(prefill)(params, block, lengths)
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    decode = jax.jit(step, donate_argnums=(3,))
    tok = jnp.ones((batch,), jnp.int32)
    mem = decode.lower(params, tok, jnp.asarray(lengths), cache).compile().memory_analysis()
    times = []
    for i in range(steps + 2):
      t0 = time.perf_counter()
      tok, cache = decode(params, tok, jnp.asarray(lengths + i), cache)
      tok.block_until_ready()
      times.append(time.perf_counter() - t0)
  return {"cache_bytes": cache_bytes, "temp_bytes": mem.temp_size_in_bytes,
          "argument_bytes": mem.argument_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
          "step_s": statistics.median(times[2:])}


def run(src: str, args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--batch", str(args.batch),
         "--cache", str(args.cache), "--steps", str(args.steps)]
  env = dict(os.environ, PYTHONPATH=os.path.join(src, "src"), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--ref", help="reference commit (checked out into a temporary worktree)")
  ap.add_argument("--model", default="qwen3-0.6b")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--cache", type=int, default=512)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--child", action="store_true")
  args = ap.parse_args()
  if args.child:
    print(json.dumps(child(args.model, args.batch, args.cache, args.steps)))
    return 0
  rows = {"ref": [], "new": []}
  with tempfile.TemporaryDirectory() as tmp:
    tree = os.path.join(tmp, "ref")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, args.ref], check=True, capture_output=True)
    try:
      for rep in range(args.reps):
        for side, src in (("ref", tree), ("new", ROOT)):
          r = run(src, args)
          rows[side].append(r)
          print(f"  rep {rep} {side}: {json.dumps(r)}", file=sys.stderr)
    finally:
      subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
  mb = 2 ** 20
  print(f"{args.model}, batch {args.batch}, cache {args.cache} slots, float32, 1 device, {args.reps} reps x "
        f"{args.steps} steps (median step per rep)\n")
  print("| tree | cache (MiB) | temp (MiB) | temp / cache | decode tokens/s per rep |\n| --- | --- | --- | --- | --- |")
  for side in ("ref", "new"):
    r = rows[side][0]
    rates = ", ".join(f"{args.batch / x['step_s']:.2f}" for x in rows[side])
    print(f"| {side} ({args.ref if side == 'ref' else 'HEAD'}) | {r['cache_bytes'] / mb:.1f} | {r['temp_bytes'] / mb:.1f} | "
          f"{r['temp_bytes'] / r['cache_bytes']:.3f} | {rates} |")
  ratio = statistics.median(x["step_s"] for x in rows["ref"]) / statistics.median(x["step_s"] for x in rows["new"])
  print(f"\nnew / ref decode tokens/s (ratio of median step times): {ratio:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
