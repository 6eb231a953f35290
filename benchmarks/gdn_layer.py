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

--inverse compares the within-chunk triangular inverse (I + A)^-1's variants (nn/gdn.unit_lower_inverse,
gdn.INVERSES; every variant has the same custom backward, two matmuls):

  .venv/bin/python benchmarks/gdn_layer.py --inverse [--chunk 64] [--matrices 256] [--T 4096] [--reps 7]

- right_looking: once row j is final, subtract a[i, j] x_j from every later row (a loop over columns);
- solve_triangular: jax.scipy.linalg.solve_triangular against I;
- blocked: substitution on 16 x 16 diagonal blocks, then the merges [[X1, 0], [-X2 A21 X1, X2]];
- doubling: (I - A)(I + A^2)(I + A^4)...
Timed: the inverse alone on --matrices matrices of the WY shape (forward, and forward + backward of
sum(c * X)), and forward + backward of the whole chunked rule with each variant at the first --T (default
4096 here); arms interleaved, the ratio to right_looking. Errors: max |X - X64| against numpy's float64 inverse
on WY-shaped matrices (tests/test_gdn.py's), and max |X - X64| / max |X64| on adversarial ones (|A|_inf about 44).
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


def inverse(a) -> None:
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
  from test_gdn import inverse64, wy_matrix
  n, k = map(int, a.heads.split(":"))
  W, T = a.chunk, a.T[0]
  am = jnp.asarray(wy_matrix(W, M=a.matrices, seed=1))
  c = jnp.asarray(np.random.default_rng(2).standard_normal(am.shape), jnp.float32)
  args, cots = rule_inputs(T, n, k, a.dim)
  arms = {}
  for v in gdn.INVERSES:
    arms[(v, "alone, forward")] = (jax.jit(lambda a_, v=v: gdn.unit_lower_inverse(a_, v)), (am,))
    arms[(v, "alone, forward+backward")] = (
        jax.jit(jax.grad(lambda a_, v=v: jnp.sum(c * gdn.unit_lower_inverse(a_, v)))), (am,))

    def loss(q, kk, vv, g, beta, v=v):
      o, S = gdn.gated_delta_rule_chunked(q, kk, vv, g, beta, chunk_size=W, inverse=v)
      return jnp.sum(cots[0] * o) + jnp.sum(cots[1] * S)
    arms[(v, "in the rule, forward+backward")] = (jax.jit(jax.grad(loss, argnums=range(5))), args)
  times = time_interleaved(arms, a.reps, a.timer)

  wy = wy_matrix(W, seed=W)
  adv = wy_matrix(W, M=4, seed=11, aligned=8.0)
  want_wy, want_adv = inverse64(wy), inverse64(adv)

  def err(v, x, want, rel):
    got = np.asarray(gdn.unit_lower_inverse(jnp.asarray(x), v), np.float64)
    e = np.max(np.abs(got - want)) / (np.max(np.abs(want)) if rel else 1.0)
    return f"{e:.1e}" if np.isfinite(e) else "non-finite"

  print(f"Command: `python benchmarks/gdn_layer.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the start; chunk {W}; alone: {a.matrices} matrices; in the rule: T={T}, B=1, "
        f"N={n}, K={k}, H=J={a.dim}; float32; {a.reps} reps per arm, arms interleaved, {a.timer} time. |A|_inf of the "
        f"adversarial matrices: {np.max(np.sum(np.abs(adv), -1)):.1f}.\n")
  kinds = ["alone, forward", "alone, forward+backward", "in the rule, forward+backward"]
  print("| variant | " + " | ".join(f"{kd} (ms) | spread | vs right_looking" for kd in kinds)
        + " | max err vs float64 (WY) | rel err (adversarial) |")
  print("| --- " * (2 + 3 * len(kinds) + 1) + "|")
  base = {kd: statistics.median(times[("right_looking", kd)]) for kd in kinds}
  for v in gdn.INVERSES:
    cells = []
    for kd in kinds:
      ts = times[(v, kd)]
      med = statistics.median(ts)
      cells.append(f"{1e3 * med:.2f} | {spread(ts):.0%} | {med / base[kd]:.2f}")
    print(f"| {v} | " + " | ".join(cells) + f" | {err(v, wy, want_wy, False)} | {err(v, adv, want_adv, True)} |",
          flush=True)


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
  ap.add_argument("--inverse", action="store_true", help="the within-chunk inverse's variants instead")
  ap.add_argument("--matrices", type=int, default=256, help="--inverse: matrices for the inverse alone (U * B * N)")
  a = ap.parse_args()
  if a.inverse and "--T" not in sys.argv:
    a.T = [4096]
  if a.inverse and "--reps" not in sys.argv:
    a.reps = 7
  (inverse if a.inverse else memory if a.memory else speed)(a)
  return 0


if __name__ == "__main__":
  sys.exit(main())
