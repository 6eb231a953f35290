"""Hugging Face adapter for llama (the block is models/llama.py): config.json fields and tensor names."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps

HF_MODEL_TYPE = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM",)


def from_hf_config(hf: dict) -> dict:
  return {"family": "llama", **maps.llama_like_from_hf(hf)}


def to_hf_config(m: ModelConfig) -> dict:
  if m.sliding_window is not None or m.qk_norm:
    raise ConfigError("model.sliding_window / model.qk_norm: LlamaForCausalLM has neither; "
                      "use model.family=mistral or qwen3")
  return maps.llama_like_to_hf(m)


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return maps.llama_like_layer_map(m)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
