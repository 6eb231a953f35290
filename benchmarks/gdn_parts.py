"""Where a Gated DeltaNet layer's time goes, part by part, on whatever backend JAX finds (issue 60 item 1).

  python benchmarks/gdn_parts.py [--batch 2] [--seq 2048] [--heads 16:16] [--dim 128] [--chunk 64] [--out F.jsonl]

At the GDN hybrid's shape (benchmarks/chip.py GDN_06B: K = N = 16 heads, H = J = 128, seq 2048), each part of the
layer's pure-JAX path is timed alone, forward and forward + backward (the gradient of a fixed random contraction of
its outputs), in the dtypes the mixer runs it with (bf16 projections; float32 inside the rule):

  conv_gates   the causal conv over q|k|v (models/mixers/gdn.core: short_conv.causal_conv), silu, the L2 norms, the
               gates g and beta
  chunk_terms  the per-chunk terms before the state scan (nn/gdn._Chunks: the gate cumsum, A, the (I + A)^-1
               inverse, u and w, the layout copies into [U, B, N, W, X])
  inverse      the within-chunk inverse alone (nn/gdn.unit_lower_inverse, right-looking) on the [U, B, N, W, W] terms
  state_scan   the scan over chunks (nn/gdn._chunk_states)
  outputs      the outputs from the chunk states (_Chunks.outputs) and the transpose back to [B, T, N, J]
  rule         the whole chunked rule (gated_delta_rule_chunked), for the sum's check
  gated_norm   the gated RMS norm (models/mixers/gdn.gated_rms_norm)

Each: one compile, a warm-up call, the median of --reps calls (to block_until_ready) and their spread. One JSON line
per part; a markdown table at the end. The parts overlap nothing: chunk_terms + state_scan + outputs is the rule.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def timed(fn, args, reps):
  import jax
  c = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(c(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(c(*args))
    ts.append(time.perf_counter() - t0)
  med = statistics.median(ts)
  return med, (max(ts) - min(ts)) / med


def parts(B, T, N, K, H, J, W):
  """{name: (fn(*args) -> outputs, args)}: each part's forward on random inputs of the layer's shapes."""
  import jax
  import jax.numpy as jnp
  from meshlm.models.mixers.gdn import gated_rms_norm, l2_normalize_heads
  from meshlm.nn import gdn as rule
  from meshlm.nn.short_conv import causal_conv
  f32, bf16 = jnp.float32, jnp.bfloat16
  ks = iter(jax.random.split(jax.random.key(0), 16))
  C = 2 * K * H + N * J
  qkv = jax.random.normal(next(ks), (B, T, C), bf16)
  conv_w = jax.random.normal(next(ks), (4, C), f32) * 0.3
  b = jax.random.normal(next(ks), (B, T, N), bf16)
  a = jax.random.normal(next(ks), (B, T, N), bf16)
  A_log, dt_bias = jnp.zeros((N,), f32), jnp.ones((N,), f32)

  def conv_gates(qkv, conv_w, b, a):
    mixed = jax.nn.silu(causal_conv(qkv, conv_w.astype(bf16)).astype(f32))
    q = jnp.reshape(l2_normalize_heads(mixed[..., :K * H], K) * H ** -0.5, (B, T, K, H))
    k = jnp.reshape(l2_normalize_heads(mixed[..., K * H:2 * K * H], K), (B, T, K, H))
    v = jnp.reshape(mixed[..., 2 * K * H:], (B, T, N, J)).astype(bf16)
    beta = jax.nn.sigmoid(b.astype(f32))
    g = -jnp.exp(A_log) * jax.nn.softplus(a.astype(f32) + dt_bias)
    return q, k, v, g, beta

  q, k, v, g, beta = jax.jit(conv_gates)(qkv, conv_w, b, a)

  def chunk_terms(q, k, v, g, beta):
    c = rule._Chunks(q, k, v, g, beta, None, W, rule.DEFAULT_INVERSE)
    return c.u_UBNWJ, c.w_UBNWH, c.k_UBNWH, c.decay_UBN

  u, w, kd, dec = jax.jit(chunk_terms)(q, k, v, g, beta)
  U = u.shape[0]
  a_terms = jnp.tril(jax.random.normal(next(ks), (U, B, N, W, W), f32) * 0.1, -1)

  def state_scan(u, w, kd, dec):
    class C:  # the four terms the scan reads
      u_UBNWJ, w_UBNWH, k_UBNWH, decay_UBN = u, w, kd, dec
    return rule._chunk_states(C, jnp.zeros((B, N, H, J), f32), keep=True)

  _, St_in = jax.jit(state_scan)(u, w, kd, dec)

  def outputs(q, k, v, g, beta, St_in):
    # The terms are built again here (outputs reads the chunk's q, k and decay): the part's time is this less
    # chunk_terms' (the table subtracts it).
    c = rule._Chunks(q, k, v, g, beta, None, W, rule.DEFAULT_INVERSE)
    o = c.outputs(St_in)
    return jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, U * W, N, J)[:, :T]

  def whole(q, k, v, g, beta):
    return rule.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=W)

  z = jax.random.normal(next(ks), (B, T, N * J), bf16)
  o = jax.random.normal(next(ks), (B, T, N * J), bf16)
  return {"conv_gates": (conv_gates, (qkv, conv_w, b, a)),
          "chunk_terms": (chunk_terms, (q, k, v, g, beta)),
          "inverse": (lambda a: rule.unit_lower_inverse(a, rule.DEFAULT_INVERSE), (a_terms,)),
          "state_scan": (state_scan, (u, w, kd, dec)),
          "chunk_terms_and_outputs": (outputs, (q, k, v, g, beta, St_in)),
          "rule": (whole, (q, k, v, g, beta)),
          "gated_norm": (lambda o, z: gated_rms_norm(jnp.ones((J,), f32), o, z, 1e-6), (o, z))}


def run(args, log=print):
  import jax
  import jax.numpy as jnp
  N, K = (int(x) for x in args.heads.split(":"))
  table = parts(args.batch, args.seq, N, K, args.dim, args.dim, args.chunk)
  recs = []
  out = open(args.out, "a") if args.out else None
  for name, (fn, xs) in table.items():
    def fwd_bwd(*xs, fn=fn):
      ys, vjp = jax.vjp(fn, *xs)
      cts = jax.tree.map(lambda y: jnp.ones_like(y) if jnp.issubdtype(y.dtype, jnp.floating) else None, ys)
      return vjp(cts)
    rec = {"part": name, "batch": args.batch, "seq": args.seq, "heads": args.heads, "dim": args.dim,
           "chunk": args.chunk, "platform": jax.devices()[0].platform}
    try:
      rec["fwd_s"], rec["fwd_spread"] = timed(fn, xs, args.reps)
      rec["fwd_bwd_s"], rec["fwd_bwd_spread"] = timed(fwd_bwd, xs, args.reps)
    except Exception as e:  # noqa: BLE001  (a part that fails is a result)
      rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    recs.append(rec)
    log(json.dumps(rec))
    if out:
      out.write(json.dumps(rec) + "\n")
      out.flush()
  return recs


def render(recs) -> str:
  lines = ["| part | forward ms (spread) | forward + backward ms (spread) |", "| --- | --- | --- |"]
  for r in recs:
    if "error" in r:
      lines.append(f"| {r['part']} | failed: {r['error'][:100]} | |")
    else:
      lines.append(f"| {r['part']} | {r['fwd_s'] * 1e3:.2f} ({r['fwd_spread']:.0%}) | {r['fwd_bwd_s'] * 1e3:.2f} "
                   f"({r['fwd_bwd_spread']:.0%}) |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--heads", default="16:16", help="N:K, value heads : key heads")
  ap.add_argument("--dim", type=int, default=128, help="H = J")
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  print(render(run(args)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
