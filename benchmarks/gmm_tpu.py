"""The MoE grouped matmul alone on a TPU: XLA's ragged dot against JAX's megablox grouped matmul
(`jax.experimental.pallas.ops.tpu.megablox.gmm`) at its tilings, and meshlm's own megablox path (nn/moe/gmm.py
grouped_matmul(impl="megablox"): its custom backward, the tiles its auto rule picks for each call, arm "meshlm"),
forward and forward+backward, beside a dense matmul of the same FLOPs.

  python benchmarks/gmm_tpu.py --out gmm.jsonl [--case moe12-gate-up,moe12-down] [--arms meshlm,ragged] [--deadline 120]

A case is one MoE layer's expert matmuls on one chip: A = tokens x top-k sorted rows of width D against E kernels
[D, F] (the fused gate|up is F = 2 x the expert width; the down kernel [F', D] is its own case). Group sizes are the
even split, and a skewed split (half the rows to one expert). Each setting: one compile, a warm-up call, then the
median of --reps calls. One JSON line per setting as soon as it is done; a markdown table at the end. Off TPU the
megablox arms run in interpret mode (slow; use tiny --rows to check the script).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# name: (rows A, D, F, E)
CASES = {
    "moe12-gate-up": (8 * 2048 * 2, 1024, 2 * 1536, 8),  # chip.py's MOE_12 at batch 8: 32,768 rows
    "moe12-down": (8 * 2048 * 2, 1536, 1024, 8),
    # deepseek-v3-small (its preset: 16 experts top-4 of 512 wide) at batch 8, seq 2048: 65,536 rows
    "dsv3-small-gate-up": (8 * 2048 * 4, 1024, 2 * 512, 16),
    "dsv3-small-down": (8 * 2048 * 4, 512, 1024, 16),
}
TILINGS = [(128, 128, 128), (512, 512, 512), (512, 1024, 1024), (1024, 1024, 1024), (512, 1024, 512),
           (1024, 512, 1024), (2048, 1024, 512), (256, 1024, 1024)]


def timed(fn, args, reps):
  import jax
  t0 = time.perf_counter()
  c = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(c(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(c(*args))
    ts.append(time.perf_counter() - t0)
  med = statistics.median(ts)
  return compile_s, med, (max(ts) - min(ts)) / med


def run(names, reps, deadline, out_path, rows_override=None, log=print, only=None):
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.tpu import megablox

  from meshlm.nn.moe import gmm as meshlm_gmm
  interpret = jax.devices()[0].platform != "tpu"
  t_end = time.perf_counter() + deadline
  out = open(out_path, "a") if out_path else None
  records = []

  def emit(rec):
    records.append(rec)
    log(json.dumps(rec))
    if out:
      out.write(json.dumps(rec) + "\n")
      out.flush()

  for name in names:
    A, D, F, E = CASES[name]
    A = rows_override or A
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (A, D), jnp.bfloat16)
    w = jax.random.normal(k[1], (E, D, F), jnp.bfloat16) * 0.02
    dy = jax.random.normal(k[2], (A, F), jnp.bfloat16)
    even = jnp.full((E,), A // E, jnp.int32).at[-1].add(A - E * (A // E))
    skew = jnp.concatenate([jnp.array([A // 2], jnp.int32), jnp.full((E - 1,), (A - A // 2) // (E - 1), jnp.int32)])
    skew = skew.at[-1].add(A - int(skew.sum()))
    flops = 2 * A * D * F

    def arms():
      yield "dense", None, lambda x, w, s: x @ w[0]
      yield "ragged", None, lambda x, w, s: jax.lax.ragged_dot(x, w, s)
      # What the MoE layer runs (grouped_matmul=megablox, megablox_tiling null): its forward's tiles recorded.
      yield "meshlm", list(meshlm_gmm.megablox_tiling(A, D, F)), lambda x, w, s: meshlm_gmm.grouped_matmul(
          x, w, s, impl="megablox")
      for t in TILINGS:
        tt = (min(t[0], A), min(t[1], D), min(t[2], F))
        yield "megablox", list(tt), (lambda tt: lambda x, w, s: megablox.gmm(
            x, w, s, preferred_element_type=jnp.bfloat16, tiling=tt, interpret=interpret))(tt)

    for split_name, sizes in (("even", even), ("skew", skew)):
      for arm, tiling, f in arms():
        if time.perf_counter() > t_end:
          break
        if only and arm not in only:
          continue
        if arm == "dense" and split_name == "skew":
          continue
        rec = {"case": name, "rows": A, "D": D, "F": F, "E": E, "split": split_name, "arm": arm, "tiling": tiling}
        try:
          rec["compile_s"], rec["fwd_s"], rec["fwd_spread"] = timed(f, (x, w, sizes), reps)

          def fb(x, w, s, dy, f=f):
            y, vjp = jax.vjp(lambda x, w: f(x, w, s), x, w)
            return y, vjp(dy)
          _, rec["fwd_bwd_s"], rec["fwd_bwd_spread"] = timed(fb, (x, w, sizes, dy), reps)
          rec["fwd_tflops_per_s"] = flops / rec["fwd_s"] / 1e12
          rec["fwd_bwd_tflops_per_s"] = 3 * flops / rec["fwd_bwd_s"] / 1e12
        except Exception as e:  # noqa: BLE001
          rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        emit(rec)
  if out:
    out.close()
  return records


def table(records):
  lines = ["| case | split | arm | tiling | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in records:
    if "error" in r:
      lines.append(f"| {r['case']} | {r['split']} | {r['arm']} | {r['tiling']} | failed: {r['error'][:80]} | | | |")
    else:
      lines.append(f"| {r['case']} | {r['split']} | {r['arm']} | {r['tiling']} | {r['fwd_s'] * 1e3:.2f} | "
                   f"{r['fwd_tflops_per_s']:.1f} | {r['fwd_bwd_s'] * 1e3:.2f} | {r['fwd_bwd_tflops_per_s']:.1f} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--deadline", type=float, default=1e9)
  ap.add_argument("--rows", type=int, default=None, help="override the rows (tiny checks off TPU)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--arms", default=None, help="comma-separated: only these arms (dense, ragged, meshlm, megablox)")
  a = ap.parse_args(argv)
  names = a.case.split(",")
  if any(n not in CASES for n in names):
    print(f"--case: no case {next(n for n in names if n not in CASES)!r}", file=sys.stderr)
    return 2
  print(table(run(names, a.reps, a.deadline, a.out, a.rows, only=a.arms.split(",") if a.arms else None)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
