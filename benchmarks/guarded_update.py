"""The guarded optimizer update (train/step.py guarded_update) against the plain update, and against the
select-per-leaf guard it replaced: AdamW over six [8, 256, 512] float32 leaves (6.3M parameters, the size of
issue 19's expert kernels), params and optimizer state donated as the train step donates them.

  .venv/bin/python benchmarks/guarded_update.py [--reps 30]

Arms run interleaved, each on its own donated state; prints each arm's median wall time, its spread and its
ratio to the plain update (the median of the per-round ratios, with its 95% interval, meshlm.bench.stats),
and how many copies of a [8, 256, 512] leaf the compiled update holds.
"""
import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from meshlm.bench.stats import table_cells  # noqa: E402
from meshlm.train.step import guarded_update  # noqa: E402

SHAPE = (8, 256, 512)


def select_guard(opt, p, s, loss, g):
  """The guard before 2026-12-01: the update always computed, then a select per leaf."""
  u, ns = opt.update(g, s, p)
  new = optax.apply_updates(p, u)
  finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(g))
  keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
  return jax.tree.map(keep, new, p), jax.tree.map(keep, ns, s)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=30)
  a = ap.parse_args()
  opt = optax.adamw(1e-3)
  params = {f"w{i}": jnp.ones(SHAPE, jnp.float32) for i in range(6)}
  grads = jax.tree.map(lambda x: x * 0.01, params)
  loss = jnp.float32(1.0)
  arms = {
      "plain": lambda p, s, g, loss: _plain(opt, p, s, g),
      "guarded (lax.cond)": lambda p, s, g, loss: guarded_update(opt, p, s, loss, g)[:2],
      "select per leaf": lambda p, s, g, loss: select_guard(opt, p, s, loss, g),
  }
  fns = {n: jax.jit(f, donate_argnums=(0, 1)) for n, f in arms.items()}
  state = {n: (jax.tree.map(jnp.copy, params), opt.init(params)) for n in fns}
  copies = {}
  for n, f in fns.items():
    text = f.lower(*state[n], grads, loss).compile().as_text()
    copies[n] = sum(1 for line in text.splitlines() if " copy(" in line and f"f32[{','.join(map(str, SHAPE))}]" in line)
  times = {n: [] for n in fns}
  for r in range(a.reps + 3):
    for n, f in fns.items():
      t = time.perf_counter()
      state[n] = f(*state[n], grads, loss)
      jax.block_until_ready(state[n])
      if r >= 3:  # the first rounds warm up
        times[n].append(time.perf_counter() - t)
  print(f"Command: `python benchmarks/guarded_update.py --reps {a.reps}`; JAX {jax.__version__}, {os.cpu_count()} cores, "
        f"6 x {SHAPE} float32, AdamW, donated; wall time.\n")
  print("| arm | median (ms) | spread | vs plain | 95% interval | leaf copies |")
  print("| --- | --- | --- | --- | --- | --- |")
  for n, ts in times.items():
    print("| " + " | ".join([n, *table_cells(times["plain"], ts, 1e3, ".2f", digits=2), str(copies[n])]) + " |")
  return 0


def _plain(opt, p, s, g):
  u, ns = opt.update(g, s, p)
  return optax.apply_updates(p, u), ns


if __name__ == "__main__":
  raise SystemExit(main())
