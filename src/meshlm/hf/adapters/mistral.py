"""Hugging Face adapter for mistral (the block is models/mistral.py): config.json fields and tensor names."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps

HF_MODEL_TYPE = "mistral"
HF_ARCHITECTURES = ("MistralForCausalLM",)
# transformers' MistralConfig default, used when config.json leaves the field out.
HF_DEFAULT_SLIDING_WINDOW = 4096


def from_hf_config(hf: dict) -> dict:
  if hf.get("layer_types") and any(t != "sliding_attention" for t in hf["layer_types"]):
    raise ConfigError("config.json: layer_types mixes attention kinds; MistralForCausalLM slides on every layer")
  window = hf.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
  return {"family": "mistral", **maps.llama_like_from_hf(hf),
          "sliding_window": None if window is None else int(window)}


def to_hf_config(m: ModelConfig) -> dict:
  if m.qk_norm:
    raise ConfigError("model.qk_norm: MistralForCausalLM has no q/k norm; use model.family=qwen3")
  # null (not absent) says "no window": an absent field would read back as 4096.
  out = {k: v for k, v in maps.llama_like_to_hf(m).items() if k not in ("attention_bias", "mlp_bias")}  # not fields
  return {**out, "sliding_window": m.sliding_window}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return maps.llama_like_layer_map(m)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
