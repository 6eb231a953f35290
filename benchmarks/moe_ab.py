"""One MoE layer from this tree against the same layer from another commit's nn/moe.py, interleaved in one
process, forward + backward, with the dense GLU of the same active FLOPs beside them.

  .venv/bin/python benchmarks/moe_ab.py --ref REV [--tokens 512 --dim 256 --width 512 --experts 8:2]
                                         [--reps 21] [--timer wall|cpu]

The other commit's nn/moe.py is read with `git show REV:src/meshlm/nn/moe.py` and loaded as its own module
(it imports the rest of meshlm from this tree, so REV must share those interfaces). Both layers take the same
inputs (benchmarks/moe_vs_dense.layer_arms: a random router, float32); the script prints each arm's median,
its ratio to the dense arm with the 95% interval (meshlm.bench.stats.paired), and the largest difference of
any gradient between the two MoE arms (0.0: bit-identical). How docs/performance.md measured each change of
issue 19's second pass.
"""
import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_vs_dense  # noqa: E402
from meshlm.bench.harness import TIMERS, time_interleaved  # noqa: E402
from meshlm.bench.stats import table_cells  # noqa: E402
from meshlm.nn import moe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_ref(rev: str):
  src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:src/meshlm/nn/moe.py"], check=True, capture_output=True,
                       text=True).stdout
  path = os.path.join(tempfile.mkdtemp(prefix="moe_ab_"), "moe_ref.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("moe_ref", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ref", required=True)
  ap.add_argument("--tokens", type=int, default=512)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--experts", default="8:2", help="E:k")
  ap.add_argument("--reps", type=int, default=21)
  ap.add_argument("--timer", choices=list(TIMERS), default="wall")
  a = ap.parse_args()
  E, k = map(int, a.experts.split(":"))
  arms = moe_vs_dense.layer_arms(a.tokens, a.dim, a.width, E, k, {})
  _, (p, x) = arms["moe"]
  c = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
  out = {"dense": arms["dense"]}
  for name, mod in ((f"moe @ {a.ref}", load_ref(a.ref)), ("moe (this tree)", moe)):
    f = lambda p, x, mod=mod: jnp.sum(c * mod.moe_mlp(p, x, num_experts=E, k=k, norm_topk=True)[0])  # noqa: E731
    out[name] = (jax.jit(jax.grad(f, argnums=(0, 1))), (p, x))
  grads = [jax.block_until_ready(fn(*args)) for name, (fn, args) in out.items() if name != "dense"]
  diff = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])))
  scale = max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(grads[1]))
  times = time_interleaved(out, a.reps, a.timer)
  print(f"Command: `python benchmarks/moe_ab.py {' '.join(sys.argv[1:])}`; {a.tokens} tokens, D={a.dim}, expert width "
        f"{a.width}, {E} experts top-{k}, float32; {a.reps} rounds, {a.timer} time.\n")
  print("| arm | median (ms) | spread | vs dense | 95% interval |")
  print("| --- | --- | --- | --- | --- |")
  for name, ts in times.items():
    print("| " + " | ".join([name, *table_cells(times["dense"], ts, 1e3, ".2f")]) + " |")
  print(f"\nlargest gradient difference between the two MoE arms: {diff:.3g} (largest |gradient|: {scale:.3g})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
