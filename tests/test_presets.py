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
  assert (m.num_experts, m.moe_mlp_dim) == (official.get("num_experts", 0), official.get("expert_size"))
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
  assert m.family == "mixtral" and m.num_experts_per_tok == 2 and m.sliding_window is None
  assert m.rope_theta == 1_000_000.0
  m = load_config("model=qwen3-moe-30b-a3b").model
  assert m.family == "qwen3_moe" and m.num_experts_per_tok == 8 and m.norm_topk_prob
  assert m.decoder_sparse_step == 1 and m.mlp_only_layers == [] and m.norm_eps == 1e-6


@pytest.mark.parametrize("name, family", [("mistral-tiny", "mistral"), ("qwen3-tiny", "qwen3"),
                                          ("llama3-tiny", "llama"), ("llama2-tiny", "llama"),
                                          ("mixtral-tiny", "mixtral"), ("qwen3-moe-tiny", "qwen3_moe")])
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
    assert cfg.model.sliding_window < cfg.train.seq_len and cfg.model.num_experts_per_tok < cfg.model.num_experts
  if family == "qwen3_moe":
    from meshlm.models.decoder import plan
    assert set(plan(cfg).kinds) == {"dense", "moe"}  # both layer kinds in one model
