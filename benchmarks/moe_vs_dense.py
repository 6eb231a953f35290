"""One MoE layer against the dense GLU layer of the same active FLOPs, forward + backward.

  .venv/bin/python benchmarks/moe_vs_dense.py [--tokens 4096] [--dim 512] [--width 256] [--experts 128:8 512:10]
                                             [--reps 9] [--timer cpu|wall] [--arm NAME=key:value,...]

Per (experts E, top-k), every arm computes grad(sum(c * layer(x))) w.r.t. x and every kernel, x [1, tokens, dim]:
- dense: nn/mlp.glu_mlp of width k * width (the FLOPs of the k experts each token visits);
- moe: nn/moe.moe_mlp, dropless, as configured by default (a random router: about tokens * k / E rows per
  expert, Poisson-spread);
- --arm NAME=kw:value,...: moe_mlp with keyword overrides (e.g. --arm b32=block_rows:32), for sweeps;
- --floor adds "dense + kernel pass": the dense arm, then one pass that reads every expert kernel and writes a
  fresh array of its size (jnp.multiply by a scalar), the weight-gradient bytes any MoE backward must write. Its
  ratio to dense is the floor this machine's memory puts under MoE / dense, before any expert matmul is slower.
Arms run interleaved in rounds after one compile and warm-up call each (meshlm.bench.harness.time_interleaved);
the table gives each arm's median, its spread (max - min over the rounds, relative to the median) and its ratio
to the dense arm: the median of the per-round ratios with its 95% interval (meshlm.bench.stats.paired, as
`meshlm bench` reports it). Prints a markdown table.
"""
import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.bench.harness import TIMERS, time_interleaved
from meshlm.bench.stats import table_cells
from meshlm.nn import moe
from meshlm.nn.mlp import glu_mlp


def _value(v: str):
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(v, v)


def parse_arm(spec: str) -> tuple[str, dict]:
  name, _, body = spec.partition("=")
  kw = dict(kv.split(":", 1) for kv in body.split(",") if kv)
  return name, {k: _value(v) for k, v in kw.items()}


def layer_arms(tokens: int, dim: int, width: int, experts: int, k: int, extra: dict[str, dict], floor: bool = False):
  rng = np.random.default_rng(0)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  x = f32(rng.standard_normal((1, tokens, dim)))
  c = f32(rng.standard_normal(x.shape))
  p = {"router": f32(rng.standard_normal((dim, experts)) / np.sqrt(dim)),
       "gate": f32(rng.standard_normal((experts, dim, width)) / np.sqrt(dim)),
       "up": f32(rng.standard_normal((experts, dim, width)) / np.sqrt(dim)),
       "down": f32(rng.standard_normal((experts, width, dim)) / np.sqrt(width))}
  W = k * width
  d = {"gate": f32(rng.standard_normal((dim, W)) / np.sqrt(dim)), "up": f32(rng.standard_normal((dim, W)) / np.sqrt(dim)),
       "down": f32(rng.standard_normal((W, dim)) / np.sqrt(W))}
  dense = jax.grad(lambda d, x: jnp.sum(c * glu_mlp(d, x)), argnums=(0, 1))
  out = {"dense": (jax.jit(dense), (d, x))}
  if floor:
    kernels = {n: p[n] for n in ("gate", "up", "down")}
    pass_ = lambda d, x, ks, s: (dense(d, x), jax.tree.map(lambda w: w * s, ks))  # noqa: E731
    out["dense + kernel pass"] = (jax.jit(pass_), (d, x, kernels, jnp.float32(1.5)))
  for name, kw in {"moe": {}, **extra}.items():
    f = lambda p, x, kw=kw: jnp.sum(c * moe.moe_mlp(p, x, num_experts=experts, k=k, norm_topk=True, **kw)[0])  # noqa: E731
    out[name] = (jax.jit(jax.grad(f, argnums=(0, 1))), (p, x))
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--experts", nargs="+", default=["128:8", "512:10"], help="E:k pairs")
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--timer", choices=list(TIMERS), default="cpu")
  ap.add_argument("--arm", action="append", default=[], help="NAME=kw:value,...: moe_mlp with these keywords")
  ap.add_argument("--floor", action="store_true", help="add the dense arm plus one pass over the expert kernels")
  a = ap.parse_args()
  extra = dict(parse_arm(s) for s in a.arm)
  print(f"Command: `python benchmarks/moe_vs_dense.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; forward + "
        f"backward, {a.tokens} tokens, D={a.dim}, expert width {a.width}, float32; {a.reps} rounds, arms interleaved, "
        f"{a.timer} time.\n")
  print("| experts, k | arm | median (s) | spread | vs dense | 95% interval |")
  print("| --- | --- | --- | --- | --- | --- |")
  for ek in a.experts:
    e, k = map(int, ek.split(":"))
    times = time_interleaved(layer_arms(a.tokens, a.dim, a.width, e, k, extra, a.floor), a.reps, a.timer)
    for name, ts in times.items():
      label = f"dense GLU, width {k * a.width}" if name == "dense" else name
      print("| " + " | ".join([f"{e}, {k}", label, *table_cells(times["dense"], ts)]) + " |", flush=True)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
