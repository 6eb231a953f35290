"""Hugging Face adapter for qwen3_5 (the family is models/qwen3_5.py): config.json fields and tensor names.

The dense Qwen3.5 text model (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): qwen3_next's hybrid with separate
linear-attention projections (`in_proj_qkv` [2KH + NJ, D], `in_proj_z` [N*J, D], `in_proj_b`, `in_proj_a` [N, D])
and a dense MLP on every layer (adapters/qwen3_next.py has the shared maps). The published checkpoints are
multimodal (`Qwen3_5ForConditionalGeneration`, model_type qwen3_5): import reads their text model (config.json's
text_config, tensors under model.language_model.) and skips the vision tower (`model.visual.*`) and the
multi-token-prediction head (`mtp.*`); export writes the text model's own layout.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.qwen3_next import SKIPPED, hybrid_from_hf, hybrid_layer_map, hybrid_to_hf

HF_MODEL_TYPE = "qwen3_5_text"
HF_ARCHITECTURES = ("Qwen3_5ForCausalLM",)
WRAPPED = (maps.Wrapped("qwen3_5", ("Qwen3_5ForConditionalGeneration",)),)


def from_hf_config(hf: dict) -> dict:
  if hf.get("num_experts"):
    raise ConfigError(f"config.json: num_experts={hf['num_experts']!r}: {HF_ARCHITECTURES[0]} is dense; a Qwen3.5 "
                      "MoE is model_type qwen3_5_moe_text")
  out = hybrid_from_hf(hf, "qwen3_5")
  out["mlp_dim"] = int(maps.require(hf, "intermediate_size"))
  return out


def to_hf_config(m: ModelConfig) -> dict:
  return hybrid_to_hf(m)


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return hybrid_layer_map(m, fused=False, moe=False)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map,
                       skipped=SKIPPED, wrapped=WRAPPED)
