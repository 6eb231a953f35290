"""The gated delta rule alone, pure JAX (gdn_impl=jax) against the Pallas kernels (gdn_impl=pallas): the time of
each phase on whatever backend JAX finds (a TPU: the Mosaic kernels; elsewhere interpret mode, which only checks
that each arm runs), and each arm's outputs and gradients against jax64's (else the first arm's) on the same inputs.

  python benchmarks/gdn_tpu.py --out gdn.jsonl [--cases b2-s2048,b4-s2048] [--arms jax64,pallas64] [--deadline 600]
  python benchmarks/gdn_tpu.py --cases b4-s2048 --arms pallas64,pallas64-refine,pallas128,pallas128-refine --reps 3
  python benchmarks/gdn_tpu.py --cases tiny --reps 2          # on a CPU: every arm runs (interpret mode)

A case is the hybrid's GDN layer at qwen3-0.6b widths (benchmarks/chip.py GDN_06B: K = N = 16 heads, H = J = 128,
seq 2048) at a batch, with the inputs as the mixer passes them: q and k float32 (L2-normalized, q scaled), v
bfloat16, g and beta float32, and two packed documents a row (segment ids). An arm is an implementation and its
chunk: jax64 (nn/gdn.gated_delta_rule_chunked, chunk 64: the default), jax128, pallas64 (nn/gdn_pallas, chunk 64,
8 value heads a grid step, inverse=split: the defaults), pallas128, pallas64-refine and pallas128-refine (the
inverse's doubling in one bf16 pass and a Newton step: model.parts.gdn.inverse=refine), pallas64-h4 and pallas64-h16
(4 and 16 heads a step). The phases: PHASES. Each (case, arm, phase): one compile, a warm-up call, then the median of --reps calls
(each to block_until_ready) and their spread (max - min over the median). One JSON line per result, appended to --out
as soon as it is done; then, per case, a "check" line per arm: the largest |arm - against| over max |against| of o,
the final state and each gradient (bf16 products in the kernel, float32 at HIGHEST in the JAX rule), and a markdown
table at the end. No new result starts after --deadline seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  batch: int
  seq: int
  key_heads: int
  value_heads: int
  key_dim: int
  value_dim: int


CASES = [Case("b2-s2048", 2, 2048, 16, 16, 128, 128), Case("b4-s2048", 4, 2048, 16, 16, 128, 128),
         Case("tiny", 1, 96, 1, 2, 16, 16)]
# arm: (impl, chunk, value heads per grid step of the kernel: gated_delta_rule_pallas's heads_per_step, the kernel's
# inverse: model.parts.gdn.inverse)
ARMS = {"jax64": ("jax", 64, None, None), "jax128": ("jax", 128, None, None), "pallas64": ("pallas", 64, 8, "split"),
        "pallas128": ("pallas", 128, 8, "split"), "pallas64-refine": ("pallas", 64, 8, "refine"),
        "pallas128-refine": ("pallas", 128, 8, "refine"), "pallas64-h4": ("pallas", 64, 4, "split"),
        "pallas64-h16": ("pallas", 64, 16, "split")}
# forward: o and the final state alone (a rematerialized layer's forward); forward+residuals: the forward of jax.vjp,
# its residuals returned (the Pallas forward writes the entering states and Tm); forward+backward: jax.vjp and its
# backward; remat: the same under jax.checkpoint (the training step's cost of a layer under remat=full: a forward,
# then the backward's recompute and the backward).
PHASES = ("forward", "forward+residuals", "forward+backward", "remat")
NAMES = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta")


def inputs(c: Case):
  """(q, k, v, g, beta, segment ids), (do, dS): as models/mixers/gdn.core passes them (bf16 compute)."""
  import jax
  import jax.numpy as jnp
  from meshlm.nn.gdn import l2_normalize
  B, T, K, N, H, J = c.batch, c.seq, c.key_heads, c.value_heads, c.key_dim, c.value_dim
  key = jax.random.split(jax.random.key(0), 8)
  q = l2_normalize(jax.random.normal(key[0], (B, T, K, H))) * H ** -0.5
  k = l2_normalize(jax.random.normal(key[1], (B, T, K, H)))
  v = jax.random.normal(key[2], (B, T, N, J), jnp.bfloat16)
  g = -jnp.exp(jnp.zeros((N,))) * jax.nn.softplus(jax.random.normal(key[3], (B, T, N)) + 1.0)
  beta = jax.nn.sigmoid(jax.random.normal(key[4], (B, T, N)))
  seg = jnp.where(jnp.arange(T)[None] < (T * 3) // 5, 1, 2) * jnp.ones((B, 1), jnp.int32)
  do = jax.random.normal(key[5], (B, T, N, J), jnp.bfloat16)
  dS = jax.random.normal(key[6], (B, N, H, J), jnp.float32)
  return (q, k, v, g, beta, seg), (do, dS)


def rule(impl: str, chunk: int, heads: int | None, inverse: str | None):
  from meshlm.nn import gdn, gdn_pallas
  if impl == "jax":
    return functools.partial(gdn.gated_delta_rule_chunked, chunk_size=chunk)
  return functools.partial(gdn_pallas.gated_delta_rule_pallas, chunk_size=chunk, heads_per_step=heads,
                           inverse=inverse)


def programs(impl: str, chunk: int, heads: int | None, inverse: str | None) -> dict:
  """phase -> jit program of (q, k, v, g, beta, seg) (forward, forward+residuals) or (..., do, dS) (the others)."""
  import jax
  fn = rule(impl, chunk, heads, inverse)

  def fwd(q, k, v, g, beta, seg):
    return fn(q, k, v, g, beta, segment_ids_BT=seg)

  def fwd_res(q, k, v, g, beta, seg):
    return jax.vjp(lambda *a: fn(*a, segment_ids_BT=seg), q, k, v, g, beta)  # the vjp a pytree of the residuals

  def fwd_bwd(q, k, v, g, beta, seg, do, dS, remat=False):
    f = lambda *a: fn(*a, segment_ids_BT=seg)  # noqa: E731
    out, vjp = jax.vjp(jax.checkpoint(f) if remat else f, q, k, v, g, beta)
    return out, vjp((do, dS))
  return {"forward": jax.jit(fwd), "forward+residuals": jax.jit(fwd_res), "forward+backward": jax.jit(fwd_bwd),
          "remat": jax.jit(functools.partial(fwd_bwd, remat=True))}


def timed(fn, args, reps: int) -> tuple[float, float, float, object]:
  """(compile s, median call s, spread, the last output)."""
  import jax
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  return compile_s, med, (max(times) - min(times)) / med, out


def flat(out) -> list:
  (o, S), grads = out
  return [o, S, *grads]


def rel_err(a, b) -> float:
  import numpy as np
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run(cases, arms, reps: int, deadline: float, out_path: str | None, phases=PHASES, log=print) -> list[dict]:
  import jax
  t_end = time.perf_counter() + deadline
  records = []
  out = open(out_path, "a") if out_path else None

  def emit(rec):
    records.append(rec)
    line = json.dumps(rec)
    log(line)
    if out:
      out.write(line + "\n")
      out.flush()
  d = jax.devices()[0]
  emit({"kind": "backend", "platform": d.platform, "device_kind": d.device_kind, "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d")})
  for c in cases:
    args, cots = inputs(c)
    results = {}  # arm -> fwd+bwd output, for the check
    for arm in arms:
      impl, chunk, heads, inverse = ARMS[arm]
      progs = programs(impl, chunk, heads, inverse)
      for phase in phases:
        fn, a = progs[phase], (args if phase in ("forward", "forward+residuals") else (*args, *cots))
        if time.perf_counter() > t_end:
          break
        rec = {"kind": phase, "case": c.name, **dataclasses.asdict(c), "arm": arm, "impl": impl, "chunk": chunk,
               "heads_per_step": heads, "inverse": inverse}
        try:
          rec["compile_s"], rec["s"], rec["spread"], result = timed(fn, a, reps)
          if phase == "forward+backward":
            results[arm] = [jax.device_get(x) for x in flat(result)]
        except Exception as e:  # noqa: BLE001  (an arm that does not compile is a result)
          rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        emit(rec)
    # Each arm's outputs and gradients against jax64's (chunk 64, float32 at HIGHEST), else the first arm's.
    against = "jax64" if "jax64" in results else next(iter(results), None)
    for arm in results:
      if arm != against:
        errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, results[arm], results[against])}
        emit({"kind": "check", "case": c.name, "against": against, "arm": arm, "max_rel_err": errs})
  if out:
    out.close()
  return records


def table(records: list[dict]) -> str:
  lines = []
  for name in dict.fromkeys(r["case"] for r in records if "case" in r):
    rs = [r for r in records if r.get("case") == name and r["kind"] != "check"]
    lines += ["", f"**{name}**", "", "| arm | " + " | ".join(f"{p} ms (spread)" for p in PHASES) + " |",
              "| --- |" + " --- |" * len(PHASES)]
    for arm in dict.fromkeys(r["arm"] for r in rs):
      cells = []
      for phase in PHASES:
        r = next((r for r in rs if r["arm"] == arm and r["kind"] == phase), None)
        cells.append("-" if r is None else f"failed: {r['error'][:80]}" if "error" in r
                     else f"{r['s'] * 1e3:.2f} ({r['spread']:.1%})")
      lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    for r in records:
      if r.get("case") == name and r["kind"] == "check":
        worst = max(r["max_rel_err"].items(), key=lambda kv: kv[1])
        lines.append(f"\n{r['arm']} against {r['against']}: largest relative error {worst[1]:.2g} ({worst[0]})")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--cases", default="b2-s2048,b4-s2048",
                  help=f"comma-separated, of: {', '.join(c.name for c in CASES)}")
  ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
  ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of: {', '.join(PHASES)}")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--deadline", type=float, default=1e9, help="seconds; no new result starts after it")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  names, arms = args.cases.split(","), args.arms.split(",")
  phases = args.phases.split(",")
  unknown = [n for n in names if n not in {c.name for c in CASES}] + [a for a in arms if a not in ARMS]
  unknown += [p for p in phases if p not in PHASES]
  if unknown:
    print(f"--cases/--arms/--phases: no {unknown[0]!r}", file=sys.stderr)
    return 2
  cases = [next(c for c in CASES if c.name == n) for n in names]
  records = run(cases, arms, args.reps, args.deadline, args.out, phases)
  print(table(records))
  return 0


if __name__ == "__main__":
  sys.exit(main())
