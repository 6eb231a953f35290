"""Grouped matmul on the backend at hand, forward + backward: the candidates for nn/moe.py.

  .venv/bin/python benchmarks/moe_grouped_matmul.py [--rows 4096] [--dim 256] [--out 512] [--groups 8 64] [--reps 5]
  .venv/bin/python benchmarks/moe_grouped_matmul.py --layer [--tokens 1024] [--dim 256] [--out 256] [--experts 8:2 64:8 128:8]

Per group count, every arm computes grad(sum(c * gmm(x, w))) w.r.t. x and w for the same rows
(x [rows, dim] sorted by group, w [groups, dim, out], group sizes from uniform random routing):
- ragged_dot: jax.lax.ragged_dot (autodiff backward);
- blocks-b: nn/moe.py's block scan, b rows per block, custom backward;
- capacity-einsum: an [groups, rows/groups, dim] einsum of equal capacity, i.e. perfectly balanced
  groups, no dispatch at all: a lower bound, not a dropless method.
Arms run interleaved in rounds (each arm once per round, order rotated) after one compile+warm-up
call each; the table gives the median time (process CPU seconds by default, --timer wall for
elapsed), the spread (max - min over reps, relative to the median) and the ratio to ragged_dot, all
from one run. Prints a markdown table.

--layer times the whole MoE layer (nn/moe.moe_mlp, forward + backward w.r.t. x and every kernel) per
(experts, k): the every-expert reference, dropless as configured by default, and dropless with each
speedup switched back to its plain version (split gate/up matmuls; argsort unsort), plus ragged_dot
as the grouped matmul where --ragged-up-to allows (its CPU cost grows with the experts).
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


def layer_arms(tokens, dim, out, experts, k, ragged):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, tokens, dim)), jnp.float32)
  p = {"router": rng.standard_normal((dim, experts)) / np.sqrt(dim),
       "gate": rng.standard_normal((experts, dim, out)) / np.sqrt(dim),
       "up": rng.standard_normal((experts, dim, out)) / np.sqrt(dim),
       "down": rng.standard_normal((experts, out, dim)) / np.sqrt(out)}
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
  c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  variants = {"reference": dict(impl="reference"), "dropless": {},
              "dropless, split gate/up": dict(fused_gate_up=False),
              "dropless, argsort unsort": dict(unsort_impl="argsort"),
              "dropless, no grad barrier": dict(grad_barrier=False)}
  if ragged:
    variants["dropless, ragged_dot"] = dict(grouped_matmul="ragged")
  arms_ = {}
  for name, kw in variants.items():
    f = lambda p, x, kw=kw: jnp.sum(c * moe.moe_mlp(p, x, num_experts=experts, k=k, norm_topk=True, **kw)[0])
    arms_[name] = (jax.jit(jax.grad(f, argnums=(0, 1))), (p, x))
  return arms_


def layer_main(a) -> int:
  print(f"Command: `python benchmarks/moe_grouped_matmul.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; MoE layer "
        f"forward+backward, {a.tokens} tokens, D={a.dim}, F={a.out}, float32; {a.reps} reps per arm, arms interleaved, {a.timer} time.\n")
  print("| experts, k | arm | median (s) | spread | tokens/s | vs reference |")
  print("| --- | --- | --- | --- | --- | --- |")
  for ek in a.experts:
    e, k = map(int, ek.split(":"))
    times = time_interleaved(layer_arms(a.tokens, a.dim, a.out, e, k, e <= a.ragged_up_to), a.reps, a.timer)
    base = statistics.median(times["reference"])
    for name, ts in times.items():
      med = statistics.median(ts)
      print(f"| {e}, {k} | {name} | {med:.4f} | {(max(ts) - min(ts)) / med:.0%} | {a.tokens / med:,.0f} | "
            f"{base / med:.2f}x |", flush=True)
  return 0




def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--out", type=int, default=512)
  ap.add_argument("--groups", type=int, nargs="+", default=[8, 64])
  ap.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--timer", choices=list(TIMERS), default="cpu",
                  help="cpu: process CPU seconds (all threads; time spent waiting for a core another process "
                       "holds is not counted, so a shared machine's load does not inflate it); wall: elapsed")
  ap.add_argument("--layer", action="store_true", help="time the whole MoE layer instead")
  ap.add_argument("--tokens", type=int, default=1024)
  ap.add_argument("--experts", nargs="+", default=["8:2", "64:8", "128:8"], help="E:k pairs for --layer")
  ap.add_argument("--ragged-up-to", type=int, default=8, help="--layer: a ragged_dot arm up to this many experts")
  a = ap.parse_args()
  if a.layer:
    if "--out" not in sys.argv:
      a.out = 256
    return layer_main(a)
  print(f"Command: `python benchmarks/moe_grouped_matmul.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"forward+backward at {a.rows}x{a.dim}x{a.out}; {a.reps} reps per arm, arms interleaved, {a.timer} time.\n")
  print("| groups | arm | median (s) | spread | vs ragged_dot |")
  print("| --- | --- | --- | --- | --- |")
  for g in a.groups:
    times = time_interleaved(arms(a.rows, a.dim, a.out, g, a.blocks), a.reps, a.timer)
    base = statistics.median(times["ragged_dot"])
    for name, ts in times.items():
      med = statistics.median(ts)
      print(f"| {g} | {name} | {med:.4f} | {(max(ts) - min(ts)) / med:.0%} | {med / base:.3f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
