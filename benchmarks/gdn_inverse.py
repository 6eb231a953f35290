"""The within-chunk triangular inverse (I + A)^-1 of the chunked gated delta rule: its four variants side by
side, alone and inside the rule, with their error against float64.

  .venv/bin/python benchmarks/gdn_inverse.py [--chunk 64] [--matrices 256] [--T 4096] [--heads 4:2] [--dim 64] [--reps 7]

Arms (nn/gdn.unit_lower_inverse; every variant has the same custom backward, two matmuls):
- right_looking: once row j is final, subtract a[i, j] x_j from every later row (a loop over columns);
- solve_triangular: jax.scipy.linalg.solve_triangular against I;
- blocked: substitution on 16 x 16 diagonal blocks, then the merges [[X1, 0], [-X2 A21 X1, X2]];
- doubling: (I - A)(I + A^2)(I + A^4)...

Timed: the inverse alone on --matrices matrices of the WY shape (forward, and forward + backward of
sum(c * X)), and forward + backward of the whole chunked rule with each variant at --T (B = 1; the
inputs of benchmarks/gdn_layer.py). Arms interleaved in rounds (order rotated) after one compile +
warm-up call each; median, spread ((max - min) / median) and the ratio to right_looking, one run.
Errors: max |X - X64| on WY-shaped matrices (tests/test_gdn.py's), and max |X - X64| / max |X64| on
the adversarial ones (|A|_inf about 44).
"""
import argparse
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gdn_layer  # noqa: E402
from meshlm.bench.harness import TIMERS, time_interleaved  # noqa: E402
from meshlm.nn import gdn  # noqa: E402
from test_gdn import inverse64, wy_matrix  # noqa: E402



def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--matrices", type=int, default=256, help="matrices for the inverse alone (U * B * N of the rule)")
  ap.add_argument("--T", type=int, default=4096)
  ap.add_argument("--heads", default="4:2")
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--timer", choices=list(TIMERS), default="cpu")
  a = ap.parse_args()
  n, k = map(int, a.heads.split(":"))
  W = a.chunk

  am = jnp.asarray(wy_matrix(W, M=a.matrices, seed=1))
  c = jnp.asarray(np.random.default_rng(2).standard_normal(am.shape), jnp.float32)
  args, cots = gdn_layer.rule_inputs(a.T, n, k, a.dim)
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

  print(f"Command: `python benchmarks/gdn_inverse.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the start; chunk {W}; alone: {a.matrices} matrices; in the rule: T={a.T}, B=1, "
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
      cells.append(f"{1e3 * med:.2f} | {(max(ts) - min(ts)) / med:.0%} | {med / base[kd]:.2f}")
    print(f"| {v} | " + " | ".join(cells) + f" | {err(v, wy, want_wy, False)} | {err(v, adv, want_adv, True)} |",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
