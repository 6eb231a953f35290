"""Group-limited sigmoid routing (DeepSeek-V3, nn/moe/routing.py group_route) against the softmax top-k route, on the
backend at hand, forward + backward.

  .venv/bin/python benchmarks/group_routing.py [--tokens 4096] [--dim 256] [--out 128] [--experts 64:8:4:6 256:8:4:8]
                                               [--reps 7] [--timer cpu|wall]

Per --experts E:n_group:topk_group:k, two pairs of arms on the same tokens:
- route: grad(sum(c * weights)) w.r.t. the router logits [tokens, E]: softmax -> top-k -> renormalize
  (moe.route) against sigmoid -> group-limited top-k of s + bias -> weights from s, scaled
  (moe.group_route);
- layer: the whole MoE layer (moe.moe_mlp, dropless; forward + backward w.r.t. x and every kernel) with
  scoring softmax against sigmoid (the group rule, a random bias).
Arms run interleaved in rounds (meshlm.bench.harness.time_interleaved: one compile + warm-up call
each, then every arm once per round, order rotated); the table gives the median (process CPU seconds
by default), the spread (max - min over reps, relative to the median) and the ratio to the softmax
arm of the same pair, all from one run. Prints a markdown table.
"""
import argparse
import functools
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.bench.harness import TIMERS, time_interleaved
from meshlm.nn import moe
from meshlm.nn.dense import dense


def arms(tokens, dim, out, E, G, KG, k):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 1, (1, tokens, E)), jnp.float32)
  bias = jnp.asarray(rng.normal(0, 0.05, E), jnp.float32)
  c = jnp.asarray(rng.normal(0, 1, (1, tokens, k)), jnp.float32)
  route = jax.jit(jax.grad(lambda lg: jnp.sum(c * moe.route(lg, k, True)[1])))
  group = jax.jit(jax.grad(lambda lg: jnp.sum(c * moe.group_route(lg, bias, k, n_group=G, topk_group=KG,
                                                                  norm_topk=True, scaling=2.5)[1])))
  p = {"router": jnp.asarray(rng.normal(0, dim ** -0.5, (dim, E)), jnp.float32),
       "gate": jnp.asarray(rng.normal(0, dim ** -0.5, (E, dim, out)), jnp.float32),
       "up": jnp.asarray(rng.normal(0, dim ** -0.5, (E, dim, out)), jnp.float32),
       "down": jnp.asarray(rng.normal(0, out ** -0.5, (E, out, dim)), jnp.float32)}
  x = jnp.asarray(rng.normal(0, 1, (1, tokens, dim)), jnp.float32)
  cy = jnp.asarray(rng.normal(0, 1, (1, tokens, dim)), jnp.float32)
  ctx = type("Ctx", (), {"dense": staticmethod(functools.partial(dense, kernel_order=True))})

  def layer(router_bias=None, **kw):
    s = moe.MoESettings(num_experts=E, k=k, norm_topk=True, **kw)
    return jax.jit(jax.grad(lambda p, x: jnp.sum(cy * moe.moe_mlp(p, x, ctx, s, router_bias=router_bias)[0]),
                            argnums=(0, 1)))
  sig = dict(scoring="sigmoid", router_bias=bias, n_group=G, topk_group=KG, routed_scaling=2.5)
  return ({"route softmax": (route, (logits,)), "route group_sigmoid": (group, (logits,))},
          {"layer softmax": (layer(), (p, x)), "layer group_sigmoid": (layer(**sig), (p, x))})


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--out", type=int, default=128)
  ap.add_argument("--experts", nargs="+", default=["64:8:4:6", "256:8:4:8"])
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--timer", choices=sorted(TIMERS), default="cpu")
  a = ap.parse_args()
  print(f"Command: `python benchmarks/group_routing.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"{a.tokens} tokens, D={a.dim}, F={a.out}, {a.reps} reps, {a.timer} seconds, forward + backward\n")
  print("| E, n_group, topk_group, k | arm | median (s) | spread | vs softmax |")
  print("| --- | --- | --- | --- | --- |")
  for spec in a.experts:
    E, G, KG, k = (int(v) for v in spec.split(":"))
    for pair in arms(a.tokens, a.dim, a.out, E, G, KG, k):
      times = time_interleaved(pair, a.reps, a.timer)
      base = statistics.median(next(iter(times.values())))
      for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {E}, {G}, {KG}, {k} | {name} | {med:.4f} | {(max(ts) - min(ts)) / med:.0%} | {med / base:.3f} |",
              flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
