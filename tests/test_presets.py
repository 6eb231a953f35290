"""Real presets are shape-true: parameter counts under jax.eval_shape equal the published counts.

Each published count is recomputed here from the values in the model's official config.json (the
Hugging Face repos mistralai/Mistral-7B-v0.1, Qwen/Qwen3-0.6B, Qwen/Qwen3-8B,
meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B, mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-30B-A3B), so the number is derived, not copied. For Qwen3-0.6B the model card's "0.6B"
rounds 596,049,920 (tied head; 751,632,384 if untied); Mixtral 8x7B's "46.7B" and Qwen3-30B-A3B's
"30.5B" are the counts below.
"""
from __future__ import annotations

import math

import jax
import pytest

from meshlm import load_config
from meshlm.models import init_params
from meshlm.models.ffns.moe import knobs as moe_knobs
from meshlm.models.mixers.mla import knobs as mla_knobs
from meshlm.models.mixers import gdn as gdn_mixer


def experts_of(m) -> tuple:
  """(num_experts, mlp_dim, shared_expert_mlp_dim) of the moe part's knobs; (0, None, None) for a model without it."""
  if "moe" not in m.parts:
    return 0, None, None
  own = moe_knobs(m)
  return own.num_experts, own.mlp_dim, own.shared_expert_mlp_dim

# The config.json fields that fix the parameter count.
OFFICIAL = {
    "mistral-7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                       qk_norm=False, published=7_241_732_096),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
                       qk_norm=True, published=596_049_920),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
                     qk_norm=True, published=8_190_735_360),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=128, intermediate_size=11008, tie_word_embeddings=False,
                      qk_norm=False, published=6_738_415_616),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                      qk_norm=False, published=8_030_261_248),
    # Mixture of experts: every layer's MLP is num_experts experts of expert_size plus a router.
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                         qk_norm=False, num_experts=8, expert_size=14336, published=46_702_792_704),
    "qwen3-moe-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, intermediate_size=6144, tie_word_embeddings=False,
                              qk_norm=True, num_experts=128, expert_size=768, published=30_532_122_624),
}


def count_from_config(c: dict) -> int:
  """Llama-like decoder: embeddings, q/k/v/o, SwiGLU, two RMSNorms per layer (+ q/k norms), final norm, head.
  MoE (every layer): the SwiGLU is num_experts SwiGLUs of expert_size plus a [D, E] router."""
  D, V, L, N, K, H, F = (c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["num_attention_heads"],
                         c["num_key_value_heads"], c["head_dim"], c["intermediate_size"])
  attn = D * N * H + 2 * D * K * H + N * H * D
  mlp = c["num_experts"] * 3 * D * c["expert_size"] + D * c["num_experts"] if "num_experts" in c else 3 * D * F
  layer = attn + mlp + 2 * D + (2 * H if c["qk_norm"] else 0)
  return V * D + L * layer + D + (0 if c["tie_word_embeddings"] else D * V)


# Gated DeltaNet hybrids (issue 20): config.json (text_config) fields of Qwen/Qwen3-Next-80B-A3B-Instruct,
# Qwen/Qwen3.5-27B and Qwen/Qwen3.5-397B-A17B. Their model cards give rounded totals only (80B, 27B, 397B, which
# also count the MTP head and, for Qwen3.5, the vision tower, neither of which meshlm builds); `count` is the text
# model's exact count recomputed below from these fields, and docs/gdn.md lists both.
HYBRID = {
    "qwen3-next-80b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, intermediate_size=5120, full_attention_interval=4,
                               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512, card=80e9,
                               count=79_674_391_296),
    "qwen3.5-27b": dict(vocab_size=248320, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, intermediate_size=17408, full_attention_interval=4,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, card=27e9, count=26_895_998_464),
    "qwen3.5-397b-a17b": dict(vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                              num_key_value_heads=2, head_dim=256, intermediate_size=1024, full_attention_interval=4,
                              linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024, card=397e9,
                              count=396_346_350_336),
}


def count_hybrid(c: dict) -> int:
  """Qwen3-Next / Qwen3.5 text model: gated attention (q_proj twice as wide, q/k norms) on every
  full_attention_interval-th layer, Gated DeltaNet (in_proj_qkvz or in_proj_qkv/z/b/a: the same count; a conv of
  conv_dim channels, A_log and dt_bias per value head, a norm of value_head_dim, out_proj) elsewhere; a SwiGLU, or
  num_experts experts + a router + a shared expert and its [D, 1] gate; two RMSNorms per layer, final norm, head."""
  D, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
  N, K, H = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  attn = D * N * H * 2 + 2 * D * K * H + N * H * D + 2 * H
  kh, vh, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                    c["linear_value_head_dim"])
  conv_dim = 2 * kh * dk + vh * dv
  gdn = D * (conv_dim + vh * dv + 2 * vh) + conv_dim * c["linear_conv_kernel_dim"] + 2 * vh + dv + vh * dv * D
  if "num_experts" in c:
    E, F, S = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    mlp = E * 3 * D * F + D * E + 3 * D * S + D
  else:
    mlp = 3 * D * c["intermediate_size"]
  n_full = L // c["full_attention_interval"]
  return V * D + n_full * attn + (L - n_full) * gdn + L * (mlp + 2 * D) + D + D * V


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_preset_parameter_count(name):
  official = HYBRID[name]
  count_from_config = count_hybrid(official)
  assert count_from_config == official["count"] and abs(count_from_config / official["card"] - 1) < 0.01
  m = load_config(f"model={name}").model
  assert (m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.full_attention_interval,
          gdn_mixer.knobs(m).key_heads, gdn_mixer.knobs(m).value_heads, gdn_mixer.knobs(m).key_head_dim,
          gdn_mixer.knobs(m).value_head_dim, gdn_mixer.knobs(m).conv_kernel_dim) == tuple(official[k] for k in (
              "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"))
  assert experts_of(m) == (
      official.get("num_experts", 0), official.get("moe_intermediate_size"),
      official.get("shared_expert_intermediate_size"))
  assert m.partial_rotary_factor == 0.25 and m.rope_theta == 1e7 and not m.tie_embeddings
  shapes = jax.eval_shape(lambda k: init_params(load_config(f"model={name}"), k), jax.random.key(0))
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == official["count"]


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_real_preset_parameter_count(name):
  official = OFFICIAL[name]
  assert count_from_config(official) == official["published"]
  cfg = load_config(f"model={name}")
  m = cfg.model
  assert (m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim,
          m.tie_embeddings, m.qk_norm) == tuple(official[k] for k in (
              "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "tie_word_embeddings", "qk_norm"))
  assert experts_of(m)[:2] == (official.get("num_experts", 0), official.get("expert_size"))
  shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == official["published"]


def test_real_preset_details():
  m = load_config("model=mistral-7b").model
  assert m.family == "mistral" and m.sliding_window == 4096 and m.rope_theta == 10000.0
  for name in ("qwen3-0.6b", "qwen3-8b"):
    m = load_config(f"model={name}").model
    assert m.family == "qwen3" and m.rope_theta == 1_000_000.0 and m.norm_eps == 1e-6 and m.sliding_window is None


def test_real_moe_preset_details():
  m = load_config("model=mixtral-8x7b").model
  assert m.family == "mixtral" and moe_knobs(m).num_experts_per_tok == 2 and m.sliding_window is None
  assert m.rope_theta == 1_000_000.0
  m = load_config("model=qwen3-moe-30b-a3b").model
  assert m.family == "qwen3_moe" and moe_knobs(m).num_experts_per_tok == 8 and moe_knobs(m).norm_topk_prob
  assert m.decoder_sparse_step == 1 and m.mlp_only_layers == [] and m.norm_eps == 1e-6


@pytest.mark.parametrize("name, family", [("mistral-tiny", "mistral"), ("qwen3-tiny", "qwen3"),
                                          ("llama3-tiny", "llama"), ("llama2-tiny", "llama"),
                                          ("mixtral-tiny", "mixtral"), ("qwen3-moe-tiny", "qwen3_moe"),
                                          ("qwen3-next-tiny", "qwen3_next"), ("qwen3.5-tiny", "qwen3_5"),
                                          ("deepseek-v3-tiny", "deepseek_v3"),
                                          ("qwen3.5-moe-tiny", "qwen3_5_moe")])
def test_tiny_presets(name, family):
  cfg = load_config(f"model={name}")
  assert cfg.model.family == family
  if family == "mistral":
    assert cfg.model.sliding_window < cfg.train.seq_len  # the window must bite in training
  if family == "qwen3":
    assert cfg.model.qk_norm and cfg.model.tie_embeddings
  if name == "llama3-tiny":
    assert cfg.model.rope_scaling["original_max_position"] < cfg.train.seq_len
  if family == "mixtral":
    own = moe_knobs(cfg.model)
    assert cfg.model.sliding_window < cfg.train.seq_len and own.num_experts_per_tok < own.num_experts
  if family == "qwen3_moe":
    from meshlm.models.decoder import plan
    assert set(plan(cfg).kinds) == {"dense", "moe"}  # both layer kinds in one model
  if family.startswith("qwen3_5") or family == "qwen3_next":
    from meshlm.models.decoder import plan
    assert plan(cfg).kinds == ("linear_attn",) * 3 + ("full_attn",)  # 3 linear + 1 full
    assert cfg.train.seq_len % gdn_mixer.knobs(cfg.model).chunk_size == 0
  if family == "deepseek_v3":
    from meshlm.models.decoder import plan
    lp = plan(cfg)
    assert lp.kinds == ("dense", "moe", "moe") and lp.prefix == 1 and lp.groups == 2  # dense prefix, MoE scan
    m, lat = cfg.model, mla_knobs(cfg.model)
    assert lat.q_lora_rank and lat.v_head_dim != lat.qk_nope_head_dim + lat.qk_rope_head_dim and lat.rope_interleave
    # YaRN on, and training runs past the original context
    assert m.rope_scaling["factor"] > 1 and m.rope_scaling["mscale_all_dim"]
    assert m.rope_scaling["original_max_position"] < cfg.train.seq_len
    assert 1 < moe_knobs(m).n_group and moe_knobs(m).topk_group < moe_knobs(m).n_group


# DeepSeek-V3 (issue 21): deepseek-ai/DeepSeek-V3 config.json. 671,026,419,200 = the 61 layers, embeddings and
# head, and the 58 MoE layers' 256 routing-bias entries (e_score_correction_bias: model state, not a parameter);
# not the 14B multi-token-prediction module (num_nextn_predict_layers), which meshlm does not build.
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                   first_k_dense_replace=3, tie_word_embeddings=False, published=671_026_419_200)


def count_deepseek_v3(c: dict) -> int:
  """MLA (q_a, q_a norm, q_b, kv_a, kv_a norm, kv_b, o) and two RMSNorms per layer; the first k layers a dense
  SwiGLU, the rest E routed SwiGLU experts, a [D, E] router, the routing bias [E] and the shared experts."""
  D, V, L, N = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["num_attention_heads"]
  Rq, Rkv, Hn, Hr, Hv = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                        "v_head_dim"))
  attn = D * Rq + Rq + Rq * N * (Hn + Hr) + D * (Rkv + Hr) + Rkv + Rkv * N * (Hn + Hv) + N * Hv * D
  E, F = c["n_routed_experts"], c["moe_intermediate_size"]
  moe = E * 3 * D * F + D * E + E + 3 * D * F * c["n_shared_experts"]
  k = c["first_k_dense_replace"]
  return V * D * 2 + D + L * (attn + 2 * D) + k * 3 * D * c["intermediate_size"] + (L - k) * moe


def test_deepseek_v3_preset_parameter_count():
  c = DEEPSEEK_V3
  assert count_deepseek_v3(c) == c["published"]
  cfg = load_config("model=deepseek-v3")
  m, own, lat = cfg.model, moe_knobs(cfg.model), mla_knobs(cfg.model)
  assert (m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, lat.q_lora_rank, lat.kv_lora_rank,
          lat.qk_nope_head_dim, lat.qk_rope_head_dim, lat.v_head_dim, m.mlp_dim, own.mlp_dim, own.num_experts,
          own.num_experts_per_tok, own.n_group, own.topk_group, own.routed_scaling_factor, m.first_k_dense_replace,
          m.tie_embeddings) == tuple(c[k] for k in (
              "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
              "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
              "first_k_dense_replace", "tie_word_embeddings"))
  assert own.shared_expert_mlp_dim == c["n_shared_experts"] * c["moe_intermediate_size"]
  assert m.rope_scaling["factor"] == 40 and m.rope_scaling["mscale_all_dim"] == 1.0 and m.max_position == 163840
  from meshlm.models.params import init_model_state
  shapes = jax.eval_shape(lambda k: (init_params(cfg, k), init_model_state(cfg, k)), jax.random.key(0))
  params, state = shapes
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(state)) == 58 * 256  # the routing bias
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == c["published"]
