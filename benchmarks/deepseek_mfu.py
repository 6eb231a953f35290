"""Model FLOPs and MFU of a deepseek_v3 train step, from a `meshlm bench --json` report of it.

flops per token = 6 x the matmul parameters a token runs through (MLA's q_a, q_b or q, kv_a, k_b, v_b, o; the
dense layers' GLU; per MoE layer the router, num_experts_per_tok experts and the shared experts; the LM head;
not the embedding lookup) + causal attention, halved as Megatron and MaxText count it: 6 x layers x heads x
(qk head dim + v head dim) x seq / 2. The peak is this machine's jitted float32 matmul (the best of
[n, n] @ [n, n] at 1024, 2048, 4096, measured in this process: benchmarks/maxtext_vs_meshlm.py's matmul_peak).

  .venv/bin/meshlm bench model=deepseek-v3-small cpu_devices=1 mesh.fsdp=1 train.per_device_batch_size=1 \\
      --arm explicit:shard_mode=explicit --arm auto:shard_mode=auto --reps 6 --json > bench.json
  .venv/bin/python benchmarks/deepseek_mfu.py bench.json model=deepseek-v3-small cpu_devices=1 mesh.fsdp=1 \\
      train.per_device_batch_size=1
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys


def flops_per_token(m, seq: int) -> float:
  from meshlm.models.ffns.moe import knobs  # here: --help needs no jax
  from meshlm.models.mixers import mla
  D, N, lat = m.embed_dim, m.num_heads, mla.knobs(m)
  Hn, Hr, Hv, R, Rq = lat.qk_nope_head_dim, lat.qk_rope_head_dim, lat.v_head_dim, lat.kv_lora_rank, lat.q_lora_rank
  q = D * Rq + Rq * N * (Hn + Hr) if Rq else D * N * (Hn + Hr)
  attn = q + D * (R + Hr) + R * N * (Hn + Hv) + N * Hv * D
  k, own = m.first_k_dense_replace, knobs(m)
  moe = D * own.num_experts + own.num_experts_per_tok * 3 * D * own.mlp_dim + 3 * D * own.shared_expert_mlp_dim
  matmul = m.num_layers * attn + k * 3 * D * m.mlp_dim + (m.num_layers - k) * moe + D * m.vocab_size
  return 6.0 * matmul + 6.0 * m.num_layers * N * (Hn + Hr + Hv) * seq / 2


def main(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-"):
    print(__doc__)
    return 2
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from meshlm.config import load_config
  report = json.load(open(argv[0]))
  cfg = load_config(*argv[1:])
  here = os.path.dirname(os.path.abspath(__file__))
  spec = importlib.util.spec_from_file_location("maxtext_vs_meshlm", os.path.join(here, "maxtext_vs_meshlm.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  peak = mod.matmul_peak()["peak"]
  t = cfg.train
  import jax
  devices = cfg.cpu_devices or len(jax.devices())
  tokens = t.per_device_batch_size * devices * t.seq_len
  step_flops = flops_per_token(cfg.model, t.seq_len) * tokens
  print(f"{cfg.model_name}: {step_flops / 1e9:.1f} GFLOP per step ({tokens} tokens), matmul peak "
        f"{peak / 1e9:.0f} GFLOP/s")
  print("| arm | median step (s) | spread | model GFLOP/s | MFU |")
  print("| --- | --- | --- | --- | --- |")
  for name, arm in report["arms"].items():
    s = arm["median_s"]
    print(f"| {name} | {s:.3f} | {100 * arm['spread']:.0f}% | {step_flops / s / 1e9:.1f} | "
          f"{100 * step_flops / s / peak:.1f}% |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
