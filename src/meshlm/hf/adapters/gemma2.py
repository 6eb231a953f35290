"""Hugging Face adapter for gemma2 (the block is models/gemma2.py): config.json fields and tensor names."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.gemma import activation_from_hf, shared_from_hf, shared_to_hf

HF_MODEL_TYPE = "gemma2"
HF_ARCHITECTURES = ("Gemma2ForCausalLM",)
# transformers' Gemma2Config defaults, which it uses for any field a config.json leaves out.
HF_DEFAULTS = {"vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "head_dim": 256, "num_key_value_heads": 4, "tie_word_embeddings": True,
               "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0}
# Unlike GemmaConfig, Gemma2Config/Gemma3TextConfig take "gelu" as the exact GELU.
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}
HF_LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}


def pattern_from_hf(hf: dict, num_layers: int, default: list[str]) -> list[str]:
  """The shortest repeating period of config.json's layer_types (default: the given period)."""
  names = hf.get("layer_types")
  if not names:
    return default
  if len(names) != num_layers or any(t not in HF_LAYER_TYPES for t in names):
    raise ConfigError(f"config.json: layer_types must list {num_layers} entries of "
                      f"{' / '.join(HF_LAYER_TYPES)}, got {names!r}")
  types = [HF_LAYER_TYPES[t] for t in names]
  for p in range(1, num_layers + 1):
    if all(types[i] == types[i % p] for i in range(num_layers)):
      return types[:p]
  raise AssertionError("unreachable: the whole list is a period")


def pattern_to_hf(m: ModelConfig) -> list[str]:
  names = {v: k for k, v in HF_LAYER_TYPES.items()}
  return [names[t] for t in m.layer_contexts()]


def sandwich_from_hf(hf: dict, family: str) -> dict:
  """Fields gemma2 and gemma3 read alike: the gemma basics plus pattern, window, scalar and caps."""
  fields = shared_from_hf(hf)
  qpas = hf.get("query_pre_attn_scalar")
  return {"family": family, **fields,
          "hidden_activation": activation_from_hf(hf, "hidden_activation", HF_ACTIVATIONS),
          "sliding_window": None if hf.get("sliding_window") is None else int(hf["sliding_window"]),
          "query_pre_attn_scalar": None if qpas is None else float(qpas),
          "final_logit_softcap": hf.get("final_logit_softcapping"),
          "attn_logit_softcap": hf.get("attn_logit_softcapping")}


def sandwich_to_hf(m: ModelConfig) -> dict:
  qpas = m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None else m.head_dim
  if float(qpas) != int(qpas):
    raise ConfigError(f"model.query_pre_attn_scalar={qpas}: transformers stores it as an integer")
  return {**shared_to_hf(m, "hidden_activation"), "query_pre_attn_scalar": int(qpas),
          "sliding_window": m.sliding_window, "layer_types": pattern_to_hf(m),
          "final_logit_softcapping": m.final_logit_softcap, "attn_logit_softcapping": m.attn_logit_softcap}


def from_hf_config(hf: dict) -> dict:
  hf = {**HF_DEFAULTS, **hf}
  out = sandwich_from_hf(hf, "gemma2")
  out["layer_pattern"] = pattern_from_hf(hf, out["num_layers"], ["local", "global"])
  return out


def to_hf_config(m: ModelConfig) -> dict:
  if m.qk_norm or m.rope_local_theta is not None:
    raise ConfigError("model.qk_norm / rope_local_theta: Gemma2ForCausalLM has neither; use model.family=gemma3")
  return sandwich_to_hf(m)


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  # llama's names, except that HF's post_attention_layernorm here follows attention, and the norm
  # before the MLP is pre_feedforward_layernorm.
  p = "model.layers.{i}."
  return maps.llama_like_layer_map(m) | {
      "attn_post_norm": maps.Tensor(p + "post_attention_layernorm.weight"),
      "mlp_norm": maps.Tensor(p + "pre_feedforward_layernorm.weight"),
      "mlp_post_norm": maps.Tensor(p + "post_feedforward_layernorm.weight"),
  }


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
