"""Causal attention over a sequence sharded on mesh.context, forward + backward, on C fake CPU devices:
context_attention=ring (nn/ring_attention.py) against gather (nn/flash_attention.py left to XLA's partitioner, which
all-gathers what the blocks read), per C and T. What the default of `context_attention` rests on.

  .venv/bin/python benchmarks/ring_attention.py [--C 2 4] [--T 4096 16384] [--heads 8:2] [--dim 128] [--reps 5]
      [--block 512] [--timer cpu|wall]

Each arm computes grad(sum(ct * attention(q, k, v))) w.r.t. q, k and v (B = 1, N query heads over K kv heads, head
dim --dim, float32, one document, causal), its inputs and output sharded over `context`. Per (C, T): each arm's
per-device peak temporaries (compiled.memory_analysis()'s temp_size_in_bytes, the SPMD program is per device) and
its time per call (process CPU seconds by default: the C fake devices share this machine's cores, so this is the
work of all C devices together, not a step time), the arms interleaved in rounds after one compile and warm-up
each; ring/gather: the temporaries' ratio and the median per-round time ratio with its 95% interval, one run.
"""
import argparse
import os
import platform
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--C", type=int, nargs="+", default=[2, 4])
  p.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
  p.add_argument("--heads", default="8:2", help="N:K, query heads over kv heads")
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--block", type=int, default=512)
  p.add_argument("--timer", choices=("cpu", "wall"), default="cpu")
  a = p.parse_args(argv)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(a.C)}"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  from meshlm.bench.harness import time_interleaved
  from meshlm.bench.stats import table_cells
  from meshlm.nn.flash_attention import flash_attention
  from meshlm.nn.ring_attention import ring_attention

  N, K = map(int, a.heads.split(":"))
  print(f"# ring_attention: B=1, heads {N}:{K} x {a.dim}, float32, causal, fwd+bwd, block {a.block}, {a.reps} rounds, "
        f"timer {a.timer}; jax {jax.__version__} on {platform.machine()} ({os.cpu_count()} cores)", flush=True)
  print("| C | T | gather temp | ring temp | temp ring/gather | gather s | spread | ring s | spread | time ring/gather "
        "| 95% CI |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  gib = lambda b: f"{b / (1 << 30):.2f} GiB" if b >= 1 << 30 else f"{b / (1 << 20):.1f} MiB"  # noqa: E731
  for C in a.C:
    mesh = jax.make_mesh((C,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:C])
    seq = NamedSharding(mesh, P(None, None, "context"))  # heads-first rows [B, heads, T, h]: T over context
    for T in a.T:
      r = np.random.default_rng(0)
      f = lambda *s: jax.device_put(jnp.asarray(r.standard_normal(s), jnp.float32), seq)  # noqa: E731
      args = (f(1, N, T, a.dim), f(1, K, T, a.dim), f(1, K, T, a.dim), f(1, N, T, a.dim))

      def step(core):
        def g(q, k, v, ct):
          out, vjp = jax.vjp(lambda q, k, v: core(q, k, v, scale=a.dim ** -0.5, block=a.block), q, k, v)
          return vjp(ct)
        return jax.jit(g, out_shardings=(seq, seq, seq))
      with jax.set_mesh(mesh):
        fns = {"gather": step(flash_attention), "ring": step(ring_attention)}
        temp = {name: fn.lower(*args).compile().memory_analysis().temp_size_in_bytes for name, fn in fns.items()}
        times = time_interleaved({name: (fn, args) for name, fn in fns.items()}, a.reps, timer=a.timer)
      g = table_cells(times["gather"], times["gather"], median_fmt=".3f")
      x = table_cells(times["gather"], times["ring"], median_fmt=".3f")
      print(f"| {C} | {T} | {gib(temp['gather'])} | {gib(temp['ring'])} | {temp['ring'] / temp['gather']:.3f} | {g[0]} "
            f"| {g[1]} | {x[0]} | {x[1]} | {x[2]} | {x[3]} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
