"""Hugging Face adapter for qwen3_moe (the block is models/qwen3_moe.py): config.json fields and tensor names.

Dense layers keep qwen3's names (`mlp.gate_proj/up_proj/down_proj`); MoE layers store each expert
as `mlp.experts.{e}.gate_proj/up_proj/down_proj`, stacked into meshlm's [layers, experts, ...]
kernels, and the router as `mlp.gate`. Which layers are MoE follows decoder_sparse_step and
mlp_only_layers, as in transformers.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.mixtral import moe_from_hf, moe_to_hf
from meshlm.models.ffns.moe import knobs

HF_MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def from_hf_config(hf: dict) -> dict:
  maps.refuse(hf, "use_sliding_window", False, "meshlm's qwen3_moe attends globally on every layer")
  # transformers 5 writes num_local_experts (its attribute_map), Hub checkpoints num_experts.
  experts_key = "num_experts" if "num_experts" in hf else "num_local_experts"
  out = {"family": "qwen3_moe", **maps.llama_like_from_hf(hf), "qk_norm": True,
         "parts": {"moe": {**moe_from_hf(hf, experts_key),
                           "mlp_dim": int(maps.require(hf, "moe_intermediate_size")),
                           "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}},
         "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
         "mlp_only_layers": [int(i) for i in hf.get("mlp_only_layers") or []]}
  return out


def to_hf_config(m: ModelConfig) -> dict:
  if not m.qk_norm or m.sliding_window is not None:
    raise ConfigError("model.qk_norm / model.sliding_window: Qwen3MoeForCausalLM needs qk_norm=true and no "
                      "sliding_window")
  out = {k: v for k, v in maps.llama_like_to_hf(m).items() if k != "mlp_bias"}  # not a Qwen3MoeConfig field
  moe, own = moe_to_hf(m), knobs(m)
  return {**out, "use_sliding_window": False, "sliding_window": None, **moe,
          # transformers 4 reads num_experts; 5 maps it onto num_local_experts, which it writes.
          "num_experts": own.num_experts, "moe_intermediate_size": own.mlp_dim,
          "norm_topk_prob": own.norm_topk_prob, "decoder_sparse_step": m.decoder_sparse_step,
          "mlp_only_layers": list(m.mlp_only_layers)}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  from meshlm.nn.moe import EXPERTS_AXES  # here, not at the top: reading config.json needs no jax
  p = "model.layers.{i}.mlp."
  return {**maps.llama_like_layer_map(m),
          "moe.router": maps.Linear(p + "gate.weight"),
          "moe.gate": maps.Linear(p + "experts.{e}.gate_proj.weight", inner_axes=EXPERTS_AXES),
          "moe.up": maps.Linear(p + "experts.{e}.up_proj.weight", inner_axes=EXPERTS_AXES),
          "moe.down": maps.Linear(p + "experts.{e}.down_proj.weight", inner_axes=EXPERTS_AXES)}


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
