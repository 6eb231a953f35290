"""The splash attention kernel alone, per block setting: forward and forward+backward time on whatever backend JAX
finds (a TPU: the Mosaic kernel; elsewhere interpret mode, which only checks that each setting runs).

  python benchmarks/splash_blocks.py --out splash.jsonl [--cases h128-s2048,h256-s8192] [--deadline 300]

A case is one family's attention shapes on one chip (query heads N, KV heads K, q/k and v head dims, sequence, batch
rows, a window), with segment ids as the train step passes them. For each case the script times the forward of a grid
of (block_q, block_kv, block_kv_compute), then forward + backward of a grid of backward settings (split: the dkv
blocks and the dq blocks; fused: the dkv blocks) with the forward fixed at the case's fastest forward. Each setting:
one compile, a warm-up call, then the median of --reps calls (each to block_until_ready) and their spread. A setting
that does not compile (the scoped VMEM) is a result: its error is recorded and the next one runs. One JSON line per
setting, appended to --out as soon as it is done; a markdown table per case at the end.

The causal FLOPs of one call: 4 B N T^2 (h + hv) / 2 forward (q k^T and p v, half of them masked), 2.5x that for the
backward (the recomputed scores, dv, dp, dq, dk); the report gives TFLOP/s against them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  heads: int
  kv_heads: int
  head_dim: int
  v_head_dim: int
  seq: int
  batch: int
  window: int | None = None


CASES = [
    Case("h64-s2048", 32, 8, 64, 64, 2048, 8),  # a llama-3.2-1b-like layer
    Case("h128-s2048", 16, 8, 128, 128, 2048, 8),  # qwen3-0.6b
    Case("h128-s8192", 16, 8, 128, 128, 8192, 2),
    Case("mla-s2048", 8, 8, 192, 128, 2048, 8),  # deepseek-v3-small (MLA: G = 1, q/k 192, v 128)
    Case("h256-s2048", 8, 4, 256, 256, 2048, 4),  # gemma3-4b / gemma2-2b
    Case("h256-s4096", 8, 4, 256, 256, 4096, 2),
    Case("h256-s8192", 8, 4, 256, 256, 8192, 1),
    Case("h256-s4096-w1024", 8, 4, 256, 256, 4096, 2, window=1024),  # gemma3's local layers
]

FORWARDS = [(512, 512, 512), (1024, 512, 512), (1024, 1024, 512), (1024, 1024, 1024), (2048, 512, 512),
            (2048, 1024, 512), (2048, 1024, 1024), (512, 1024, 512), (512, 2048, 512)]
# (kind, (q_dkv, kv_dkv, kv_dkv_compute), (q_dq, kv_dq) or None)
BACKWARDS = [("split", (512, 512, 512), (512, 512)), ("split", (1024, 1024, 512), (1024, 1024)),
             ("split", (1024, 1024, 1024), (1024, 1024)), ("split", (512, 1024, 512), (1024, 512)),
             ("split", (1024, 512, 512), (512, 1024)), ("split", (2048, 1024, 512), (1024, 1024)),
             ("fused", (512, 512, 512), None), ("fused", (1024, 512, 512), None), ("fused", (1024, 1024, 512), None),
             ("fused", (1024, 1024, 1024), None), ("fused", (512, 1024, 512), None)]


def flops(c: Case) -> float:
  """Causal forward FLOPs of one call (no window discount)."""
  return 4 * c.batch * c.heads * c.seq * c.seq * (c.head_dim + c.v_head_dim) / 2 / 2


def build(c: Case, fwd, bwd_kind, dkv, dq, interpret: bool):
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.tpu import splash_attention as SA
  bq, bkv, bkvc = (min(b, c.seq) for b in fwd)
  dkv = tuple(min(b, c.seq) for b in dkv)
  dq = None if dq is None else tuple(min(b, c.seq) for b in dq)
  sizes = SA.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=dkv[0], block_kv_dkv=dkv[1],
                        block_kv_dkv_compute=dkv[2], block_q_dq=None if dq is None else dq[0],
                        block_kv_dq=None if dq is None else dq[1], use_fused_bwd_kernel=bwd_kind == "fused")
  one = (SA.CausalMask((c.seq, c.seq)) if c.window is None
         else SA.LocalMask((c.seq, c.seq), window_size=(c.window - 1, 0), offset=0))
  kernel = SA.make_splash_mha(SA.MultiHeadMask([one] * c.heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)

  def attend(q, k, v, seg):
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, SA.SegmentIds(s, s)))(q, k, v, seg)

  key = jax.random.split(jax.random.key(0), 4)
  dt = jnp.bfloat16
  q = jax.random.normal(key[0], (c.batch, c.heads, c.seq, c.head_dim), dt)
  k = jax.random.normal(key[1], (c.batch, c.kv_heads, c.seq, c.head_dim), dt)
  v = jax.random.normal(key[2], (c.batch, c.kv_heads, c.seq, c.v_head_dim), dt)
  seg = jnp.ones((c.batch, c.seq), jnp.int32)
  ct = jax.random.normal(key[3], (c.batch, c.heads, c.seq, c.v_head_dim), dt)
  fwd_fn = jax.jit(attend)

  def fwd_bwd(q, k, v, seg, ct):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
    return out, vjp(ct)
  return fwd_fn, jax.jit(fwd_bwd), (q, k, v, seg, ct)


def timed(fn, args, reps: int) -> tuple[float, float, float]:
  """(compile s, median call s, spread)."""
  import jax
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  return compile_s, med, (max(times) - min(times)) / med


def run(cases, reps: int, deadline: float, out_path: str | None, log=print) -> list[dict]:
  import jax
  interpret = jax.devices()[0].platform != "tpu"
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
  emit({"kind": "backend", "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")})
  for c in cases:
    best = None
    for fwd in FORWARDS:
      if time.perf_counter() > t_end:
        break
      rec = {"kind": "forward", "case": c.name, **dataclasses.asdict(c), "fwd": list(fwd)}
      try:
        f, _, args = build(c, fwd, "split", (512, 512, 512), (512, 512), interpret)
        rec["compile_s"], rec["s"], rec["spread"] = timed(f, args[:4], reps)
        rec["tflops_per_s"] = flops(c) / rec["s"] / 1e12
        if best is None or rec["s"] < best[1]:
          best = (fwd, rec["s"])
      except Exception as e:  # noqa: BLE001  (a setting that does not compile is a result)
        rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
      emit(rec)
    if best is None:
      continue
    for kind, dkv, dq in BACKWARDS:
      if time.perf_counter() > t_end:
        break
      rec = {"kind": "backward", "case": c.name, **dataclasses.asdict(c), "fwd": list(best[0]), "bwd": kind,
             "dkv": list(dkv), "dq": None if dq is None else list(dq)}
      try:
        _, fb, args = build(c, best[0], kind, dkv, dq, interpret)
        rec["compile_s"], rec["s"], rec["spread"] = timed(fb, args, reps)
        rec["bwd_s"] = rec["s"] - best[1]
        rec["bwd_tflops_per_s"] = 2.5 * flops(c) / rec["bwd_s"] / 1e12 if rec["bwd_s"] > 0 else None
      except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
      emit(rec)
  if out:
    out.close()
  return records


def table(records: list[dict]) -> str:
  lines = []
  for name in dict.fromkeys(r["case"] for r in records if "case" in r):
    rs = [r for r in records if r.get("case") == name]
    lines += ["", f"**{name}**", "", "| phase | blocks | ms (spread) | TFLOP/s |", "| --- | --- | --- | --- |"]
    for r in rs:
      blocks = (f"q/kv/kv_compute {r['fwd']}" if r["kind"] == "forward"
                else f"{r['bwd']} dkv {r['dkv']}" + (f" dq {r['dq']}" if r["dq"] else ""))
      if "error" in r:
        lines.append(f"| {r['kind']} | {blocks} | failed: {r['error'][:100]} | |")
      elif r["kind"] == "forward":
        lines.append(f"| forward | {blocks} | {r['s'] * 1e3:.2f} ({r['spread']:.1%}) | {r['tflops_per_s']:.1f} |")
      else:
        tf = r.get("bwd_tflops_per_s")
        lines.append(f"| backward | {blocks} | {r['bwd_s'] * 1e3:.2f} (fwd+bwd {r['s'] * 1e3:.2f}, "
                     f"{r['spread']:.1%}) | {'-' if tf is None else f'{tf:.1f}'} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--cases", default=None, help=f"comma-separated, of: {', '.join(c.name for c in CASES)}")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--deadline", type=float, default=1e9, help="seconds; no new setting starts after it")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  cases = CASES
  if args.cases:
    names = args.cases.split(",")
    unknown = [n for n in names if n not in {c.name for c in CASES}]
    if unknown:
      print(f"--cases: no case {unknown[0]!r}", file=sys.stderr)
      return 2
    cases = [next(c for c in CASES if c.name == n) for n in names]
  records = run(cases, args.reps, args.deadline, args.out)
  print(table(records))
  return 0


if __name__ == "__main__":
  sys.exit(main())
