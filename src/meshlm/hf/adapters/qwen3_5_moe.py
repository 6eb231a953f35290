"""Hugging Face adapter for qwen3_5_moe (the family is models/qwen3_5_moe.py): config.json fields and tensor names.

The Qwen3.5 MoE text model (`Qwen3_5MoeForCausalLM`, model_type qwen3_5_moe_text): qwen3_5's layers with
qwen3_next's MoE and gated shared expert on every layer (adapters/qwen3_next.py has the shared maps, including
the experts stored one tensor per expert or fused). The router always renormalizes its top-k (the config has no
norm_topk_prob), and there is no dense MLP width (intermediate_size): meshlm's mlp_dim, which no layer reads, is
set to the experts' width. Import also reads the published multimodal checkpoints
(`Qwen3_5MoeForConditionalGeneration`, model_type qwen3_5_moe), as qwen3_5 does.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.qwen3_next import (SKIPPED, hybrid_from_hf, hybrid_layer_map, hybrid_to_hf,
                                           shared_moe_from_hf, shared_moe_to_hf)
from meshlm.models.ffns.moe import knobs

HF_MODEL_TYPE = "qwen3_5_moe_text"
HF_ARCHITECTURES = ("Qwen3_5MoeForCausalLM",)
WRAPPED = (maps.Wrapped("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration",)),)


def from_hf_config(hf: dict) -> dict:
  out = hybrid_from_hf(hf, "qwen3_5_moe")
  out["parts"]["moe"] = {**shared_moe_from_hf(hf), "norm_topk_prob": True}
  out["mlp_dim"] = int(hf.get("intermediate_size") or out["parts"]["moe"]["mlp_dim"])
  return out


def to_hf_config(m: ModelConfig) -> dict:
  if not knobs(m).norm_topk_prob:
    raise ConfigError("model.parts.moe.norm_topk_prob=false: Qwen3_5MoeForCausalLM always renormalizes its top-k")
  out = {k: v for k, v in hybrid_to_hf(m).items() if k != "intermediate_size"}  # not a Qwen3_5MoeTextConfig field
  return {**out, **shared_moe_to_hf(m)}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return hybrid_layer_map(m, fused=False, moe=True)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map,
                       skipped=SKIPPED, wrapped=WRAPPED)
