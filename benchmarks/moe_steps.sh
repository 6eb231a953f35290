#!/usr/bin/env bash
# MoE train steps against the dense step of the same active FLOPs, and against the MoE step before issue 19
# (grouped_matmul=blocks, expert kernels FSDP-sharded on embed and gathered): `meshlm bench`, arms interleaved
# in one run each, wall time, the bench's 95% interval on each ratio. docs/performance.md quotes the output.
#
#   benchmarks/moe_steps.sh [REPS]       (default 12 rounds per run; about 6 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-12}
BENCH=".venv/bin/meshlm bench"
BEFORE="model.parts.moe.grouped_matmul=blocks,model.parts.moe.kernel_fsdp=embed"

# The issue's geometry (MaxText's mixtral-tiny): embed 256, 8 query / 4 KV heads of 32, 8 experts top-2 of width
# 512, 2 layers, vocab 512, seq 128, global batch 4, float32; the dense arm is llama with an MLP of width 2 x 512.
G="model.embed_dim=256,model.num_heads=8,model.num_kv_heads=4,model.head_dim=32,model.num_layers=2,model.vocab_size=512,train.seq_len=128,train.compute_dtype=float32,scan_layers=false"
MOE="model=mixtral-tiny,$G,model.parts.moe.num_experts=8,model.parts.moe.mlp_dim=512,model.sliding_window=null"
DENSE="model=llama2-tiny,$G,model.mlp_dim=1024"
for mesh in "4 train.per_device_batch_size=1,mesh.fsdp=4" "1 train.per_device_batch_size=4,mesh.fsdp=1"; do
  set -- $mesh
  echo "== issue geometry, cpu_devices=$1 ($2)"
  $BENCH cpu_devices=$1 --reps "$REPS" --arm "moe:$MOE,$2" --arm "before:$MOE,$2,$BEFORE" --arm "dense:$DENSE,$2"
done

# The presets as shipped; dense arms of the same active FLOPs. mixtral-tiny: 4 experts top-2 of width 256 ->
# mistral with mlp_dim 512 and the same attention. qwen3-moe-tiny: one dense layer of 512 and three MoE layers of
# top-2 x 128 -> qwen3 with mlp_dim (512 + 3 x 256) / 4 = 320 on all four layers, untied, float32.
MIX_DENSE="model=mistral-tiny,model.num_kv_heads=2,model.mlp_dim=512,model.rope_theta=1000000.0,scan_layers=false,train.compute_dtype=float32,train.per_device_batch_size=8"
QWEN_DENSE="model=qwen3-tiny,model.num_layers=4,model.mlp_dim=320,model.tie_embeddings=false,train.compute_dtype=float32,train.per_device_batch_size=8"
for devices in 1 4; do
  fsdp="mesh.fsdp=$devices"
  echo "== mixtral-tiny as shipped, cpu_devices=$devices"
  $BENCH cpu_devices=$devices --reps "$REPS" --arm "moe:model=mixtral-tiny,$fsdp" --arm "before:model=mixtral-tiny,$fsdp,$BEFORE" \
    --arm "dense:$MIX_DENSE,$fsdp"
  echo "== qwen3-moe-tiny as shipped, cpu_devices=$devices"
  $BENCH cpu_devices=$devices --reps "$REPS" --arm "moe:model=qwen3-moe-tiny,$fsdp" \
    --arm "before:model=qwen3-moe-tiny,$fsdp,$BEFORE" --arm "dense:$QWEN_DENSE,$fsdp"
done
