"""Router replay's routing, forward + backward: the compact top-k against the full top-k (nn/router_replay.py).

  .venv/bin/python benchmarks/router_replay.py [--tokens 16384] [--experts 64:8 128:8] [--free 200 4096] [--reps 7]

Per (experts, k) and number of unforced tokens ("free"), every arm computes grad(sum(c * w)) w.r.t. the
router logits [tokens, E] for the routing weights w of replay_route (the rest of the tokens forced to
random distinct experts):
- full: impl="full", top-k over every token (the plain path);
- compact: impl="compact", top-k over at most R = 256 gathered tokens, lax.cond fallback to the full
  top-k when more are free (so free > R measures the fallback's overhead);
- unforced: moe.route, the plain top-k routing with nothing forced (what training without replay runs).
Arms run interleaved (order rotated per round) after one compile + warm-up call each; the table gives
the median process CPU time (or --timer wall), the spread (max - min over reps, relative to the median)
and the ratio to full, from one run. Prints a markdown table.
"""
import argparse
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.bench.harness import TIMERS, time_interleaved
from meshlm.nn import moe
from meshlm.nn import router_replay as rr


def arms(tokens: int, experts: int, k: int, free: int, rows: int):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((1, tokens, experts)), jnp.float32)
  forced = np.argsort(rng.random((tokens, experts)), axis=-1)[:, :k].astype(np.int32)  # distinct per token
  forced[rng.choice(tokens, free, replace=False)] = -1
  forced = jnp.asarray(forced[None])
  c = jnp.asarray(rng.standard_normal((1, tokens, k)), jnp.float32)

  def fwd_bwd(route):
    # The forced ids are an argument, not a closed-over constant that XLA would fold.
    return jax.jit(jax.grad(lambda lg, f: jnp.sum(c * route(lg, f))))

  return {
      "full": (fwd_bwd(lambda lg, f: rr.replay_route(lg, f, k, True, impl="full")[1]), (logits, forced)),
      "compact": (fwd_bwd(lambda lg, f: rr.replay_route(lg, f, k, True, rows=rows)[1]), (logits, forced)),
      "unforced": (fwd_bwd(lambda lg, f: moe.route(lg, k, True)[1]), (logits, forced)),
  }


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--experts", nargs="+", default=["64:8", "128:8"], help="E:k pairs")
  ap.add_argument("--free", type=int, nargs="+", default=[200, 4096], help="unforced tokens per case")
  ap.add_argument("--rows", type=int, default=rr.REPLAY_ROWS, help="R of the compact top-k")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--timer", choices=list(TIMERS), default="cpu")
  a = ap.parse_args()
  print(f"Command: `python benchmarks/router_replay.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"{a.tokens} tokens, R = {a.rows}; {a.reps} reps per arm, arms interleaved, {a.timer} time.\n")
  print("| E:k | free tokens | arm | median (ms) | spread | vs full |")
  print("| --- | --- | --- | --- | --- | --- |")
  for ek in a.experts:
    e, k = (int(v) for v in ek.split(":"))
    for free in a.free:
      times = time_interleaved(arms(a.tokens, e, k, free, a.rows), a.reps, a.timer)
      base = statistics.median(times["full"])
      for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {ek} | {free} | {name} | {1e3 * med:.2f} | {(max(ts) - min(ts)) / med:.0%} | {med / base:.3f} |",
              flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
