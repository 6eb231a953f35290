"""MLA decode: absorbed (attend against the latent cache) against plain (rebuild K/V from it), tokens/s.

Both arms share the parameters and one prefilled latent cache (the two paths write the same rows); each arm's
decode step is compiled before timing, then the arms alternate, each rep running --steps decode steps of the
batch from that cache. The ratio absorbed / plain is per rep, from one run.

  .venv/bin/python benchmarks/mla_decode.py --model deepseek-v3-small --batch 4 --cache 1024 --steps 8 --reps 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="deepseek-v3-small")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--prompt", type=int, default=0, help="prompt length (default: cache - steps)")
  ap.add_argument("--cache", type=int, default=1024, help="cache length (positions)")
  ap.add_argument("--steps", type=int, default=8, help="decode steps per rep")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np

  import meshlm
  from meshlm.models import decoder
  from meshlm.models.params import init_model_state, init_params, merge_state
  from meshlm.parallel.mesh import make_mesh

  prompt = args.prompt or args.cache - args.steps
  cfgs = {arm: meshlm.load_config(f"model={args.model}", "train.compute_dtype=float32", "cpu_devices=1",
                                  "mesh.fsdp=1", f"model.parts.mla.absorb={absorb}")
          for arm, absorb in (("absorbed", "true"), ("plain", "false"))}
  cfg = cfgs["absorbed"]
  mesh = make_mesh(cfg)
  key = jax.random.key(0)
  params = merge_state(init_params(cfg, key, mesh), init_model_state(cfg, key, mesh))
  rng = np.random.default_rng(0)
  B = args.batch
  block = rng.integers(0, cfg.model.vocab_size, (B, prompt)).astype(np.int32)
  lengths = np.full(B, prompt, np.int32)

  def steps_fn(c):
    def run(p, tok, pos, cache):
      def body(i, carry):
        tok, cache = carry
        logits, cache, _ = decoder.decode(c, p, tok, pos + i, cache)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache
      return jax.lax.fori_loop(0, args.steps, body, (tok, cache))[0]
    return jax.jit(run)

  with jax.set_mesh(mesh):
    logits, cache, _ = jax.jit(lambda p, t, n: decoder.prefill(cfg, p, t, n, args.cache))(params, block, lengths)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    pos = jnp.asarray(lengths)
    fns = {arm: steps_fn(c) for arm, c in cfgs.items()}
    first = {}
    for arm, f in fns.items():  # compile, and check the two agree
      first[arm] = np.asarray(f(params, tok, pos, cache))
    same = bool(np.array_equal(first["absorbed"], first["plain"]))
    times = {arm: [] for arm in fns}
    for r in range(args.reps):
      for arm in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
        t0 = time.perf_counter()
        fns[arm](params, tok, pos, cache).block_until_ready()
        times[arm].append(time.perf_counter() - t0)
  cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
  ratios = [p / a for a, p in zip(times["absorbed"], times["plain"])]
  out = {"model": args.model, "batch": B, "cache": args.cache, "steps": args.steps, "reps": args.reps,
         "cache_bytes": cache_bytes, "same_tokens": same,
         "arms": {arm: {"tokens_per_s": B * args.steps / statistics.median(t), "median_s": statistics.median(t),
                        "spread": (max(t) - min(t)) / statistics.median(t)} for arm, t in times.items()},
         "speedup_absorbed_vs_plain": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
  if args.json:
    print(json.dumps(out))
  else:
    for arm, a in out["arms"].items():
      print(f"{arm:9s} {a['tokens_per_s']:9.1f} tokens/s  median {a['median_s']:.3f} s per {args.steps} steps  "
            f"spread {100 * a['spread']:.0f}%")
    s = out["speedup_absorbed_vs_plain"]
    print(f"absorbed / plain speed: {s['median']:.2f}x (per rep {s['min']:.2f}-{s['max']:.2f}), cache "
          f"{cache_bytes / 2**20:.1f} MiB, same tokens: {same}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
