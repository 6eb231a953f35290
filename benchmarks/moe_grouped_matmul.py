"""Grouped matmul on the backend at hand, forward + backward: the candidates for nn/moe.py.

  .venv/bin/python benchmarks/moe_grouped_matmul.py [--rows 4096] [--dim 256] [--out 512] [--groups 8 64] [--reps 5]

Per group count, every arm computes grad(sum(c * gmm(x, w))) w.r.t. x and w for the same rows
(x [rows, dim] sorted by group, w [groups, dim, out], group sizes from uniform random routing):
- ragged_dot: jax.lax.ragged_dot (autodiff backward);
- blocks-b: nn/moe.py's block scan, b rows per block, custom backward;
- capacity-einsum: an [groups, rows/groups, dim] einsum of equal capacity, i.e. perfectly balanced
  groups, no dispatch at all: a lower bound, not a dropless method.
Arms run interleaved in rounds (each arm once per round, order rotated) after one compile+warm-up
call each; the table gives the median wall time, the spread (max - min over reps, relative to the
median) and the ratio to ragged_dot, all from one run. Prints a markdown table.
"""
import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.nn import moe


def arms(rows, dim, out, groups, blocks):
  rng = np.random.default_rng(0)
  assign = np.sort(rng.integers(0, groups, rows))
  sizes = jnp.asarray(np.bincount(assign, minlength=groups), jnp.int32)
  x = jax.random.normal(jax.random.key(1), (rows, dim), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (groups, dim, out), jnp.float32) / np.sqrt(dim)
  c = jax.random.normal(jax.random.key(3), (rows, out), jnp.float32)

  def fwd_bwd(gmm):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(c * gmm(x, w)), argnums=(0, 1)))

  out_arms = {"ragged_dot": (fwd_bwd(lambda x, w: jax.lax.ragged_dot(x, w, sizes)), (x, w))}
  for b in blocks:
    out_arms[f"blocks-{b}"] = (fwd_bwd(lambda x, w, b=b: moe.grouped_matmul(x, w, sizes, impl="blocks", block_rows=b)),
                               (x, w))
  cap = rows // groups
  xc = x[:cap * groups].reshape(groups, cap, dim)
  cc = c[:cap * groups].reshape(groups, cap, out)
  out_arms["capacity-einsum"] = (jax.jit(jax.grad(lambda x, w: jnp.sum(cc * jnp.einsum("gcd,gdf->gcf", x, w)),
                                                  argnums=(0, 1))), (xc, w))
  return out_arms


def measure(fns, reps):
  times = {name: [] for name in fns}
  for name, (fn, args) in fns.items():
    jax.block_until_ready(fn(*args))  # compile + warm
  names = list(fns)
  for r in range(reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      fn, args = fns[name]
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t)
  return times


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--out", type=int, default=512)
  ap.add_argument("--groups", type=int, nargs="+", default=[8, 64])
  ap.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
  ap.add_argument("--reps", type=int, default=5)
  a = ap.parse_args()
  print(f"Command: `python benchmarks/moe_grouped_matmul.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"forward+backward at {a.rows}x{a.dim}x{a.out}; {a.reps} reps per arm, arms interleaved.\n")
  print("| groups | arm | median (s) | spread | vs ragged_dot |")
  print("| --- | --- | --- | --- | --- |")
  for g in a.groups:
    times = measure(arms(a.rows, a.dim, a.out, g, a.blocks), a.reps)
    base = statistics.median(times["ragged_dot"])
    for name, ts in times.items():
      med = statistics.median(ts)
      print(f"| {g} | {name} | {med:.4f} | {(max(ts) - min(ts)) / med:.0%} | {med / base:.3f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
