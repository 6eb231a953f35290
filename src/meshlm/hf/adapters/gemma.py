"""Hugging Face adapter for gemma (the block is models/gemma.py): config.json fields and tensor names."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps

HF_MODEL_TYPE = "gemma"
HF_ARCHITECTURES = ("GemmaForCausalLM",)
# transformers' GemmaConfig defaults, which it uses for any field a config.json leaves out.
HF_DEFAULTS = {"vocab_size": 256_000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
               "num_attention_heads": 16, "head_dim": 256, "num_key_value_heads": 16, "tie_word_embeddings": True,
               "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
# GemmaConfig rewrites the legacy hidden_act "gelu" to the tanh approximation, so "gelu" is tanh here.
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh", "silu": "silu"}


def shared_from_hf(hf: dict) -> dict:
  """The llama-like fields of a gemma-family config.json (already merged over its HF_DEFAULTS).

  maps.llama_like_from_hf insists on silu; the gemma families read their activation themselves, so it
  is handed silu to pass.
  """
  if hf.get("use_bidirectional_attention"):
    raise ConfigError("config.json: use_bidirectional_attention=true is not supported (meshlm decoders are causal)")
  return maps.llama_like_from_hf({**hf, "hidden_act": "silu"})


def activation_from_hf(hf: dict, key: str, table: dict[str, str]) -> str:
  act = hf.get(key)
  if act not in table:
    raise ConfigError(f"config.json: {key}={act!r} is not supported; expected one of {', '.join(table)}")
  return table[act]


def from_hf_config(hf: dict) -> dict:
  hf = {**HF_DEFAULTS, **hf}
  return {"family": "gemma", **shared_from_hf(hf),
          "hidden_activation": activation_from_hf(hf, "hidden_act", HF_ACTIVATIONS)}


def shared_to_hf(m: ModelConfig, act_key: str) -> dict:
  """llama-like config.json fields, with the activation under act_key instead of llama's hidden_act."""
  acts = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "silu": "silu"}
  out = maps.llama_like_to_hf(m)
  out.pop("hidden_act", None)
  out.pop("mlp_bias", None)  # not a gemma config field
  out[act_key] = acts[m.hidden_activation]
  return out


def to_hf_config(m: ModelConfig) -> dict:
  if m.context_pattern() != ("global",) or m.qk_norm or m.rope_local_theta is not None:
    raise ConfigError("model.sliding_window / layer_pattern / qk_norm / rope_local_theta: GemmaForCausalLM has "
                      "none of these; use model.family=gemma2 or gemma3")
  if m.attn_logit_softcap is not None or m.final_logit_softcap is not None:
    raise ConfigError("model.attn_logit_softcap / final_logit_softcap: GemmaForCausalLM has no soft-capping; "
                      "use model.family=gemma2")
  if m.query_pre_attn_scalar not in (None, m.head_dim):
    raise ConfigError(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar}: GemmaForCausalLM scales by "
                      "head_dim ** -0.5; use model.family=gemma2")
  if m.hidden_activation == "gelu":
    raise ConfigError("model.hidden_activation=gelu: GemmaForCausalLM reads hidden_act=gelu as the tanh "
                      "approximation; use gelu_tanh")
  # transformers 5's GemmaMLP reads hidden_act, 4.x's read hidden_activation: write both.
  out = shared_to_hf(m, "hidden_act")
  return {**out, "hidden_activation": out["hidden_act"]}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  # Same names as llama: post_attention_layernorm is the norm before the MLP.
  return maps.llama_like_layer_map(m)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
