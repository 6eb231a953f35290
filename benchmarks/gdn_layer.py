"""Gated DeltaNet rule, forward + backward: the chunked form (nn/gdn.py) against the naive recurrence.

  .venv/bin/python benchmarks/gdn_layer.py [--T 512 2048 4096 8192] [--heads 4:2] [--dim 64] [--reps 5]
  .venv/bin/python benchmarks/gdn_layer.py --memory [--T 512 2048 4096 8192 16384]

Each arm computes grad(sum(co * o) + sum(cs * S)) w.r.t. q, k, v, g and beta of one gated delta rule
call (B = 1, N value heads reading K key heads, H = J = --dim, one document, float32, q and k
L2-normalized, g = -A softplus(a - 4) with A ~ U(1, 16) per head, beta = sigmoid(b)). Per T the two arms run interleaved in rounds
(order alternating) after one compile + warm-up call each; the table gives each arm's median (process
CPU seconds by default: on a shared machine, time spent waiting for a core another process holds is not
counted; --timer wall for elapsed), its spread ((max - min) / median) and the naive/chunked ratio, the
median of the per-round ratios, all from one run.

--forward times the forward alone (o and the final state, no gradient).

--memory prints, per T, the compiled memory analysis (jax.jit(f).lower(...).compile().memory_analysis())
of both arms' forward + backward: temp, argument and output bytes, and temp per token, to show it is
linear in T. Nothing runs.
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
from meshlm.nn import gdn



def rule_inputs(T, n, k, h, seed=0):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  q = gdn.l2_normalize(f(1, T, k, h)) * h ** -0.5
  kk = gdn.l2_normalize(f(1, T, k, h))
  v = f(1, T, n, h)
  # g = -A softplus(a - 4), A ~ U(1, 16) per head (qwen3-next draws exp(A_log) from U(0, 16)): decays in (0, 1).
  g = -jnp.asarray(r.uniform(1, 16, (1, 1, n)), jnp.float32) * jax.nn.softplus(f(1, T, n) - 4.0)
  beta = jax.nn.sigmoid(f(1, T, n))
  return (q, kk, v, g, beta), (f(1, T, n, h), f(1, n, h, h))


def fwd_bwd(impl, cots, forward=False, **kw):
  co, cs = cots
  if forward:
    return jax.jit(lambda q, k, v, g, beta: gdn.gated_delta_rule(q, k, v, g, beta, impl=impl, **kw))

  def loss(q, k, v, g, beta):
    o, S = gdn.gated_delta_rule(q, k, v, g, beta, impl=impl, **kw)
    return jnp.sum(co * o) + jnp.sum(cs * S)
  return jax.jit(jax.grad(loss, argnums=range(5)))


def spread(ts):
  return (max(ts) - min(ts)) / statistics.median(ts)


def speed(a) -> None:
  n, k = map(int, a.heads.split(":"))
  print(f"Command: `python benchmarks/gdn_layer.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the start; {'forward' if a.forward else 'forward+backward'} of one rule call, B=1, N={n}, K={k}, H=J={a.dim}, "
        f"chunk {a.chunk}, float32; {a.reps} reps per arm, arms interleaved, {a.timer} time.\n")
  print("| T | chunked (s) | spread | naive (s) | spread | naive / chunked |")
  print("| --- | --- | --- | --- | --- | --- |")
  for T in a.T:
    args, cots = rule_inputs(T, n, k, a.dim)
    fns = {"chunked": fwd_bwd("chunked", cots, a.forward, chunk_size=a.chunk),
           "naive": fwd_bwd("reference", cots, a.forward)}
    times = time_interleaved({name: (fn, args) for name, fn in fns.items()}, a.reps, a.timer)
    c, r = times["chunked"], times["naive"]
    ratio = statistics.median([x / y for x, y in zip(r, c)])
    print(f"| {T} | {statistics.median(c):.4f} | {spread(c):.0%} | {statistics.median(r):.4f} | {spread(r):.0%} | "
          f"{ratio:.1f}x |", flush=True)


def memory(a) -> None:
  n, k = map(int, a.heads.split(":"))
  print(f"Command: `python benchmarks/gdn_layer.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}; compiled memory analysis of forward+backward, B=1, "
        f"N={n}, K={k}, H=J={a.dim}, chunk {a.chunk}, float32.\n")
  print("| T | chunked temp (MiB) | temp per token (KiB) | arguments + outputs (MiB) | naive temp (MiB) | naive temp "
        "per token (KiB) |")
  print("| --- | --- | --- | --- | --- | --- |")
  for T in a.T:
    args, cots = rule_inputs(T, n, k, a.dim)
    row = []
    for impl, kw in (("chunked", dict(chunk_size=a.chunk)), ("reference", {})):
      m = fwd_bwd(impl, cots, **kw).lower(*args).compile().memory_analysis()
      row.append((m.temp_size_in_bytes, m.argument_size_in_bytes + m.output_size_in_bytes))
    (ct, cio), (nt, _) = row
    print(f"| {T} | {ct / 2**20:.1f} | {ct / T / 1024:.1f} | {cio / 2**20:.1f} | {nt / 2**20:.1f} | "
          f"{nt / T / 1024:.1f} |", flush=True)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--T", type=int, nargs="+", default=[512, 2048, 4096, 8192])
  ap.add_argument("--heads", default="4:2", help="N:K, value heads : key heads")
  ap.add_argument("--dim", type=int, default=64, help="H = J, the key and value head dims")
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--timer", choices=list(TIMERS), default="cpu")
  ap.add_argument("--memory", action="store_true", help="the compiled memory analysis instead of times")
  ap.add_argument("--forward", action="store_true", help="time the forward alone (o and the final state)")
  a = ap.parse_args()
  (memory if a.memory else speed)(a)
  return 0


if __name__ == "__main__":
  sys.exit(main())
