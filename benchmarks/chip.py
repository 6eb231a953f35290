"""The train step (and decode) on whatever backend JAX finds: step time, tokens/s, MFU, compile time, memory.

  python benchmarks/chip.py --set v5e --out results.jsonl            # every row of the set, one process
  python benchmarks/chip.py --set v5e --only qwen3-0.6b-b8 --profile DIR   # one row, and a jax.profiler trace
  python benchmarks/chip.py --set tiny                                # the CPU rows the tests run

One process runs a set of rows, one after another, each alone on the device (the previous row's state and
executables are dropped first). A train row builds the step exactly as `meshlm train` does
(`bench.harness.compile_arm`: build_train_step, the initialized state, one fixed synthetic batch), times the lower and
the compile, warms up, then times `--steps` single steps (each to `block_until_ready`: the median and spread) and one
run of `--steps` back-to-back steps (their mean), and records the losses of every step. It reports tokens/s, the
model FLOPs per token (analysis/aot.model_flops_per_token: 6 x the matmul parameters a token meets plus causal
attention, as Megatron and MaxText count; a remat's recomputed forward is not counted) and MFU against the chip's
published bf16 peak and against a bf16 matmul measured at the start of the same run, and the executable's own memory
(`memory_analysis()`). A decode row times `meshlm.generate` (greedy, a warm-up call compiles it) and compares its
tokens/s with the HBM roofline: each decode step reads every weight once plus the KV cache (bytes / bandwidth): the
rows written so far (the floor), the whole cache buffer (the xla decode attention's reads) and the filled blocks
(the pallas decode attention's, nn/decode_attention.py); `resolved` says which ran. With --profile, a decode row
traces one more generate call.

A row that fails records its error and the next one runs. Each row's JSON line is printed and appended to --out as
soon as it is done; a markdown table of the set follows at the end (docs/performance.md "On a TPU v5e chip").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
import traceback

import numpy as np


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  overrides: tuple[str, ...]
  kind: str = "train"  # train | decode | causal | rope
  batch: int = 1  # decode: prompts
  prompt_len: int = 128  # decode
  new_tokens: int = 128  # decode
  rope_swap: str = "auto"  # rope: the rope_swap key's form (auto | matmul | roll)
  positions: tuple[int, ...] = (1541,)  # causal: the positions whose input token is changed
  shape: tuple[int, ...] = (8, 16, 2048, 128)  # rope: the rows [B, N, T, H] (qwen3-0.6b's queries at batch 8)


QWEN3_06B = ("model=qwen3-0.6b", "train.compute_dtype=bfloat16", "train.param_dtype=float32", "train.seq_len=2048",
             "train.sample_tokens=0")
# A Gated DeltaNet hybrid at qwen3-0.6b's widths: qwen3.5's layer plan (3 GDN layers then 1 gated attention), 28 layers.
GDN_06B = ("model=qwen3.5-tiny", "model.vocab_size=151936", "model.embed_dim=1024", "model.num_layers=28",
           "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=128", "model.mlp_dim=3072",
           "model.max_position=40960", "model.parts.gdn.key_heads=16", "model.parts.gdn.value_heads=16",
           "model.parts.gdn.key_head_dim=128", "model.parts.gdn.value_head_dim=128", "train.compute_dtype=bfloat16",
           "train.seq_len=2048", "train.sample_tokens=0")
# 12 layers of qwen3-0.6b and its MoE twin: 8 experts, top-2 of 1,536 wide (the dense GLU's 3,072 of active FLOPs).
DENSE_12 = QWEN3_06B + ("model.num_layers=12",)
MOE_12 = ("model=qwen3-moe-tiny", "model.vocab_size=151936", "model.embed_dim=1024", "model.num_layers=12",
          "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=128", "model.mlp_dim=3072",
          "model.mlp_only_layers=[]", "model.parts.moe.num_experts=8", "model.parts.moe.num_experts_per_tok=2",
          "model.parts.moe.mlp_dim=1536", "model.max_position=40960", "model.tie_embeddings=true",
          "train.compute_dtype=bfloat16", "train.seq_len=2048", "train.sample_tokens=0")


def _b(n: int) -> str:
  return f"train.per_device_batch_size={n}"


def _s(n: int) -> str:
  return f"train.seq_len={n}"


def _blocks(b: int, phases: str = "fwd,dkv,dq") -> tuple[str, ...]:
  """The sa_block_* keys of the phases given, all at b."""
  keys = {"fwd": ("sa_block_q", "sa_block_kv", "sa_block_kv_compute"),
          "dkv": ("sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_kv_dkv_compute"), "dq": ("sa_block_q_dq", "sa_block_kv_dq")}
  return tuple(f"{k}={b}" for p in phases.split(",") for k in keys[p])


# Each family at chip-fitting widths with its published attention shapes (issue 61): gemma3-4b and gemma2-2b
# (head_dim 256; gemma2's soft-cap, both windows), an MLA model (q/k 192, v 128), mistral (window 4096) and llama3
# (head_dim 128, GQA 4) at a few layers, a 32,000 vocabulary.
BF16 = ("train.compute_dtype=bfloat16", "train.param_dtype=float32", "train.sample_tokens=0", "remat=full")
GEMMA3_4B = ("model=gemma3-4b", "model.num_layers=6", "model.vocab_size=32000") + BF16
GEMMA2_2B = ("model=gemma2-2b", "model.num_layers=8", "model.vocab_size=32000") + BF16
MLA_SMALL = ("model=deepseek-v3-small", "model.num_layers=4", "model.vocab_size=32000") + BF16
# 2 layers: at 4 their float32 parameters, AdamW and gradients overflow the v5e (2 layers: 11.75 GiB compiled).
MISTRAL_7B = ("model=mistral-7b", "model.num_layers=2", "model.vocab_size=32000") + BF16
LLAMA3_8B = ("model=llama3-8b", "model.num_layers=2", "model.vocab_size=32000") + BF16


SETS: dict[str, list[Row]] = {
    # The CPU rows of tests/test_chip_bench.py: tiny, seconds each.
    "tiny": [
        Row("llama2-tiny", ("model=llama2-tiny", "train.seq_len=32", "train.per_device_batch_size=1")),
        Row("llama2-tiny-causal", ("model=llama2-tiny", "train.seq_len=32", "train.per_device_batch_size=1"),
            kind="causal", positions=(9, 20)),
        Row("llama2-tiny-decode", ("model=llama2-tiny",), kind="decode", batch=8, prompt_len=8, new_tokens=4),
    ],
    # issue 54's table on one TPU v5e chip, then the new rows.
    "v5e": [
        Row("qwen3-0.6b-b8-full", QWEN3_06B + (_b(8), "remat=full")),
        Row("qwen3-0.6b-b16-full", QWEN3_06B + (_b(16), "remat=full")),
        Row("qwen3-0.6b-b4-dots", QWEN3_06B + (_b(4), "remat=dots")),
        Row("qwen3-0.6b-b8-full-materialized", QWEN3_06B + (_b(8), "remat=full", "loss_impl=materialized")),
        Row("qwen3-0.6b-b8-full-flash", QWEN3_06B + (_b(8), "remat=full", "attention_impl=flash")),
        Row("qwen3-0.6b-b8-full-xla", QWEN3_06B + (_b(8), "remat=full", "attention_impl=xla")),
        Row("qwen3-0.6b-s8192-b2-full", QWEN3_06B + (_b(2), "remat=full", "train.seq_len=8192")),
        Row("qwen3-0.6b-s8192-b4-full", QWEN3_06B + (_b(4), "remat=full", "train.seq_len=8192")),
        Row("dense12-b8-full", DENSE_12 + (_b(8), "remat=full")),
        Row("moe12-b8-full", MOE_12 + (_b(8), "remat=full")),
        Row("gdn-0.6b-b4-full-auto", GDN_06B + (_b(4), "remat=full", "shard_mode=auto")),
        Row("gdn-0.6b-b4-full", GDN_06B + (_b(4), "remat=full")),
        Row("gdn-0.6b-b4-full-unscanned-auto", GDN_06B + (_b(4), "remat=full", "shard_mode=auto", "scan_layers=false")),
        # float32 parity with a CPU: the same row's losses from `--set v5e --only llama2-tiny-f32-highest` on a CPU.
        Row("llama2-tiny-f32-highest", ("model=llama2-tiny", "train.compute_dtype=float32", "train.seq_len=128",
                                        "train.per_device_batch_size=8", "train.matmul_precision=highest")),
        Row("llama2-tiny-f32-default", ("model=llama2-tiny", "train.compute_dtype=float32", "train.seq_len=128",
                                        "train.per_device_batch_size=8")),
        Row("qwen3-0.6b-decode-b1", QWEN3_06B, kind="decode", batch=1,
            prompt_len=128, new_tokens=256),
        Row("qwen3-0.6b-decode-b64", QWEN3_06B, kind="decode", batch=64,
            prompt_len=128, new_tokens=256),
    ],
    # Decode (issue 62 item 2): the pallas decode attention (auto on TPU) against the xla path, and its block.
    # Profile: --set v5e-decode --only qwen3-0.6b-decode-b64 --profile DIR (then profile_summary.py DIR/ROW).
    "v5e-decode": [
        Row("qwen3-0.6b-decode-b1", QWEN3_06B, kind="decode", batch=1, prompt_len=128, new_tokens=256),
        Row("qwen3-0.6b-decode-b64", QWEN3_06B, kind="decode", batch=64, prompt_len=128, new_tokens=256),
        Row("qwen3-0.6b-decode-b1-xla", QWEN3_06B + ("decode_attention_impl=xla",), kind="decode", batch=1,
            prompt_len=128, new_tokens=256),
        Row("qwen3-0.6b-decode-b64-xla", QWEN3_06B + ("decode_attention_impl=xla",), kind="decode", batch=64,
            prompt_len=128, new_tokens=256),
        *[Row(f"qwen3-0.6b-decode-b64-block{b}", QWEN3_06B + (f"decode_attention_block={b}",), kind="decode", batch=64,
              prompt_len=128, new_tokens=256) for b in (64, 256, 512)],
        # Batch 1 is bound by its ~1,200 small ops a step, not bytes: the layers unrolled (1,037 ops), no loop.
        Row("qwen3-0.6b-decode-b1-unscanned", QWEN3_06B + ("scan_layers=false",), kind="decode", batch=1,
            prompt_len=128, new_tokens=256),
    ],
    # Where the seed's families spend their time (issue 60 item 1, 4): profiled, one process.
    "v5e-probe": [
        Row("gdn-0.6b-b2-full", GDN_06B + (_b(2), "remat=full")),
        Row("dense12-b8-full", DENSE_12 + (_b(8), "remat=full")),
        Row("moe12-b8-full", MOE_12 + (_b(8), "remat=full")),
    ],
    # What the next chip session measures first (docs/tpu.md "After this run"): the default step after RoPE's
    # one-pass rotation and the per-layer kernel casts, each against its former form, and RoPE's bits on the chip.
    "v5e-next": [
        Row("qwen3-0.6b-rope-bits", (), kind="rope"),
        Row("qwen3-0.6b-b8-full", QWEN3_06B + (_b(8), "remat=full")),
        Row("qwen3-0.6b-b8-full-rope-roll", QWEN3_06B + (_b(8), "remat=full", "rope_swap=roll")),
        Row("qwen3-0.6b-b8-full-cast-astype", QWEN3_06B + (_b(8), "remat=full", "layer_cast=astype")),
        Row("qwen3-0.6b-s8192-b2-full", QWEN3_06B + (_b(2), "remat=full", "train.seq_len=8192")),
        # splash_backward=auto is split at 8 blocks (memory); what the fused backward's time is there.
        Row("qwen3-0.6b-s8192-b2-full-fused", QWEN3_06B + (_b(2), "remat=full", "train.seq_len=8192",
                                                          "splash_backward=fused")),
    ],
    # issue 61: the attention rows. The block rule's picks (nn/splash_rule.Rule: `meshlm compile ... --json` prints
    # them under config.splash_blocks), remat_attention=save against recompute, and each family's row.
    "v5e-attn": [
        Row("qwen3-0.6b-b8-full", QWEN3_06B + (_b(8), "remat=full")),
        Row("qwen3-0.6b-b8-full-save", QWEN3_06B + (_b(8), "remat=full", "remat_attention=save")),
        Row("qwen3-0.6b-b8-full-block512", QWEN3_06B + (_b(8), "remat=full", *_blocks(512))),
        Row("qwen3-0.6b-s8192-b2-full", QWEN3_06B + (_b(2), "remat=full", _s(8192))),
        Row("qwen3-0.6b-s8192-b2-full-save", QWEN3_06B + (_b(2), "remat=full", _s(8192), "remat_attention=save")),
        Row("gemma3-4b-6l-s2048-b4", GEMMA3_4B + (_s(2048), _b(4))),
        Row("gemma3-4b-6l-s2048-b4-save", GEMMA3_4B + (_s(2048), _b(4), "remat_attention=save")),
        Row("gemma3-4b-6l-s2048-b4-dkv512", GEMMA3_4B + (_s(2048), _b(4), *_blocks(512, "dkv"))),
        Row("gemma3-4b-6l-s4096-b2", GEMMA3_4B + (_s(4096), _b(2))),
        Row("gemma3-4b-6l-s8192-b1", GEMMA3_4B + (_s(8192), _b(1))),
        Row("gemma2-2b-8l-s2048-b4", GEMMA2_2B + (_s(2048), _b(4))),
        Row("gemma2-2b-8l-s4096-b2", GEMMA2_2B + (_s(4096), _b(2))),
        Row("gemma2-2b-8l-s8192-b1", GEMMA2_2B + (_s(8192), _b(1))),
        Row("deepseek-v3-small-4l-s2048-b4", MLA_SMALL + (_s(2048), _b(4))),
        Row("mistral-7b-2l-s4096-b2", MISTRAL_7B + (_s(4096), _b(2))),
        Row("llama3-8b-2l-s4096-b2", LLAMA3_8B + (_s(4096), _b(2))),
    ],
    # Where the time goes (issue 54 item 2): one thing changed at a time from qwen3-0.6b-b8-full, and the GDN
    # hybrid's causality in the very training path it trains with.
    "v5e-sweep": [
        Row("gdn-0.6b-causal-auto", GDN_06B + (_b(4), "remat=full", "shard_mode=auto"), kind="causal",
            positions=(1541, 1600)),
        Row("qwen3-0.6b-b8-full-block256", QWEN3_06B + (_b(8), "remat=full", "splash_backward=split", *_blocks(256))),
        Row("qwen3-0.6b-b8-full-block1024", QWEN3_06B + (_b(8), "remat=full", "splash_backward=split",
                                                         *_blocks(1024))),
        Row("qwen3-0.6b-b8-full-block1024-fused", QWEN3_06B + (_b(8), "remat=full", "splash_backward=fused",
                                                               *_blocks(1024))),
        Row("qwen3-0.6b-b8-full-block2048", QWEN3_06B + (_b(8), "remat=full", "splash_backward=split",
                                                         *_blocks(2048))),
        Row("qwen3-0.6b-b8-full-lossblock1024", QWEN3_06B + (_b(8), "remat=full", "loss_block=1024")),
        Row("qwen3-0.6b-b8-none-materialized-2l", QWEN3_06B + (_b(8), "remat=none", "model.num_layers=2",
                                                             "loss_impl=materialized")),
        Row("qwen3-0.6b-b8-full-2l", QWEN3_06B + (_b(8), "remat=full", "model.num_layers=2")),
        Row("qwen3-0.6b-b8-none-2l", QWEN3_06B + (_b(8), "remat=none", "model.num_layers=2")),
        Row("qwen3-0.6b-b8-full-unscanned", QWEN3_06B + (_b(8), "remat=full", "scan_layers=false")),
    ],
    # The GDN hybrid with the Pallas kernels (issue 60 item 2: gdn_impl=auto is pallas on TPU), against the pure-JAX
    # rule at batch 2 (v5e-probe's gdn-0.6b-b2-full before the kernel: 750 ms a step, 12.1% MFU).
    "v5e-gdn": [
        Row("gdn-0.6b-b4-full", GDN_06B + (_b(4), "remat=full")),
        # The kernel's inverse in three bf16 passes (before the refine default) and chunks of 128 (the MXU's width).
        Row("gdn-0.6b-b4-full-split", GDN_06B + (_b(4), "remat=full", "model.parts.gdn.inverse=split")),
        Row("gdn-0.6b-b4-full-c128", GDN_06B + (_b(4), "remat=full", "model.parts.gdn.chunk_size=128")),
        Row("gdn-0.6b-b2-full", GDN_06B + (_b(2), "remat=full")),
        Row("gdn-0.6b-b2-full-jax", GDN_06B + (_b(2), "remat=full", "gdn_impl=jax")),
    ],
    # MoE at the speed of its FLOPs (issue 60 item 4, docs/moe.md): the MoE twin against its dense twin with the
    # default grouped matmul (megablox on TPU) and with ragged_dot, megablox at another tiling; deepseek-v3-small and a
    # mixtral-shaped model (embed 1024, 8 layers, 8 experts top-2 of 2,048), each beside its ragged_dot arm.
    "v5e-moe": [
        Row("dense12-b8-full", DENSE_12 + (_b(8), "remat=full")),
        Row("moe12-b8-full", MOE_12 + (_b(8), "remat=full")),
        Row("moe12-b8-full-ragged", MOE_12 + (_b(8), "remat=full", "model.parts.moe.grouped_matmul=ragged")),
        Row("moe12-b8-full-mb1024x512", MOE_12 + (_b(8), "remat=full",
                                                  "model.parts.moe.megablox_tiling=[1024,512,1024]")),
        *(Row(f"dsv3-small-b8-full{arm}", ("model=deepseek-v3-small", "train.compute_dtype=bfloat16",
                                           "train.seq_len=2048", "train.sample_tokens=0", _b(8), "remat=full", *keys))
          for arm, keys in (("", ()), ("-ragged", ("model.parts.moe.grouped_matmul=ragged",)))),
        *(Row(f"mixtral-shaped-b4-full{arm}", (
            "model=mixtral-tiny", "model.vocab_size=32000", "model.embed_dim=1024", "model.num_layers=8",
            "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=64", "model.parts.moe.num_experts=8",
            "model.parts.moe.num_experts_per_tok=2", "model.parts.moe.mlp_dim=2048", "model.sliding_window=null",
            "model.max_position=4096", "scan_layers=true", "train.compute_dtype=bfloat16", "train.seq_len=2048",
            "train.sample_tokens=0", _b(4), "remat=full", *keys))
          for arm, keys in (("", ()), ("-ragged", ("model.parts.moe.grouped_matmul=ragged",)))),
    ],
}


def backend() -> dict:
  import jax
  d = jax.devices()[0]
  info = {"platform": d.platform, "device_kind": d.device_kind, "devices": jax.device_count(), "jax": jax.__version__}
  try:
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
  except Exception:  # noqa: BLE001
    pass
  try:
    from importlib.metadata import version
    info["libtpu"] = version("libtpu")
  except Exception:  # noqa: BLE001
    info["libtpu"] = None
  return info


def chip_figures(device_kind: str):
  """The published per-chip figures for the device kind (analysis/aot.PUBLISHED), or None (a CPU)."""
  from meshlm.analysis.aot import PUBLISHED
  return PUBLISHED.get(device_kind)


def matmul_flops(n: int, reps: int = 10) -> float:
  """bf16 n x n x n matmul throughput on the first device, FLOP/s (the mean of reps calls after a warm-up)."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, b))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = f(a, b)
  jax.block_until_ready(out)
  return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")
  out = {f.replace("_size_in_bytes", "_bytes"): int(getattr(m, f, 0) or 0) for f in fields}
  peak = getattr(m, "peak_memory_in_bytes", None)
  # Live at once: arguments + temporaries + the outputs that do not alias an argument (the donated state does).
  out["peak_bytes"] = int(peak) if peak else (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                                               - out["alias_bytes"])
  return out


def spread(xs: list[float]) -> float:
  return (max(xs) - min(xs)) / statistics.median(xs)


def train_row(row: Row, steps: int, warmup: int, profile_dir: str | None = None) -> dict:
  """Compile, warm up and time the row's train step; the record of issue 54's table."""
  import jax
  from meshlm.analysis.aot import model_flops_per_token
  from meshlm.analysis.arms import Arm
  from meshlm.bench.harness import compile_arm
  from meshlm.commands.resolve import load_config
  cfg = load_config(*row.overrides)
  arm = compile_arm(Arm(row.name, list(row.overrides), cfg))
  runner = arm.runner
  tokens = runner.batch["inputs"].size
  losses: list[float] = []

  def one() -> float:
    t0 = time.perf_counter()
    runner.state, metrics = runner.call(runner.state, runner.batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    jax.block_until_ready(runner.state)
    losses.append(loss)
    return time.perf_counter() - t0

  for _ in range(warmup):
    one()
  singles = [one() for _ in range(steps)]
  t0 = time.perf_counter()
  for _ in range(steps):
    runner.state, metrics = runner.call(runner.state, runner.batch)
  jax.block_until_ready((runner.state, metrics))
  back_to_back = (time.perf_counter() - t0) / steps
  losses.append(float(metrics["loss"]))
  if profile_dir:
    with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
      for _ in range(3):
        runner.state, metrics = runner.call(runner.state, runner.batch)
      jax.block_until_ready((runner.state, metrics))
  step_s = statistics.median(singles)
  return {"tokens": int(tokens), "compile_s": arm.compile_s, "lower_s": arm.lower_s, "step_s": step_s,
          "step_spread": spread(singles), "step_s_back_to_back": back_to_back,
          "tokens_per_s": tokens / step_s, "tokens_per_s_back_to_back": tokens / back_to_back,
          "model_flops_per_token": model_flops_per_token(cfg), "memory": _memory(arm.compiled),
          "losses": losses, "steps_timed": steps, "warmup": warmup,
          "resolved": {**_resolved_attention(cfg), "loss": _resolved_loss(cfg, runner), **_resolved_parts(cfg)}}


def _resolved_attention(cfg) -> dict:
  """The attention core's record and the other program keys as the reports print them (analysis/census's
  attention_record and program_keys on this device)."""
  import jax
  from meshlm.analysis.census import attention_record
  from meshlm.analysis.keys import program_keys
  d = jax.devices()[0]
  return attention_record(cfg, d.platform, d.device_kind).summary() | program_keys(cfg, d.platform)


def _resolved_parts(cfg) -> dict:
  """What the model's parts report they run (Instrument.report: the GDN hybrids' gdn_impl)."""
  import jax
  from meshlm.models.registry import part_reports
  return part_reports(cfg, jax.devices()[0].platform)


def _resolved_loss(cfg, runner) -> str:
  from meshlm.models.logprobs import loss_path
  return loss_path(cfg, runner.batch["inputs"].shape[0], cfg.train.seq_len)


def decode_row(row: Row, reps: int, profile_dir: str | None = None) -> dict:
  """Greedy meshlm.generate of row.new_tokens after row.prompt_len-token prompts, row.batch rows: tokens/s (the
  median of reps calls after a compiling warm-up) against the HBM roofline of a decode step. profile_dir: a
  jax.profiler trace of one more call there (benchmarks/profile_summary.py; the call's op times over its steps)."""
  import jax
  from meshlm.commands.resolve import load_config
  from meshlm.models import generate as G
  from meshlm.models.params import init_params
  from meshlm.nn import decode_attention as DA
  from meshlm.parallel.mesh import make_mesh
  cfg = load_config(*row.overrides)
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(0, cfg.model.vocab_size, row.prompt_len)] for _ in range(row.batch)]
  t0 = time.perf_counter()
  G.generate(cfg, params, prompts, max_new_tokens=row.new_tokens, stop_tokens=(), mesh=mesh)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = G.generate(cfg, params, prompts, max_new_tokens=row.new_tokens, stop_tokens=(), mesh=mesh)
    times.append(time.perf_counter() - t0)
    assert all(len(t) == row.new_tokens for t in out.token_lists())
  if profile_dir:
    with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
      G.generate(cfg, params, prompts, max_new_tokens=row.new_tokens, stop_tokens=(), mesh=mesh)
  s = statistics.median(times)
  # What a decode step must read at least: every weight once, in the compute dtype (XLA casts the float32 parameters
  # once, outside the decode loop), and the K and V rows written so far, averaged over the new tokens.
  item = np.dtype(cfg.train.compute_dtype).itemsize
  weight_bytes = sum(x.size for x in jax.tree.leaves(params)) * item
  m = cfg.model
  row_bytes = row.batch * m.num_layers * 2 * m.num_kv_heads * m.head_dim * item  # one position of every layer's cache
  mean_len = row.prompt_len + row.new_tokens / 2
  allocated = G.bucket(row.prompt_len + row.new_tokens, m.max_position)  # the cache buffer each step attends over
  # The decode attention that ran (nn/decode_attention: pallas reads each row's filled blocks of `block` slots, xla
  # the whole buffer) and what its blocks read, averaged over the steps' positions (the kernel's own floor).
  impl = DA.Decode(DA.resolve(cfg.decode_attention_impl, jax.devices()[0].platform),
                   cfg.decode_attention_block).for_size(allocated)
  block = DA.block_for(allocated, cfg.decode_attention_block) if impl == "pallas" else allocated
  positions = range(row.prompt_len, row.prompt_len + row.new_tokens)
  in_blocks = statistics.mean(-(-p // block) * block for p in positions)
  return {"tokens": row.batch * row.new_tokens, "seconds": s, "spread": spread(times), "reps": reps,
          "first_call_s": compile_s, "tokens_per_s": row.batch * row.new_tokens / s,
          "weight_bytes": int(weight_bytes), "cache_bytes_per_step": float(row_bytes * mean_len),
          "cache_bytes_allocated_per_step": float(row_bytes * allocated), "cache_len": int(allocated),
          "cache_bytes_blocks_per_step": float(row_bytes * in_blocks),
          "resolved": {"decode_attention": impl, "block": block},
          "batch": row.batch, "prompt_len": row.prompt_len, "new_tokens": row.new_tokens}


def causal_row(row: Row) -> dict:
  """The training path's causality: the train step's loss (computed before its update) over the targets before
  position p only, with the input token at p changed and not. A causal model gives the same loss; a leak moves it."""
  import jax
  from meshlm.bench.harness import synthetic_batch
  from meshlm.commands.resolve import load_config
  from meshlm.train.step import build_train_step
  cfg = load_config(*row.overrides)
  step = build_train_step(cfg)
  base = synthetic_batch(step.global_batch, cfg.train.seq_len, cfg.model.vocab_size)
  out = {}
  for p in row.positions:
    losses = []
    for change in (False, True):
      b = {k: v.copy() for k, v in base.items()}
      b["loss_mask"][:, p:] = 0
      if change:
        b["inputs"][:, p] = (b["inputs"][:, p] + 7) % cfg.model.vocab_size
      new_state, metrics = step(step.init_state(jax.random.key(0)), step.put_batch(b))
      losses.append(float(metrics["loss"]))
      del new_state  # one state on the device at a time
    out[str(p)] = {"loss": losses[0], "loss_changed": losses[1], "diff": losses[1] - losses[0]}
  # The check's power: a change inside the counted span (at p - 1, whose own target is counted) must move the loss.
  p = row.positions[0]
  b = {k: v.copy() for k, v in base.items()}
  b["loss_mask"][:, p:] = 0
  b["inputs"][:, p - 1] = (b["inputs"][:, p - 1] + 7) % cfg.model.vocab_size
  new_state, metrics = step(step.init_state(jax.random.key(0)), step.put_batch(b))
  control = float(metrics["loss"]) - out[str(p)]["loss"]
  del new_state
  return {"positions": out, "causal": all(v["diff"] == 0 for v in out.values()), "control_diff": control}


def rope_row(row: Row) -> dict:
  """nn/rope.apply_rope on this backend (on TPU the halves swapped by a permutation matmul on the MXU) against the
  rotate-half formula it replaced, forward and gradient, bf16 and float32 rows of row.shape at positions 0..T-1:
  equal bit for bit, and the largest difference."""
  import jax
  import jax.numpy as jnp
  from meshlm.nn import rope as R

  def rotate_half(x, cos, sin):  # the former apply_rope, on the plain sin
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)

  def value_and_grad(fn, x, cos, sin, ct):
    y, vjp = jax.vjp(lambda x: fn(x, cos, sin), x)
    return y, vjp(ct)[0]
  B, N, T, H = row.shape
  rng = np.random.default_rng(0)
  cos, sin = R.freqs_at(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), H, 1e6)
  out = {}
  for dtype in ("bfloat16", "float32"):
    x, ct = (jnp.asarray(rng.standard_normal((B, N, T, H)), dtype) for _ in range(2))
    swap = {"auto": None, "matmul": True, "roll": False}[row.rope_swap]
    new = jax.jit(lambda *a: value_and_grad(lambda x, c, s: R.apply_rope(x, c, s, swap), *a))(x, cos, R.fold_sign(sin),
                                                                                           ct)
    old = jax.jit(lambda *a: value_and_grad(rotate_half, *a))(x, cos, sin, ct)
    diff = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(new, old)]
    out[dtype] = {"forward_equal": diff[0] == 0.0, "grad_equal": diff[1] == 0.0, "forward_max_diff": diff[0],
                  "grad_max_diff": diff[1]}
  return {"shape": list(row.shape), "rope": out, "bit_identical": all(v["forward_equal"] and v["grad_equal"]
                                                                       for v in out.values())}


def finish(rec: dict, info: dict, matmul: float | None) -> dict:
  """Adds MFU (published peak; measured matmul) to a train record and the HBM roofline to a decode one."""
  fig = chip_figures(info["device_kind"])
  if rec.get("kind") == "train" and "step_s" in rec:
    achieved = rec["model_flops_per_token"] * rec["tokens_per_s"] / info["devices"]
    rec["model_tflops_per_s"] = achieved / 1e12
    rec["mfu"] = achieved / fig.peak_flops if fig else None
    rec["mfu_vs_matmul"] = achieved / matmul if matmul else None
  if rec.get("kind") == "decode" and "seconds" in rec and fig:
    # One decode step (every row's next token) at the HBM bandwidth: the cache rows written so far (the floor), the
    # whole cache buffer (what a step that reads its buffer whole can reach: the xla path), and the filled blocks the
    # pallas decode attention reads (its own floor: the rows so far rounded up to its blocks).
    for key, cache in (("", "cache_bytes_per_step"), ("_allocated", "cache_bytes_allocated_per_step"),
                       ("_blocks", "cache_bytes_blocks_per_step")):
      if cache not in rec:
        continue
      floor_s = (rec["weight_bytes"] + rec[cache]) / info["devices"] / fig.hbm_bandwidth
      rec[f"roofline{key}_tokens_per_s"] = rec["batch"] / floor_s
      rec[f"of_roofline{key}"] = rec["tokens_per_s"] / rec[f"roofline{key}_tokens_per_s"]
  return rec


def run(rows: list[Row], out_path: str | None, steps: int, warmup: int, decode_reps: int,
        matmul_n: int | None, profile_dir: str | None = None, log=print,
        profile_rows: set[str] | None = None) -> list[dict]:
  """Every row in turn, alone; each record printed (and appended to out_path) as soon as it is done."""
  import jax
  info = backend()
  n = matmul_n or (8192 if info["platform"] == "tpu" else 512)
  matmul = matmul_flops(n)
  head = {"kind": "backend", **info, "matmul_n": n, "matmul_tflops_per_s": matmul / 1e12,
          "published_peak_tflops": (chip_figures(info["device_kind"]).peak_flops / 1e12
                                    if chip_figures(info["device_kind"]) else None),
          "date": time.strftime("%Y-%m-%d")}
  records = [head]
  out = open(out_path, "a") if out_path else contextlib.nullcontext()
  with out as f:
    def emit(rec):
      line = json.dumps(rec, default=float)
      log(line)
      if f is not None:
        f.write(line + "\n")
        f.flush()
    emit(head)
    for row in rows:
      rec = {"kind": row.kind, "name": row.name, "overrides": list(row.overrides)}
      t0 = time.perf_counter()
      try:
        if row.kind == "train":
          traced = profile_dir and (profile_rows is None or row.name in profile_rows)
          rec.update(train_row(row, steps, warmup, f"{profile_dir}/{row.name}" if traced else None))
        elif row.kind == "causal":
          rec.update(causal_row(row))
        elif row.kind == "rope":
          rec.update(rope_row(row))
        else:
          traced = profile_dir and (profile_rows is None or row.name in profile_rows)
          rec.update(decode_row(row, decode_reps, f"{profile_dir}/{row.name}" if traced else None))
      except Exception as e:  # noqa: BLE001  (a failed row is a result: record it, run the next)
        text = str(e).strip().splitlines()
        rec["error"] = f"{type(e).__name__}: {text[0] if text else ''}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
      rec["row_s"] = time.perf_counter() - t0
      emit(finish(rec, info, matmul))
      records.append(rec)
      gc.collect()
      jax.clear_caches()
  return records


def table(records: list[dict]) -> str:
  """Markdown: one line per train row (step, tokens/s, MFU, memory) and per decode row (tokens/s vs roofline)."""
  head = next(r for r in records if r["kind"] == "backend")
  lines = [f"{head['device_kind']} ({head['platform']}), JAX {head['jax']}, libtpu {head.get('libtpu')}, "
           f"{head['date']}; bf16 {head['matmul_n']}^3 matmul {head['matmul_tflops_per_s']:.1f} TFLOP/s"
           + (f" (published peak {head['published_peak_tflops']:.0f})" if head.get("published_peak_tflops") else ""),
           "",
           "| row | compile s | step ms (median, spread) | back-to-back ms | tokens/s | MFU | MFU vs matmul | peak GiB | "
           "loss first -> last |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
  for r in records:
    if r["kind"] != "train":
      continue
    if "error" in r:
      lines.append(f"| {r['name']} | failed: {r['error'][:160]} | | | | | | | |")
      continue
    peak = r["memory"].get("peak_bytes")
    lines.append(f"| {r['name']} | {r['compile_s']:.1f} | {r['step_s'] * 1e3:,.1f} ({r['step_spread']:.1%}) | "
                 f"{r['step_s_back_to_back'] * 1e3:,.1f} | {r['tokens_per_s']:,.0f} | {pct(r['mfu'])} | "
                 f"{pct(r['mfu_vs_matmul'])} | {'-' if peak is None else f'{peak / 2**30:.2f}'} | "
                 f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
  dec = [r for r in records if r["kind"] == "decode"]
  if dec:
    lines += ["", "| decode row | attention (block) | tokens/s (median, spread) | HBM roofline tokens/s (cache so "
              "far) | of it | roofline over the whole cache buffer | of it | over the filled blocks | of it |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in dec:
      if "error" in r:
        lines.append(f"| {r['name']} | | failed: {r['error'][:160]} | | | | | | |")
      else:
        how = r.get("resolved", {})
        lines.append(f"| {r['name']} | {how.get('decode_attention', '-')} ({how.get('block', '-')}) | "
                     f"{r['tokens_per_s']:,.0f} ({r['spread']:.1%}) | "
                     f"{r.get('roofline_tokens_per_s', float('nan')):,.0f} | {pct(r.get('of_roofline'))} | "
                     f"{r.get('roofline_allocated_tokens_per_s', float('nan')):,.0f} | "
                     f"{pct(r.get('of_roofline_allocated'))} | "
                     f"{r.get('roofline_blocks_tokens_per_s', float('nan')):,.0f} | "
                     f"{pct(r.get('of_roofline_blocks'))} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--set", default="v5e", help=f"one or more (comma-separated) of {', '.join(SETS)}")
  ap.add_argument("--only", default=None, help="comma-separated row names of the set")
  ap.add_argument("--out", default=None, help="append each row's JSON line here as it finishes")
  ap.add_argument("--steps", type=int, default=6, help="timed steps per train row (singles, then back to back)")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--decode-reps", type=int, default=3)
  ap.add_argument("--matmul-n", type=int, default=None, help="the bf16 matmul's size (default 8192 on TPU, 512 else)")
  ap.add_argument("--profile", default=None, help="a folder: a jax.profiler trace of 3 steps of each train row "
                  "and of one more generate call of each decode row (FOLDER/ROW), summarized by "
                  "benchmarks/profile_summary.py")
  ap.add_argument("--profile-only", default=None, help="comma-separated rows to trace (default: every train row)")
  args = ap.parse_args(argv)
  sets = args.set.split(",")
  if any(n not in SETS for n in sets):
    print(f"--set: no set {next(n for n in sets if n not in SETS)!r} (sets: {', '.join(SETS)})", file=sys.stderr)
    return 2
  rows = [r for n in sets for r in SETS[n]]
  if args.only:
    names = args.only.split(",")
    unknown = [n for n in names if n not in {r.name for r in rows}]
    if unknown:
      print(f"--only: no row {unknown[0]!r} in set {args.set} (rows: {', '.join(r.name for r in rows)})",
            file=sys.stderr)
      return 2
    rows = [next(r for r in rows if r.name == n) for n in names]  # in the order given
  records = run(rows, args.out, args.steps, args.warmup, args.decode_reps, args.matmul_n, args.profile,
                log=lambda line: print(line, flush=True),
                profile_rows=set(args.profile_only.split(",")) if args.profile_only else None)
  print(table(records))
  return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
  sys.exit(main())
