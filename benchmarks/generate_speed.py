"""Decode speed: sampling with the KV cache against recomputing the whole prefix for every token.

  .venv/bin/python benchmarks/generate_speed.py --model llama2-tiny --batch 8 --new 256 --reps 3
  .venv/bin/python benchmarks/generate_speed.py --model qwen3-0.6b --batch 8 --new 256 --recompute-tokens 4 --reps 2

Both arms are greedy over the same batch of prompts (--prompt-len tokens each), float32, one process,
each timed after a warm-up call that compiles it; the arms alternate within each rep. The recompute
arm runs the whole [B, bucket] buffer through `forward` for each new token (the reference in
meshlm.models.generate, batched). Every recompute step costs the same (the buffer has a fixed
width), so --recompute-tokens N times only its first N tokens to save time without changing its
rate. Prints tokens/s per
arm (median over reps, spread = (max - min) / median), the ratio, and the compilations that one
generate call caused.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import meshlm  # noqa: E402
from meshlm.models import decoder  # noqa: E402
from meshlm.models.params import init_params
from meshlm.models import generate as G  # noqa: E402
from meshlm.parallel.mesh import make_mesh  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="llama2-tiny")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new", type=int, default=256)
  ap.add_argument("--recompute-tokens", type=int, default=None, help="time only this many recomputed tokens")
  ap.add_argument("--reps", type=int, default=3)
  args = ap.parse_args()
  cfg = meshlm.load_config(f"model={args.model}", "train.compute_dtype=float32", "cpu_devices=1", "mesh.fsdp=1")
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(0, cfg.model.vocab_size, args.prompt_len)] for _ in range(args.batch)]
  n_re = args.recompute_tokens or args.new
  width = G.bucket(args.prompt_len + args.new, cfg.model.max_position)

  @jax.jit
  def next_tokens(params, buf, i):  # [B, width] -> greedy token at position i for every row
    logits = decoder.forward(cfg, params, buf)
    return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False), axis=-1).astype(jnp.int32)

  def recompute() -> float:
    buf = np.zeros((args.batch, width), np.int32)
    buf[:, :args.prompt_len] = np.asarray(prompts)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      for i in range(args.prompt_len, args.prompt_len + n_re):
        buf[:, i] = np.asarray(next_tokens(params, jnp.asarray(buf), i))
    return args.batch * n_re / (time.perf_counter() - t0)

  def cached() -> float:
    t0 = time.perf_counter()
    out = G.generate(cfg, params, prompts, max_new_tokens=args.new, stop_tokens=(), mesh=mesh)
    assert all(len(t) == args.new for t in out.token_lists())
    return args.batch * args.new / (time.perf_counter() - t0)

  first = G.generate(cfg, params, prompts, max_new_tokens=args.new, stop_tokens=(), mesh=mesh)  # warm-up: compiles
  compilations = first.compilations
  with jax.set_mesh(mesh):
    np.asarray(next_tokens(params, jnp.zeros((args.batch, width), jnp.int32), args.prompt_len))
  rates = {"cached": [], "recompute": []}
  for rep in range(args.reps):
    for arm in (("cached", "recompute") if rep % 2 == 0 else ("recompute", "cached")):
      rates[arm].append(cached() if arm == "cached" else recompute())
  print(f"{args.model}: batch {args.batch}, prompt {args.prompt_len}, {args.new} new tokens "
        f"(recompute timed over {n_re}), {args.reps} reps; one generate call compiled {compilations}")
  print("| arm | tokens/s (median) | spread |\n| --- | --- | --- |")
  med = {}
  for arm, r in rates.items():
    med[arm] = statistics.median(r)
    print(f"| {arm} | {med[arm]:.1f} | {(max(r) - min(r)) / med[arm]:.1%} |")
  print(f"cached / recompute: {med['cached'] / med['recompute']:.1f}x")


if __name__ == "__main__":
  main()
