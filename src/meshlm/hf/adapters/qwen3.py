"""Hugging Face adapter for qwen3 (the block is models/qwen3.py): config.json fields and tensor names."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps

HF_MODEL_TYPE = "qwen3"
HF_ARCHITECTURES = ("Qwen3ForCausalLM",)


def from_hf_config(hf: dict) -> dict:
  # Qwen3 slides only when use_sliding_window is set (and then only on the upper layers).
  maps.refuse(hf, "use_sliding_window", False, "meshlm's qwen3 attends globally on every layer")
  if hf.get("layer_types") and any(t != "full_attention" for t in hf["layer_types"]):
    raise ConfigError("config.json: layer_types has sliding layers; meshlm's qwen3 attends globally on every layer")
  return {"family": "qwen3", **maps.llama_like_from_hf(hf), "qk_norm": True}


def to_hf_config(m: ModelConfig) -> dict:
  if not m.qk_norm or m.sliding_window is not None:
    raise ConfigError("model.qk_norm / model.sliding_window: Qwen3ForCausalLM needs qk_norm=true and no "
                      "sliding_window")
  out = {k: v for k, v in maps.llama_like_to_hf(m).items() if k != "mlp_bias"}  # not a Qwen3Config field
  return {**out, "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
          "layer_types": ["full_attention"] * m.num_layers}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return maps.llama_like_layer_map(m)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
