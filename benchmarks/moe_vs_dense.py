"""One MoE layer against the dense GLU layer of the same active FLOPs, forward + backward: the MoE layer's
benchmark (variants of the layer, another commit's layer, where its time goes).

  .venv/bin/python benchmarks/moe_vs_dense.py [--tokens 4096] [--dim 512] [--width 256] [--experts 128:8 512:10]
                                             [--reps 9] [--timer cpu|wall] [--arm NAME=key:value,...]
                                             [--base NAME] [--floor] [--ref REV]
  .venv/bin/python benchmarks/moe_vs_dense.py --parts [--experts 512:10] [--reps 7]

Per (experts E, top-k), every arm computes grad(sum(c * layer(x))) w.r.t. x and every kernel, x [1, tokens, dim]:
- dense: nn/mlp.glu_mlp of width k * width (the FLOPs of the k experts each token visits);
- moe: nn/moe/layer.py moe_mlp, dropless, as configured by default (a random router: about tokens * k / E rows per
  expert, Poisson-spread);
- --arm NAME=kw:value,...: moe_mlp with keyword overrides, e.g. `reference=impl:reference` (the every-expert
  reference), `blocks=grouped_matmul:blocks`, `ragged=grouped_matmul:ragged`, `split=fused_gate_up:false`,
  `argsort=unsort_impl:argsort`, `nobarrier=grad_barrier:false`, `b32=block_rows:32`;
- --floor adds "dense + kernel pass": the dense arm, then one pass that reads every expert kernel and writes a
  fresh array of its size (jnp.multiply by a scalar), the weight-gradient bytes any MoE backward must write. Its
  ratio to dense is the floor this machine's memory puts under MoE / dense, before any expert matmul is slower;
- --ref REV adds "moe @ REV": the same layer from another commit's nn/moe (`git show REV:src/meshlm/nn/moe.py`, or
  the package nn/moe/, loaded as its own module; it imports the rest of meshlm from this tree, so REV must share those interfaces),
  and prints the largest difference of any gradient between it and "moe" (0.0: bit-identical). Issue 19's layer:
  `--tokens 512 --dim 256 --width 512 --experts 8:2 --reps 21 --timer wall`.
Arms run interleaved in rounds after one compile and warm-up call each (meshlm.bench.harness.time_interleaved);
the table gives each arm's median, its spread (max - min over the rounds, relative to the median) and its ratio
to the --base arm (default dense): the median of the per-round ratios with its 95% interval
(meshlm.bench.stats.paired, as `meshlm bench` reports it). Prints a markdown table.

--parts: where the layer's time goes beyond the dense layer's, CPU time (user + system), two tables:
1. The grouped matmul alone (nn/moe/gmm.py grouped_matmul) on A = tokens x k rows sorted by expert (a uniform random
   assignment), against one dense matmul [A, D] x [D, F'] of the same FLOPs: gate|up (two kernels, F' = 2 F) and
   down (F' = D), each as the forward, the gradient w.r.t. the rows only (dx) and w.r.t. the kernels only (dW).
   The dense dW writes one [D, F'] kernel; the loop's writes E of them.
2. The whole dense and moe layers: user and system seconds and minor page faults per call (resource.getrusage).
   Each page of a large fresh buffer faults on its first write; the fault and the kernel's zeroing of the page
   are system time. Run it under GLIBC_TUNABLES to see an allocator that keeps its pages (e.g.
   `glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:glibc.malloc.arena_max=1`).
"""
import argparse
import dataclasses
import importlib.util
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.bench.harness import TIMERS, time_interleaved
from meshlm.bench.stats import table_cells
from meshlm.nn import moe
from meshlm.nn.mlp import glu_mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def load_ref(rev: str):
  """nn/moe as of commit rev, as its own module: the file nn/moe.py, or the package nn/moe/ (its files' imports
  of each other pointed at the copy)."""
  git = lambda *a: subprocess.run(["git", "-C", ROOT, *a], check=True, capture_output=True, text=True).stdout  # noqa: E731
  name = "moe_ref_" + "".join(c if c.isalnum() else "_" for c in rev)
  root = tempfile.mkdtemp(prefix="moe_ref_")
  if git("ls-tree", rev, "src/meshlm/nn/moe").split()[1:2] != ["tree"]:
    path = os.path.join(root, f"{name}.py")
    with open(path, "w") as f:
      f.write(git("show", f"{rev}:src/meshlm/nn/moe.py"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
  os.makedirs(os.path.join(root, name))
  for fn in git("ls-tree", "--name-only", f"{rev}:src/meshlm/nn/moe/").split():
    with open(os.path.join(root, name, fn), "w") as f:
      f.write(git("show", f"{rev}:src/meshlm/nn/moe/{fn}").replace("meshlm.nn.moe.", f"{name}."))
  sys.path.insert(0, root)
  return importlib.import_module(name)


def moe_layer(mod, p, x, *, k: int, norm_topk: bool, **kw):
  """mod's moe_mlp (nn/moe as of some commit): with the part's section and Options where it takes them (issue 60),
  with MoESettings where it has them (their top-k fields named as the part's knobs since issue 53, k and norm_topk
  before), else keywords."""
  if hasattr(mod, "Options"):
    from meshlm.models.ffns.moe import MoEConfig
    knobs = {n: v for n, v in kw.items() if n in MoEConfig.model_fields}
    section = MoEConfig(num_experts_per_tok=k, norm_topk_prob=norm_topk, mlp_dim=p["down"].shape[1],
                        kernel_fsdp="embed", **knobs)
    return mod.moe_mlp(p, x, None, section, mod.Options(**{n: v for n, v in kw.items() if n not in knobs}))
  if hasattr(mod, "MoESettings"):
    knob_names = "num_experts_per_tok" in {f.name for f in dataclasses.fields(mod.MoESettings)}
    top = dict(num_experts_per_tok=k, norm_topk_prob=norm_topk) if knob_names else dict(k=k, norm_topk=norm_topk)
    return mod.moe_mlp(p, x, None, mod.MoESettings(**top, **kw))
  return mod.moe_mlp(p, x, k=k, norm_topk=norm_topk, **kw)


def layer_arms(tokens: int, dim: int, width: int, experts: int, k: int, extra: dict[str, dict], floor: bool = False,
               modules: dict | None = None):
  """{arm: (jitted grad fn, args)}: dense, [dense + kernel pass], moe, the --arm variants and, per
  modules {name: a module with moe_mlp}, that module's layer."""
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
  layers = {"moe": (moe, {}), **{name: (moe, kw) for name, kw in extra.items()},
            **{name: (mod, {}) for name, mod in (modules or {}).items()}}
  for name, (mod, kw) in layers.items():
    f = lambda p, x, mod=mod, kw=kw: jnp.sum(c * moe_layer(mod, p, x, num_experts=experts, k=k, norm_topk=True,  # noqa: E731
                                                           **kw)[0])
    out[name] = (jax.jit(jax.grad(f, argnums=(0, 1))), (p, x))
  return out


def largest_grad_diff(a, b) -> tuple[float, float]:
  """(max |a - b| over every gradient leaf, max |b|): two arms of layer_arms, each (fn, args)."""
  ga, gb = (jax.block_until_ready(fn(*args)) for fn, args in (a, b))
  diff = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)))
  return diff, max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(gb))


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
        fn = f if argnums is None else jax.grad(lambda a, b, s, f=f, ct=ct: jnp.sum(ct * f(a, b, s)), argnums=argnums)
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


def parts(a, e: int, k: int) -> None:
  print(f"{e} experts top-{k}; CPU time; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}\n")
  print("| projection | pass | expert loop (ms) | spread | dense, same FLOPs (ms) | spread | loop / dense [95%] |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for (proj, name), pair in matmul_arms(a.tokens, a.dim, a.width, e, k).items():
    ts = time_interleaved(pair, a.reps, "cpu")
    dense = table_cells(ts["dense"], ts["dense"], scale=1e3, median_fmt=".1f")
    loop = table_cells(ts["dense"], ts["loop"], scale=1e3, median_fmt=".1f")
    print(f"| {proj} | {name} | {loop[0]} | {loop[1]} | {dense[0]} | {dense[1]} | {loop[2]} {loop[3]} |", flush=True)
  print("\n| layer (forward + backward) | user (s) | system (s) | minor faults per call |")
  print("| --- | --- | --- | --- |")
  arms = layer_arms(a.tokens, a.dim, a.width, e, k, {})
  for name, (user, system, faults) in rusage_per_call(arms, a.reps).items():
    label = f"dense GLU, width {k * a.width}" if name == "dense" else "moe (loop)"
    print(f"| {label} | {user:.3f} | {system:.3f} | {faults:,.0f} |")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--experts", nargs="+", default=["128:8", "512:10"], help="E:k pairs")
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--timer", choices=list(TIMERS), default="cpu")
  ap.add_argument("--arm", action="append", default=[], help="NAME=kw:value,...: moe_mlp with these keywords")
  ap.add_argument("--base", default="dense", help="the arm every ratio is against")
  ap.add_argument("--floor", action="store_true", help="add the dense arm plus one pass over the expert kernels")
  ap.add_argument("--ref", help="add the layer of this commit's nn/moe")
  ap.add_argument("--parts", action="store_true", help="the expert loop's passes against dense matmuls, page faults")
  a = ap.parse_args()
  extra = dict(parse_arm(s) for s in a.arm)
  modules = {f"moe @ {a.ref}": load_ref(a.ref)} if a.ref else {}
  print(f"Command: `python benchmarks/moe_vs_dense.py {' '.join(sys.argv[1:])}`  ")
  print(f"JAX {jax.__version__} on {jax.default_backend()}, {platform.machine()}, {os.cpu_count()} cores; forward + "
        f"backward, {a.tokens} tokens, D={a.dim}, expert width {a.width}, float32; {a.reps} rounds, arms interleaved, "
        f"{'cpu' if a.parts else a.timer} time.\n")
  if a.parts:
    for ek in a.experts:
      parts(a, *map(int, ek.split(":")))
    return 0
  print(f"| experts, k | arm | median (s) | spread | vs {a.base} | 95% interval |")
  print("| --- | --- | --- | --- | --- | --- |")
  for ek in a.experts:
    e, k = map(int, ek.split(":"))
    arms = layer_arms(a.tokens, a.dim, a.width, e, k, extra, a.floor, modules)
    if a.base not in arms:
      print(f"--base {a.base}: not an arm ({', '.join(arms)})", file=sys.stderr)
      return 2
    diffs = {name: largest_grad_diff(arms[name], arms["moe"]) for name in modules}
    times = time_interleaved(arms, a.reps, a.timer)
    for name, ts in times.items():
      label = f"dense GLU, width {k * a.width}" if name == "dense" else name
      print("| " + " | ".join([f"{e}, {k}", label, *table_cells(times[a.base], ts)]) + " |", flush=True)
    for name, (diff, scale) in diffs.items():
      print(f"\n{e}, {k}: largest gradient difference between {name} and moe: {diff:.3g} "
            f"(largest |gradient|: {scale:.3g})")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
