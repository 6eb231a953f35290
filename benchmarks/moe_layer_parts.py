"""Where the fine-grained MoE layer's time goes beyond the dense layer's: the expert loop's passes against
dense matmuls of the same FLOPs, and the page faults of each layer's fresh buffers.

  .venv/bin/python benchmarks/moe_layer_parts.py [--tokens 4096] [--dim 512] [--width 256] [--experts 512:10]
                                                 [--reps 7]

Two tables, CPU time (user + system), arms interleaved in rounds (meshlm.bench.harness.time_interleaved):
1. The grouped matmul alone (nn/moe.grouped_matmul, the expert loop) on A = tokens x k rows sorted by expert
   (a uniform random assignment), against one dense matmul [A, D] x [D, F'] of the same FLOPs: gate|up (two
   kernels, F' = 2 F) and down (F' = D), each as the forward, the gradient w.r.t. the rows only (dx) and
   w.r.t. the kernels only (dW). The dense dW writes one [D, F'] kernel; the loop's writes E of them.
2. The whole layers of benchmarks/moe_vs_dense.py (forward + backward): user and system seconds per call and
   minor page faults per call (resource.getrusage). Every call allocates its outputs and temporaries anew;
   each page of a large fresh buffer faults on its first write, and the fault and the kernel's zeroing of the
   page are system time. Run it under GLIBC_TUNABLES to see an allocator that keeps its pages (e.g.
   `glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:glibc.malloc.arena_max=1`).
"""
import argparse
import os
import resource
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_vs_dense  # noqa: E402
from meshlm.bench.harness import time_interleaved  # noqa: E402
from meshlm.bench.stats import table_cells  # noqa: E402
from meshlm.nn import moe  # noqa: E402


def matmul_arms(tokens: int, dim: int, width: int, experts: int, k: int) -> dict:
  """{(projection, pass): {"loop": (fn, args), "dense": (fn, args)}}."""
  rng = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  A = tokens * k
  sizes = jnp.asarray(np.bincount(rng.integers(0, experts, A), minlength=experts), jnp.int32)
  out = {}
  for proj, (d_in, kernels, d_out) in {"gate_up": (dim, 2, width), "down": (width, 1, dim)}.items():
    x, ws = f32(A, d_in), tuple(f32(experts, d_in, d_out) for _ in range(kernels))
    w_dense, ct = f32(d_in, kernels * d_out), f32(A, kernels * d_out)
    # The group sizes are an argument, as in the layer (a constant would be folded into the compiled loop).
    loop = lambda x, ws, sizes: moe.grouped_matmul(x, ws, sizes)  # noqa: E731
    dense = lambda x, w, _: x @ w  # noqa: E731
    for name, argnums in (("forward", None), ("dx", 0), ("dW", 1)):
      pair = {}
      for arm, f, args in (("loop", loop, (x, ws, sizes)), ("dense", dense, (x, w_dense, sizes))):
        fn = f if argnums is None else jax.grad(lambda a, b, s, f=f: jnp.sum(ct * f(a, b, s)), argnums=argnums)
        pair[arm] = (jax.jit(fn), args)
      out[proj, name] = pair
  return out


def rusage_per_call(arms: dict, reps: int) -> dict:
  """{arm: (user s, system s, minor faults)} per call, medians over rounds (arms visited in turn)."""
  for fn, args in arms.values():
    jax.block_until_ready(fn(*args))
  got = {name: [] for name in arms}
  for _ in range(reps):
    for name, (fn, args) in arms.items():
      r0 = resource.getrusage(resource.RUSAGE_SELF)
      jax.block_until_ready(fn(*args))
      r1 = resource.getrusage(resource.RUSAGE_SELF)
      got[name].append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))
  return {name: tuple(statistics.median(v[i] for v in vals) for i in range(3)) for name, vals in got.items()}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--experts", default="512:10", help="E:k")
  ap.add_argument("--reps", type=int, default=7)
  a = ap.parse_args()
  e, k = map(int, a.experts.split(":"))
  print(f"Command: `python benchmarks/moe_layer_parts.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__}, {os.cpu_count()} cores, {a.tokens} tokens, D={a.dim}, expert width {a.width}, "
        f"{e} experts top-{k}, float32, {a.reps} rounds, CPU time; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}\n")
  print("| projection | pass | expert loop (ms) | spread | dense, same FLOPs (ms) | spread | loop / dense [95%] |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for (proj, name), pair in matmul_arms(a.tokens, a.dim, a.width, e, k).items():
    ts = time_interleaved(pair, a.reps, "cpu")
    dense = table_cells(ts["dense"], ts["dense"], scale=1e3, median_fmt=".1f")
    loop = table_cells(ts["dense"], ts["loop"], scale=1e3, median_fmt=".1f")
    print(f"| {proj} | {name} | {loop[0]} | {loop[1]} | {dense[0]} | {dense[1]} | {loop[2]} {loop[3]} |", flush=True)
  print("\n| layer (forward + backward) | user (s) | system (s) | minor faults per call |")
  print("| --- | --- | --- | --- |")
  arms = moe_vs_dense.layer_arms(a.tokens, a.dim, a.width, e, k, {})
  for name, (user, system, faults) in rusage_per_call(arms, a.reps).items():
    label = f"dense GLU, width {k * a.width}" if name == "dense" else "moe (loop)"
    print(f"| {label} | {user:.3f} | {system:.3f} | {faults:,.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
