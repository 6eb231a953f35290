"""Regenerates tests/fixtures/hf/<name>/: tiny random Hugging Face models with reference outputs.

torch and transformers are not meshlm dependencies; install them in a separate venv (pin torch on
the same command line so pip takes the CPU build):

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
  /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py            # all fixtures, then the export check
  /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py --check     # only the export check

Each fixture directory holds what `save_pretrained(..., safe_serialization=True)` writes
(config.json, model.safetensors, generation_config.json) plus `reference.npz`:

  input_ids  int32   [B, T]        random tokens
  logits     float32 [B, T, V]     model(input_ids).logits, float32, eager attention
  hidden     float32 [L, B, T, D]  hidden[i] is the output of decoder layer i (model.model.layers[i]),
                                   captured with a forward hook: the residual stream before the
                                   final norm. (`output_hidden_states` has L + 1 entries, the
                                   embeddings first, and its last one is taken after the final norm,
                                   so it cannot give the last layer's own output.)
  MoE fixtures also:
  router_logits float32 [M, B*T, E] each MoE layer's router logits (output_router_logits=True)
  aux_loss     float32 []           transformers' load_balancing_loss_func over those layers

This is what `meshlm.forward(cfg, params, input_ids, return_hidden=True)` returns.

To be hard to pass by accident: norm weights get noise (also gemma's zero-centred ones), every
weight is redrawn with std 1/sqrt(fan_in) so attention is peaked and position-sensitive, sizes are
not powers of two (embed 45, vocab 151, mlp 56, head counts 9 and 3, head_dim != embed/heads for qwen3 and
gemma), T = 20 is longer than every sliding window (8), gemma2's soft caps are small enough to bite,
gemma3 has 7 layers (one 5 local : 1 global period plus a remainder layer) with different local and
global rope thetas, llama uses llama3 rope scaling with all three frequency bands in play, and qwen3
comes tied and untied. The MoE fixtures (mixtral, qwen3-moe*) have 5 experts of width 22: mixtral
slides (window 8); qwen3-moe renormalizes its top-2 weights, qwen3-moe-nonorm takes its top-3 weights
as they are and has a dense first layer (mlp_only_layers=[0]), and qwen3-moe-sparse2 has 5 layers with
every second one MoE (decoder_sparse_step=2). transformers 5 holds the experts fused in memory
(`mlp.experts.gate_up_proj` [E, 2F, D]) but save_pretrained writes one tensor per expert
(`block_sparse_moe.experts.{e}.w1`, `mlp.experts.{e}.gate_proj`), the Hub layout.

The Gated DeltaNet hybrids (qwen3-next, qwen3.5, qwen3.5-moe, qwen3.5-moe-vl) run T = 150 tokens, across
the chunk-64 boundaries of the chunked gated delta rule, on transformers' torch GDN path (the script refuses
to run with flash-linear-attention or kernels installed). They mix linear-attention and gated full-attention
layers in a repeating pattern, with zero-centred norms (noised like gemma's), the GDN's gated norm, A_log,
dt_bias and conv weights redrawn (A in [0.02, 0.6], so some heads remember past a chunk), partial rotary
(a quarter of each head), and more value heads than key heads (3 per key head for qwen3-next, whose fused
in_proj_qkvz / in_proj_ba group them per key head). qwen3-next and the qwen3.5 MoEs have 5 experts of width 22
plus a gated shared expert of width 30. qwen3.5-moe-vl is the published multimodal layout
(Qwen3_5MoeForConditionalGeneration): config.json nests the text model under text_config, its tensors sit under
`model.language_model.`, beside a tiny vision tower (`model.visual.*`) and the `mtp.*` tensors the Hub
checkpoints carry (transformers skips them on load); its experts are rewritten fused
(`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]), which transformers loads as well.
Its reference is the multimodal model's own text-only forward.

The DeepSeek-V3 fixtures (deepseek-v3, deepseek-v3-noqlora) run T = 96 tokens (one row) past YaRN's original
64 positions (factor 4, theta 100 and a rope width of 8, so the ramp has two fractional entries): q through q_a /
q_b or a plain q_proj; mscale 0.8 against mscale_all_dim 1.2 (the cos/sin factor and the softmax factor both
live), or both 1.0 as published; 8 experts in 4 groups keeping 2 (or one group), top-3 (top-2), a perturbed
e_score_correction_bias with experts 2 and 5 at -0.8 so that most tokens have a negative biased score, and on some
tokens transformers 5's -inf fill of the dropped groups and the 0.0 of transformers 4 / DeepSeek's remote code pick
different experts (deepseek_routing_checks counts them; meshlm imports model.parts.moe.router_group_mask=-inf,
transformers 5's rule); a dense first layer (two for noqlora), two shared experts' width, interleaved rope (transformers' default, which the published config relies on), and in deepseek-v3 eight
tensors of a multi-token-prediction layer 3 that transformers does not load. deepseek-v3-fp8 and
deepseek-v3-fp8-ue8m0 (make_fp8) are a one-layer model with a 576-row kv_a_proj_with_mqa, its layers' linear
weights quantized as DeepSeek's are (float8_e4m3fn, a float32 weight_scale_inv per 128 x 128 block, amax / 448,
or rounded up to a power of two under scale_fmt ue8m0), with original.npz holding the weights before quantizing;
transformers does not load these. deepseek-v3-yarn.npz (make_yarn_rows) holds transformers'
DeepseekV3RotaryEmbedding cos and sin at 14 positions of the published 163,840.

The export check: for every fixture (a fixture whose family meshlm has not registered fails), meshlm
(run with the project venv, `--meshlm-python`) converts the fixture HF -> meshlm -> HF with `meshlm
convert`; transformers loads that export and must reproduce the reference logits exactly (the export
holds the fixture's tensors bit for bit), with the fixture's token ids and generation config. A multimodal
fixture's export is its text model (Qwen3_5MoeForCausalLM, model.layers.*, one tensor per expert, no vision
tower or mtp), which must reproduce the multimodal model's text-only logits exactly too.

The preset export check: each tiny GDN preset (qwen3-next-tiny, qwen3.5-tiny, qwen3.5-moe-tiny) and
deepseek-v3-tiny (its routing bias drawn at random), randomly
initialized by meshlm and never a Hugging Face model, is exported with `hf.save`; transformers loads it in float32
and float64, and meshlm's float32 logits (T = 150) must be within 3x transformers' own float32 error of the
float64 logits (with meshlm's init, these models' float32 noise is up to ~1.5e-5, above the fixtures' 1e-5).

The fine-tune check (docs/hf.md, "Fine-tuning a Hugging Face model in one command"): the llama fixture
plus a small word-level tokenizer.json is fine-tuned for 5 steps by `meshlm train model=DIR`, the last
checkpoint is exported with `meshlm convert meshlm-to-hf`, and transformers loads the export: its
logits must equal meshlm's forward of the same export (max |a - b| / max |b| <= 1e-5), its weights
must differ from the fixture's (it trained), and its token ids and generation config must be the
fixture's.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf"
B, T = 2, 20
SEED = 1234

# Shared sizes: nothing a power of two, odd head counts with GQA (9 query heads on 3 kv heads).
BASE = dict(vocab_size=151, hidden_size=45, intermediate_size=56, num_hidden_layers=2, num_attention_heads=9,
            num_key_value_heads=3, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
GDN_ROPE = dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.25)
GDN_ATTN = dict(num_attention_heads=9, num_key_value_heads=3, rope_parameters=GDN_ROPE)
GDN_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=22, shared_expert_intermediate_size=30,
               norm_topk_prob=True)
# Multi-token-prediction tensors as the Hub's qwen3-next / qwen3.5 checkpoints carry them (name -> shape, D = 45),
# added to the multimodal fixture: transformers skips them on load, and so must meshlm.
MTP = {"mtp.fc.weight": (45, 90), "mtp.norm.weight": (45,), "mtp.pre_fc_norm_embedding.weight": (45,),
       "mtp.pre_fc_norm_hidden.weight": (45,), "mtp.layers.0.input_layernorm.weight": (45,),
       "mtp.layers.0.mlp.gate.weight": (5, 45)}

# DeepSeek-V3 (MLA + MoE with shared experts): 9 heads of q/k width 8 + 8 (nope + rope) and v width 10, a kv latent of
# 14, 8 experts of width 22 and two shared ones (width 44).
DEEPSEEK = dict({k: v for k, v in BASE.items() if k not in ("num_key_value_heads", "head_dim")}, num_hidden_layers=3,
                num_attention_heads=9, num_key_value_heads=9, kv_lora_rank=14, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=10, n_routed_experts=8, moe_intermediate_size=22, n_shared_experts=2,
                max_position_embeddings=256, num_nextn_predict_layers=1)
# theta 100 with a rope width of 8 over an original context of 64: YaRN's ramp is (0, 1/3, 2/3, 1), one frequency
# kept, one divided by the factor, two blended.
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=64,
                     beta_fast=32.0, beta_slow=1.0)
# Multi-token-prediction tensors of the published checkpoints' layer 61 (here layer 3, past num_hidden_layers = 3):
# transformers does not load them, and neither does meshlm.
DEEPSEEK_MTP = {"model.layers.3.embed_tokens.weight": (151, 45), "model.layers.3.enorm.weight": (45,),
                "model.layers.3.hnorm.weight": (45,), "model.layers.3.eh_proj.weight": (45, 90),
                "model.layers.3.shared_head.norm.weight": (45,), "model.layers.3.input_layernorm.weight": (45,),
                "model.layers.3.mlp.gate.weight": (8, 45), "model.layers.3.mlp.gate.e_score_correction_bias": (8,)}

# name -> (config class, AutoModel architecture, config kwargs)
FIXTURES = {
    "llama": ("LlamaConfig", dict(
        BASE,
        # wavelengths 6.3, 19.9, 62.8, 199 against an original context of 64: one kept, two in the
        # smoothed band, one divided by the factor.
        rope_parameters=dict(rope_type="llama3", rope_theta=100.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(BASE, sliding_window=8, rope_parameters=dict(rope_type="default",
                                                                                  rope_theta=1000.0))),
    "qwen3": ("Qwen3Config", dict(BASE, head_dim=12, rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    "qwen3-tied": ("Qwen3Config", dict(BASE, head_dim=12, tie_word_embeddings=True,
                                       rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    # gemma-2b style multi-query attention, head_dim != embed / heads.
    "gemma": ("GemmaConfig", dict(BASE, num_attention_heads=5, num_key_value_heads=1, head_dim=12,
                                  tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                                  rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    "gemma2": ("Gemma2Config", dict(BASE, num_hidden_layers=3, tie_word_embeddings=True,
                                    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                    sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    "gemma3": ("Gemma3TextConfig", dict(BASE, num_hidden_layers=7, intermediate_size=40, tie_word_embeddings=True,
                                        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                        sliding_window=8, sliding_window_pattern=6,
                                        rope_parameters={
                                            "full_attention": dict(rope_type="linear", factor=4.0,
                                                                   rope_theta=10000.0),
                                            "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
    # Mixture of experts: 5 experts of width 22, top-2, every expert saved as its own tensors.
    "mixtral": ("MixtralConfig", dict(BASE, intermediate_size=22, num_local_experts=5, num_experts_per_tok=2,
                                      sliding_window=8, rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    "qwen3-moe": ("Qwen3MoeConfig", dict(BASE, head_dim=12, num_experts=5, num_experts_per_tok=2,
                                         moe_intermediate_size=22, norm_topk_prob=True,
                                         rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    # Top-3 weights used as the softmax gives them, and a dense first layer (mlp_only_layers).
    "qwen3-moe-nonorm": ("Qwen3MoeConfig", dict(BASE, num_hidden_layers=3, head_dim=12, num_experts=5,
                                                num_experts_per_tok=3, moe_intermediate_size=22,
                                                norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True,
                                                rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    # Every second layer MoE: dense, moe, dense, moe, dense (two kinds in one scanned period, plus a rest).
    "qwen3-moe-sparse2": ("Qwen3MoeConfig", dict(BASE, num_hidden_layers=5, head_dim=12, num_experts=5,
                                                 num_experts_per_tok=2, moe_intermediate_size=22, norm_topk_prob=True,
                                                 decoder_sparse_step=2, intermediate_size=30,
                                                 rope_parameters=dict(rope_type="default", rope_theta=1000.0))),
    # Gated DeltaNet hybrids: linear-attention (GDN) layers between gated full-attention layers, zero-centred
    # norms, partial rotary (a quarter of each head), more value heads than key heads.
    # qwen3-next: fused in_proj_qkvz / in_proj_ba grouped per key head (3 value heads per key head), every layer
    # MoE with a gated shared expert; lin, full, lin, full (a period of 2, scanned twice).
    "qwen3-next": ("Qwen3NextConfig", dict(
        BASE, num_hidden_layers=4, full_attention_interval=2, head_dim=24, **GDN_ATTN,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=10, linear_value_head_dim=14,
        **GDN_MOE)),
    # qwen3.5: separate in_proj_qkv / z / b / a, dense MLPs, tied; lin, lin, full twice.
    "qwen3.5": ("Qwen3_5TextConfig", dict(
        BASE, num_hidden_layers=6, full_attention_interval=3, num_attention_heads=3, num_key_value_heads=1,
        head_dim=16, tie_word_embeddings=True, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=12, linear_value_head_dim=10, rope_parameters=GDN_ROPE)),
    # qwen3.5-moe: every layer MoE (always renormalized top-k) with a shared expert; the published 3 : 1 pattern.
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(
        {k: v for k, v in BASE.items() if k != "intermediate_size"}, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=24, linear_num_key_heads=3, linear_num_value_heads=6,
        linear_key_head_dim=8, linear_value_head_dim=12, rope_parameters=GDN_ROPE,
        **{k: v for k, v in GDN_MOE.items() if k != "norm_topk_prob"})),
    # The published multimodal layout (Qwen3_5MoeForConditionalGeneration): config.json nests the text model under
    # text_config, its tensors sit under model.language_model., beside a (tiny) vision tower model.visual.* and, as
    # in the Hub checkpoints, multi-token-prediction tensors mtp.* that transformers does not load. The experts
    # are stored fused here (mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F]).
    "qwen3.5-moe-vl": ("Qwen3_5MoeConfig", dict(
        text_config=dict({k: v for k, v in BASE.items() if k != "intermediate_size"}, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], **GDN_ATTN, head_dim=24,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=10,
                         linear_value_head_dim=14, **{k: v for k, v in GDN_MOE.items() if k != "norm_topk_prob"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=45,
                           patch_size=4, num_position_embeddings=16))),
    # DeepSeek-V3: multi-head latent attention (q through a low-rank q_a / q_b with its norm, or a plain q_proj), YaRN
    # with factor 4 on a rope width of 8 whose ramp has two fractional entries, sequences of 96 against an original
    # context of 64, 8 experts in 4 groups of 2, top-3 of the top-2 groups' experts, weighted by the unbiased sigmoid
    # scores, a perturbed routing bias (e_score_correction_bias) that makes some biased scores negative, two shared
    # experts' width, a dense first layer, interleaved rope as the published config has it (rope_interleave is not
    # in it: transformers' default, true), and one multi-token-prediction layer's tensors (model.layers.3.*) that
    # transformers does not load.
    "deepseek-v3": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=18, n_group=4, topk_group=2, num_experts_per_tok=3,
                                            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                            rope_parameters=dict(DEEPSEEK_YARN, mscale=0.8, mscale_all_dim=1.2))),
    # The DeepSeek-V2-Lite shape of attention (no q_lora_rank), equal mscale and mscale_all_dim (the published V3's
    # choice: cos/sin unscaled, only the softmax scale moves), one group, top-2 weights taken as they come
    # (norm_topk_prob false), routed_scaling_factor 1.5, two dense layers of three.
    "deepseek-v3-noqlora": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1,
                                                    num_experts_per_tok=2, first_k_dense_replace=2,
                                                    routed_scaling_factor=1.5, norm_topk_prob=False,
                                                    rope_parameters=dict(DEEPSEEK_YARN, mscale=1.0,
                                                                         mscale_all_dim=1.0))),
}
# Tokens per row: the GDN fixtures cross the chunk-64 boundaries of the chunked gated delta rule; the DeepSeek ones
# run past YaRN's original context (64).
LENGTHS = {**{name: 150 for name in ("qwen3-next", "qwen3.5", "qwen3.5-moe", "qwen3.5-moe-vl")},
           "deepseek-v3": 96, "deepseek-v3-noqlora": 96}
# Rows per batch where not B (the DeepSeek fixtures' long rows: one each).
BATCH = {"deepseek-v3": 1, "deepseek-v3-noqlora": 1}


MOE_TYPES = ("mixtral", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe", "deepseek_v3")


def eager(model_type: str) -> dict:
  """from_config / from_pretrained kwargs for the plain torch paths: eager attention, and for MoE models the
  eager per-expert loop (transformers' default grouped_mm needs 16-byte strides, which odd sizes lack)."""
  return dict(attn_implementation="eager", dtype=torch.float32,
              **(dict(experts_implementation="eager") if model_type in MOE_TYPES else {}))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
  """max |a - b| / max |b|, the measure tests/test_hf.py uses."""
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def is_multimodal(config) -> bool:
  return hasattr(config, "text_config")


def decoder_layers(model):
  """The text model's decoder layers (model.model.language_model.layers in the multimodal layout)."""
  inner = model.model
  return (inner.language_model if hasattr(inner, "language_model") else inner).layers


def build(name: str):
  cls_name, kwargs = FIXTURES[name]
  config = getattr(transformers, cls_name)(**kwargs)
  config._attn_implementation = "eager"
  torch.manual_seed(SEED + sum(map(ord, name)))
  auto = transformers.AutoModelForImageTextToText if is_multimodal(config) else transformers.AutoModelForCausalLM
  model = auto.from_config(config, **eager(config.model_type))
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("A_log"):
        # GDN decay rates A = exp(A_log): transformers draws A in [0.01, 16], where most heads forget within a
        # token or two; [0.02, 0.6] keeps some heads' memory beyond a 64-token chunk, so the state carried from
        # chunk to chunk decides the outputs.
        p.copy_(torch.empty_like(p).uniform_(0.02, 0.6).log())
      elif p.ndim == 1:
        # Norm scales: ones (llama, the GDN's gated norm) or zeros (gemma's and qwen3-next's 1 + w) plus noise,
        # so a swapped or missing norm shows; likewise the GDN's dt_bias.
        p.add_(0.2 * torch.randn_like(p))
      elif "embed_tokens" in pname:
        p.copy_(torch.randn_like(p))
      else:
        # Linear weights [out, in], transformers 5's fused experts [E, out, in] and the GDN's depthwise conv
        # [C, 1, taps]: fan-in is the last dim.
        p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    for bname, b in model.named_buffers():
      if bname.endswith("e_score_correction_bias"):
        # DeepSeek's routing bias: small shifts that reorder close experts; with 8 experts, experts 3 and 4 up
        # (+0.9) and 2 and 5 down (-0.7), so groups 1 and 2 are usually the kept ones and the biased scores s + b
        # of experts 2 and 5 are negative whenever s < 0.7. When both are and the top-k reaches them, transformers 5
        # (the other groups at -inf) takes a negative kept expert while the 0.0 fill (transformers 4, DeepSeek's
        # remote code) takes a dropped one: deepseek_routing_checks() counts the tokens where the two differ, so the
        # fixture tells them apart (meshlm imports model.parts.moe.router_group_mask=-inf).
        b.copy_(0.2 * torch.rand_like(b) - 0.1)
        b[2] = -0.7
        if b.numel() == 8:
          b[3], b[4], b[5] = 0.9, 0.9, -0.7
  model.eval()
  return model


def deepseek_choice(biased, cfg, fill: float):
  """The experts transformers' DeepseekV3TopkRouter picks from the biased scores [tokens, E], sorted, with the groups
  left out scoring `fill`."""
  n, per = cfg.n_group, cfg.n_routed_experts // cfg.n_group
  groups = biased.view(-1, n, per).topk(2, dim=-1)[0].sum(-1)  # [tokens, n]
  keep = torch.zeros_like(groups).scatter_(1, groups.topk(cfg.topk_group, dim=-1)[1], 1.0)
  keep = keep.unsqueeze(-1).expand(-1, n, per).reshape(-1, cfg.n_routed_experts).bool()
  return biased.masked_fill(~keep, fill).topk(cfg.num_experts_per_tok, dim=-1)[1].sort(-1)[0]


def deepseek_routing_checks(model, ref: dict) -> str:
  """For a DeepSeek fixture, how often the bias changes the choice, some biased score is negative, and the groups
  left out scoring -inf (transformers 5, what the fixture runs) or 0.0 (transformers 4, DeepSeek's remote code)
  pick different experts. With more than one group, the fixture must tell the two conventions apart."""
  cfg = model.config
  moe = [layer.mlp.gate for layer in decoder_layers(model) if hasattr(layer.mlp, "gate")]
  changed = negative = fills = 0
  for gate, logits in zip(moe, ref["router_logits"]):
    s = torch.from_numpy(logits).float().sigmoid()  # [tokens, E]
    biased = s + gate.e_score_correction_bias
    chosen = deepseek_choice(biased, cfg, float("-inf"))
    fills += int((deepseek_choice(biased, cfg, 0.0) != chosen).any(-1).sum())
    changed += int((deepseek_choice(s, cfg, float("-inf")) != chosen).any(-1).sum())
    negative += int((biased < 0).any(-1).sum())
  assert cfg.n_group == 1 or fills > 0, "the -inf and 0.0 fills pick the same experts everywhere: change the bias"
  tokens = len(moe) * ref["router_logits"].shape[1]
  return (f"bias changes the experts of {changed}/{tokens} tokens, {negative}/{tokens} have a negative biased score, "
          f"the 0.0 fill would change {fills}/{tokens}")


def reference(model, vocab: int, layers: int, length: int = T, batch: int = B) -> dict[str, np.ndarray]:
  gen = np.random.default_rng(SEED)
  ids = gen.integers(0, vocab, size=(batch, length)).astype(np.int32)
  hidden: list[np.ndarray] = []

  def hook(_module, _args, out):
    h = out[0] if isinstance(out, tuple) else out
    hidden.append(h.detach().float().numpy().copy())

  handles = [layer.register_forward_hook(hook) for layer in decoder_layers(model)]
  moe = model.config.model_type in MOE_TYPES
  with torch.no_grad():
    out = model(torch.from_numpy(ids).long(), **(dict(output_router_logits=True) if moe else {}))
  logits = out.logits.float().numpy()
  for h in handles:
    h.remove()
  assert len(hidden) == layers, (len(hidden), layers)
  ref = {"input_ids": ids, "logits": logits.astype(np.float32), "hidden": np.stack(hidden).astype(np.float32)}
  if moe:
    ref["router_logits"] = np.stack([r.float().numpy() for r in out.router_logits]).astype(np.float32)
    if out.aux_loss is not None:  # DeepseekV3ForCausalLM has none
      ref["aux_loss"] = np.float32(out.aux_loss.item())
  return ref


def fuse_experts_and_add_mtp(path: Path) -> None:
  """Rewrites a multimodal MoE fixture's safetensors as the Hub's checkpoints hold them: each layer's experts fused
  (save_pretrained writes one tensor per expert) and mtp.* tensors beside the model's."""
  from safetensors.torch import load_file, save_file
  tensors = load_file(path / "model.safetensors")
  out, experts = {}, {}
  for name, w in tensors.items():
    head, sep, rest = name.partition(".mlp.experts.")
    if sep and rest.split(".")[0].isdigit():
      e, proj = rest.split(".")[:2]
      experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = w
    else:
      out[name] = w
  for head, projs in experts.items():
    n = len(projs["gate_proj"])
    gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)]
    out[head + ".mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()  # [E, 2F, D]
    out[head + ".mlp.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)]).contiguous()
  gen = torch.Generator().manual_seed(SEED)
  for name, shape in MTP.items():
    out[name] = torch.randn(shape, generator=gen)
  save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


def add_tensors(path: Path, extra: dict[str, tuple[int, ...]]) -> None:
  """Adds random tensors (name -> shape) to a fixture's model.safetensors, as checkpoints carry them beside the model
  (multi-token prediction)."""
  from safetensors.torch import load_file, save_file
  tensors = load_file(path / "model.safetensors")
  gen = torch.Generator().manual_seed(SEED)
  tensors.update({name: torch.randn(shape, generator=gen) for name, shape in extra.items()})
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def make(name: str) -> None:
  assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("kernels") is None, \
      "uninstall flash-linear-attention and kernels: the fixtures are made on transformers' torch GDN path"
  model = build(name)
  out = OUT / name
  if out.exists():
    shutil.rmtree(out)
  model.save_pretrained(out, safe_serialization=True)
  cfg = model.config
  text = cfg.get_text_config()
  if is_multimodal(cfg):
    fuse_experts_and_add_mtp(out)
  ref = reference(model, text.vocab_size, text.num_hidden_layers, LENGTHS.get(name, T), BATCH.get(name, B))
  np.savez(out / "reference.npz", **ref)
  note = ""
  if cfg.model_type == "deepseek_v3":
    note = deepseek_routing_checks(model, ref)
    if name == "deepseek-v3":
      add_tensors(out, DEEPSEEK_MTP)
  # Reload from disk: the saved files alone must reproduce the reference.
  again = type(model).from_pretrained(out, **eager(cfg.model_type))
  with torch.no_grad():
    logits = again(torch.from_numpy(ref["input_ids"]).long()).logits.float().numpy()
  assert np.array_equal(logits, ref["logits"]), f"{name}: reloaded model differs"
  size = sum(f.stat().st_size for f in out.iterdir())
  print(f"{name:14s} {type(model).__name__:34s} {text.num_hidden_layers} layers  {size / 1024:.0f} KiB  {note}")


# The fp8 fixtures: a one-layer DeepSeek-V3 whose kv_a_proj_with_mqa has 576 rows (kv latent 560 + rope 16), as the
# published one has (512 + 64), quantized as DeepSeek's checkpoints are: every linear weight of the layers except the
# router to float8_e4m3fn with a float32 weight_scale_inv per 128 x 128 block (the last row and column blocks
# partial). "deepseek-v3-fp8": scale = amax / 448, the first releases'; "deepseek-v3-fp8-ue8m0" (scale_fmt ue8m0,
# later releases): the scale rounded up to a power of two. original.npz (in deepseek-v3-fp8) holds the float32
# weights before quantizing.
FP8_CONFIG = dict({k: v for k, v in DEEPSEEK.items() if k != "num_nextn_predict_layers"}, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=560, qk_nope_head_dim=8,
                  qk_rope_head_dim=16, v_head_dim=8, q_lora_rank=None, n_routed_experts=4, moe_intermediate_size=16,
                  n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
                  num_nextn_predict_layers=0, rope_parameters=dict(rope_type="default", rope_theta=100.0))
FP8_BLOCK = 128
FP8_MAX = 448.0  # the largest float8_e4m3fn


def quantize_fp8(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
  """(float8_e4m3fn weight, float32 weight_scale_inv [ceil(out / 128), ceil(in / 128)]): each 128 x 128 block divided
  by its scale, amax / 448 (rounded up to a power of two with ue8m0), so that w ~ fp8 * scale."""
  out, inp = w.shape
  rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
  padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
  padded[:out, :inp] = w
  blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
  scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
  if ue8m0:
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
  q = (blocks / scale[:, None, :, None]).view(rows * FP8_BLOCK, cols * FP8_BLOCK)[:out, :inp]
  return q.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()


def make_fp8() -> None:
  from safetensors.torch import load_file, save_file
  config = transformers.DeepseekV3Config(**FP8_CONFIG)
  torch.manual_seed(SEED + 8)
  model = transformers.AutoModelForCausalLM.from_config(config, **eager("deepseek_v3"))
  with torch.no_grad():
    for pname, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / math.sqrt(p.shape[-1]))
      if p.ndim == 2 and "layers." in pname:
        # Each 128 x 128 block at its own scale (x 3 per row block, x 0.25 per column block), so a scale applied
        # to the wrong block shows.
        r, c = torch.meshgrid(torch.arange(p.shape[0]) // FP8_BLOCK, torch.arange(p.shape[1]) // FP8_BLOCK,
                              indexing="ij")
        p.mul_(3.0 ** r * 0.25 ** c)
  originals = {}
  for name, ue8m0 in (("deepseek-v3-fp8", False), ("deepseek-v3-fp8-ue8m0", True)):
    out = OUT / name
    if out.exists():
      shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tensors = load_file(out / "model.safetensors")
    for tname in sorted(tensors):
      w = tensors[tname]
      if tname.startswith("model.layers.") and w.ndim == 2 and not tname.endswith("mlp.gate.weight"):
        originals[tname] = w.numpy().copy()
        tensors[tname], tensors[tname + "_scale_inv"] = quantize_fp8(w, ue8m0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((out / "config.json").read_text())
    hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": [FP8_BLOCK, FP8_BLOCK], **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  np.savez(OUT / "deepseek-v3-fp8" / "original.npz", **originals)
  shapes = {k: tuple(v.shape) for k, v in originals.items() if "kv_a" in k}
  size = sum(f.stat().st_size for n in ("deepseek-v3-fp8", "deepseek-v3-fp8-ue8m0") for f in (OUT / n).iterdir())
  print(f"deepseek-v3-fp8(-ue8m0): {len(originals)} fp8 weights, {shapes}, {size / 1024:.0f} KiB")


# The YaRN rows: transformers' DeepseekV3RotaryEmbedding cos and sin at the bottom, middle and top of the published
# config's 163,840 positions (rope width 64, factor 40 over 4,096), and of the same config with mscale 0.8 against
# mscale_all_dim 1.2 (cos and sin then carry an attention factor).
YARN_ROWS = np.array([0, 1, 2, 3, 4095, 4096, 81918, 81919, 81920, 81921, 163836, 163837, 163838, 163839])
YARN_PUBLISHED = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def make_yarn_rows() -> None:
  out = {"positions": YARN_ROWS}
  for key, rope in (("published", YARN_PUBLISHED), ("mscale", dict(YARN_PUBLISHED, mscale=0.8, mscale_all_dim=1.2))):
    config = transformers.DeepseekV3Config(max_position_embeddings=163840, qk_rope_head_dim=64, rope_parameters=rope)
    emb = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    with torch.no_grad():
      cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.from_numpy(YARN_ROWS)[None].long())
    out[f"{key}_cos"], out[f"{key}_sin"] = cos[0].numpy(), sin[0].numpy()  # [P, 64]
    out[f"{key}_rope"] = np.array(json.dumps(rope))
  np.savez(OUT / "deepseek-v3-yarn.npz", **out)
  print(f"deepseek-v3-yarn.npz: {len(YARN_ROWS)} rows of 163,840, two configs")


def registered_families(meshlm_python: str) -> set[str]:
  code = "from meshlm.hf.io import families; print(' '.join(sorted(families())))"
  out = subprocess.run([meshlm_python, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
  return set(out.stdout.split())


def meshlm_cli(meshlm_python: str, *argv: str) -> None:
  res = subprocess.run([meshlm_python, "-m", "meshlm.cli", *argv], capture_output=True, text=True, cwd=ROOT)
  if res.returncode:
    raise SystemExit(f"meshlm {' '.join(argv[:2])} failed:\n{res.stderr}")


def hf_logits(path: Path, ids: np.ndarray):
  model_type = json.loads((path / "config.json").read_text())["model_type"]
  model = transformers.AutoModelForCausalLM.from_pretrained(path, **eager(model_type))
  with torch.no_grad():
    return model(torch.from_numpy(ids).long()).logits.float().numpy(), model


def ids_and_generation(export: Path, model, src: Path) -> list[str]:
  """What differs from the fixture in the loaded model's token ids and generation config."""
  fixture = json.loads((src / "config.json").read_text())
  fixture = fixture.get("text_config", fixture)  # a multimodal fixture's ids are its text model's
  gen = json.loads((src / "generation_config.json").read_text())
  bad = [k for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(model.config, k) != fixture[k]]
  bad += [f"generation_config.{k}" for k in ("bos_token_id", "eos_token_id", "pad_token_id")
          if getattr(model.generation_config, k) != gen.get(k)]
  if json.loads((export / "generation_config.json").read_text()) != gen:
    bad.append("generation_config.json")
  return bad


def check_export(name: str, meshlm_python: str) -> tuple[float, list[str]]:
  """HF fixture -> meshlm dir -> HF export with meshlm's CLI; transformers must reproduce the logits."""
  src = OUT / name
  ref = np.load(src / "reference.npz")
  with tempfile.TemporaryDirectory() as tmp:
    mid, hf = Path(tmp) / "meshlm", Path(tmp) / "hf"
    meshlm_cli(meshlm_python, "convert", "hf-to-meshlm", str(src), str(mid), "cpu_devices=1")
    meshlm_cli(meshlm_python, "convert", "meshlm-to-hf", str(mid), str(hf))
    logits, model = hf_logits(hf, ref["input_ids"])
    return rel_err(logits, ref["logits"]), ids_and_generation(hf, model, src)


MESHLM_LOGITS = """
import sys, numpy as np, jax
from meshlm import forward, hf
cfg, params = hf.load(sys.argv[1], "train.compute_dtype=float32", "cpu_devices=1")
ids = np.load(sys.argv[2])["input_ids"]
np.save(sys.argv[3], np.asarray(jax.jit(lambda p, x: forward(cfg, p, x))(params, ids)))
"""

MAKE_TOKENIZER = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(40)}, "</s>": 41}
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.add_special_tokens(["</s>"])
tok.save(sys.argv[1])
"""


MESHLM_PRESET_EXPORT = """
import sys, numpy as np, jax
from meshlm import forward, hf, load_config
from meshlm.models.params import init_model_state, init_params, merge_state
cfg = load_config("model=" + sys.argv[1], "train.compute_dtype=float32", "cpu_devices=1")
params = init_params(cfg, jax.random.key(0))
# The whole model tree: a preset with model state (deepseek-v3's routing bias, drawn here so it matters) has it beside.
state = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype),
                     init_model_state(cfg, jax.random.key(1)))
params = merge_state(params, state)
hf.save(cfg, params, sys.argv[2])
ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 150)).astype(np.int32)
np.savez(sys.argv[3], input_ids=ids, logits=np.asarray(jax.jit(lambda p, x: forward(cfg, p, x))(params, ids)))
"""
# meshlm's float32 logits against transformers' float64 ones, as a multiple of transformers' own float32 error there.
PRESET_FACTOR = 3.0


def check_preset_export(preset: str, meshlm_python: str) -> tuple[float, float, list[str]]:
  """A GDN preset that never came from Hugging Face (meshlm's random init, T = 150) exported by meshlm: transformers
  loads it, and meshlm's logits are as close to transformers' float64 logits as transformers' float32 ones are
  (PRESET_FACTOR). Returns (meshlm's rel err to float64, transformers float32's, problems)."""
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    subprocess.run([meshlm_python, "-c", MESHLM_PRESET_EXPORT, preset, str(tmp / "hf"), str(tmp / "ref.npz")],
                   check=True, cwd=ROOT, capture_output=True)
    ref = np.load(tmp / "ref.npz")
    ids = torch.from_numpy(ref["input_ids"]).long()
    model_type = json.loads((tmp / "hf" / "config.json").read_text())["model_type"]
    logits = {}
    for dtype in (torch.float32, torch.float64):
      kwargs = {**eager(model_type), "dtype": dtype}
      model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", **kwargs)
      with torch.no_grad():
        logits[dtype] = model(ids).logits.double().numpy()
    ours = rel_err(ref["logits"].astype(np.float64), logits[torch.float64])
    theirs = rel_err(logits[torch.float32], logits[torch.float64])
    bad = [] if ours <= PRESET_FACTOR * max(theirs, 1e-7) else [f"meshlm is {ours / theirs:.1f}x further from float64"]
    return ours, theirs, bad


GDN_PRESETS = ("qwen3-next-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny")
# deepseek-v3-tiny: MLA with YaRN past its original 64 positions, group-limited routing with a random routing bias.
PRESETS = GDN_PRESETS + ("deepseek-v3-tiny",)


def check_finetune(meshlm_python: str, steps: int = 5) -> tuple[float, list[str]]:
  """`meshlm train model=<HF llama dir>` for a few steps, export, load in transformers."""
  src = OUT / "llama"
  ref = np.load(src / "reference.npz")
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    model_dir = tmp / "llama-hf"
    shutil.copytree(src, model_dir)
    subprocess.run([meshlm_python, "-c", MAKE_TOKENIZER, str(model_dir / "tokenizer.json")], check=True)
    (tmp / "data").mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
      (tmp / "data" / f"{i}.txt").write_text(" ".join(f"w{j}" for j in rng.integers(0, 40, 200)))
    meshlm_cli(meshlm_python, "train", f"model={model_dir}", f"train.steps={steps}", "train.seq_len=16",
               "train.sample_tokens=0", "train.compute_dtype=float32", "train.learning_rate=1e-3", "cpu_devices=1",
               "data.source=text", f"data.path={tmp}/data/*.txt", f"run_dir={tmp / 'run'}")
    export = tmp / "export"
    meshlm_cli(meshlm_python, "convert", "meshlm-to-hf", str(tmp / "run" / "checkpoints" / str(steps)), str(export))
    logits, model = hf_logits(export, ref["input_ids"])
    subprocess.run([meshlm_python, "-c", MESHLM_LOGITS, str(export), str(src / "reference.npz"),
                    str(tmp / "meshlm.npy")], check=True, cwd=ROOT, capture_output=True)
    bad = ids_and_generation(export, model, src)
    if rel_err(logits, ref["logits"]) == 0.0:
      bad.append("weights (the export reproduces the fixture: nothing trained)")
    return rel_err(logits, np.load(tmp / "meshlm.npy")), bad


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("names", nargs="*", help=f"fixtures to make (default: all of {', '.join(FIXTURES)})")
  ap.add_argument("--check", action="store_true", help="skip generation; only run the export check")
  ap.add_argument("--meshlm-python", default=str(ROOT / ".venv" / "bin" / "python"),
                  help="a python that imports meshlm (the project venv)")
  args = ap.parse_args()
  names = args.names or list(FIXTURES)
  print(f"torch {torch.__version__}, transformers {transformers.__version__}")
  if not args.check:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
      make(name)
    if not args.names:
      make_fp8()
      make_yarn_rows()
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"fixtures: {total / 1024:.0f} KiB in {OUT.relative_to(ROOT)}")
  families = registered_families(args.meshlm_python)
  failed = []
  for name in names:
    model_type = json.loads((OUT / name / "config.json").read_text())["model_type"]
    if model_type not in families:
      print(f"export check {name:14s} FAIL: meshlm has no family for model_type={model_type!r}")
      failed.append(name)
      continue
    err, bad = check_export(name, args.meshlm_python)
    ok = err == 0.0 and not bad
    print(f"export check {name:14s} rel err {err:.2e}  {'ok' if ok else 'FAIL'} {' '.join(bad)}")
    if not ok:
      failed.append(name)
  for preset in PRESETS:
    ours, theirs, bad = check_preset_export(preset, args.meshlm_python)
    print(f"preset export check {preset}: rel err to transformers float64, meshlm {ours:.2e}, transformers float32 "
          f"{theirs:.2e}  {'ok' if not bad else 'FAIL'} {' '.join(bad)}")
    if bad:
      failed.append(preset)
  err, bad = check_finetune(args.meshlm_python)
  ok = err <= 1e-5 and not bad
  print(f"fine-tune check (llama, 5 steps): transformers vs meshlm on the export, rel err {err:.2e}  "
        f"{'ok' if ok else 'FAIL'} {' '.join(bad)}")
  if not ok:
    failed.append("fine-tune")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
