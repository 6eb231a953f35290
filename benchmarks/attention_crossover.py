"""Causal attention on one CPU device, forward + backward: attention_impl=flash (nn/flash_attention.py) against xla
(nn/attention.gqa_attention over the materialized mask), per sequence length T. Where flash starts to win is the
crossover `attention_impl=auto` uses on CPU (nn/attention.CPU_FLASH_FROM).

  .venv/bin/python benchmarks/attention_crossover.py [--T 1024 4096 16384] [--heads 8:2] [--dim 128] [--reps 5]
      [--block 512] [--timer cpu|wall]

Each arm computes grad(sum(ct * attention(q, k, v))) w.r.t. q, k and v (B = 1, N query heads over K kv heads, head
dim --dim, float32, one document, causal). Per T: each arm's peak temporaries (compiled.memory_analysis()'s
temp_size_in_bytes) and its time per call, the arms interleaved in rounds (the order rotating) after one compile
and warm-up call each; the table gives each arm's median (process CPU seconds by default: on a shared machine,
time waiting for a core another process holds is not counted), its spread ((max - min) / median), and flash/xla:
the temporaries' ratio and the median of the per-round time ratios with its 95% interval, all from one run.
"""
import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.bench.harness import time_interleaved
from meshlm.bench.stats import table_cells
from meshlm.nn.attention import attention_mask, gqa_attention
from meshlm.nn.flash_attention import BLOCK, flash_attention


def arms(T: int, block: int):
  def xla(q, k, v):
    return gqa_attention(q, k, v, attention_mask(None, T, None), scale=q.shape[-1] ** -0.5)

  def flash(q, k, v):
    return flash_attention(q, k, v, scale=q.shape[-1] ** -0.5, block=block)

  def step(core):
    def f(q, k, v, ct):
      out, vjp = jax.vjp(core, q, k, v)
      return vjp(ct)
    return jax.jit(f)
  return {"xla": step(xla), "flash": step(flash)}


def inputs(T: int, N: int, K: int, H: int):
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
  return f(1, N, T, H), f(1, K, T, H), f(1, K, T, H), f(1, N, T, H)  # heads-first rows, every core's


def gib(b: int) -> str:
  return f"{b / (1 << 30):.2f} GiB" if b >= 1 << 30 else f"{b / (1 << 20):.1f} MiB"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--heads", default="8:2", help="N:K, query heads over kv heads")
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--block", type=int, default=BLOCK)
  p.add_argument("--timer", choices=("cpu", "wall"), default="cpu")
  a = p.parse_args(argv)
  N, K = map(int, a.heads.split(":"))
  print(f"# attention_crossover: B=1, heads {N}:{K} x {a.dim}, float32, causal, fwd+bwd, block {a.block}, "
        f"{a.reps} rounds, timer {a.timer}; jax {jax.__version__} on {platform.machine()} "
        f"({os.cpu_count()} cores)", flush=True)
  print("| T | xla temp | flash temp | temp flash/xla | xla s | spread | flash s | spread | time flash/xla | 95% CI |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for T in a.T:
    fns = arms(T, a.block)
    args = inputs(T, N, K, a.dim)
    temp = {name: fn.lower(*args).compile().memory_analysis().temp_size_in_bytes for name, fn in fns.items()}
    times = time_interleaved({name: (fn, args) for name, fn in fns.items()}, a.reps, timer=a.timer)
    x = table_cells(times["xla"], times["xla"], median_fmt=".3f")
    f = table_cells(times["xla"], times["flash"], median_fmt=".3f")
    print(f"| {T} | {gib(temp['xla'])} | {gib(temp['flash'])} | {temp['flash'] / temp['xla']:.3f} | {x[0]} | {x[1]} "
          f"| {f[0]} | {f[1]} | {f[2]} | {f[3]} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
