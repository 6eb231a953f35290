"""Hugging Face adapter for mixtral (the block is models/mixtral.py): config.json fields and tensor names.

Each expert is its own three tensors on disk (`block_sparse_moe.experts.{e}.w1/w3/w2`: gate, up,
down), stacked into the [layers, experts, ...] kernels of meshlm's MoE layer; the router is
`block_sparse_moe.gate`. (transformers 5 fuses the experts in memory, `mlp.experts.gate_up_proj`,
but save_pretrained writes these per-expert names, as the Hub checkpoints have them.)
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.models.ffns.moe import knobs

HF_MODEL_TYPE = "mixtral"
HF_ARCHITECTURES = ("MixtralForCausalLM",)
# transformers' MixtralConfig.router_aux_loss_coef default, written when meshlm's coefficient is 0.
HF_DEFAULT_AUX_COEF = 0.001


def moe_from_hf(hf: dict, experts_key: str) -> dict:
  """The moe part's knobs (model.parts.moe) the MoE families share. The aux loss counts in transformers only with
  output_router_logits, so that decides whether meshlm adds it."""
  coef = float(hf.get("router_aux_loss_coef", HF_DEFAULT_AUX_COEF)) if hf.get("output_router_logits") else 0.0
  return {"num_experts": int(maps.require(hf, experts_key)),
          "num_experts_per_tok": int(maps.require(hf, "num_experts_per_tok")),
          "router_aux_loss_coef": coef}


def moe_to_hf(m: ModelConfig) -> dict:
  own = knobs(m)
  return {"num_local_experts": own.num_experts, "num_experts_per_tok": own.num_experts_per_tok,
          "output_router_logits": own.router_aux_loss_coef > 0,
          "router_aux_loss_coef": own.router_aux_loss_coef or HF_DEFAULT_AUX_COEF}


def from_hf_config(hf: dict) -> dict:
  maps.refuse(hf, "router_jitter_noise", (0, 0.0), "meshlm routes without jitter noise")
  if hf.get("layer_types") and any(t not in ("full_attention", "sliding_attention") for t in hf["layer_types"]):
    raise ConfigError(f"config.json: layer_types={hf['layer_types']!r} is not supported")
  out = {"family": "mixtral", **maps.llama_like_from_hf(hf)}
  # intermediate_size is each expert's width
  out["parts"] = {"moe": {**moe_from_hf(hf, "num_local_experts"), "mlp_dim": out["mlp_dim"], "norm_topk_prob": True}}
  window = hf.get("sliding_window")
  out["sliding_window"] = None if window is None else int(window)
  return out


def to_hf_config(m: ModelConfig) -> dict:
  if m.qk_norm:
    raise ConfigError("model.qk_norm: MixtralForCausalLM has no q/k norm; use model.family=qwen3_moe")
  if m.layer_pattern is not None and "global" in m.layer_pattern and m.sliding_window is not None:
    raise ConfigError("model.layer_pattern: MixtralForCausalLM slides on every layer or none")
  drop = ("attention_bias", "mlp_bias", "intermediate_size")  # not MixtralConfig fields / set below
  out = {k: v for k, v in maps.llama_like_to_hf(m).items() if k not in drop}
  return {**out, "intermediate_size": knobs(m).mlp_dim, "sliding_window": m.sliding_window,
          "router_jitter_noise": 0.0, **moe_to_hf(m)}


def fused_experts(experts: str) -> dict[str, maps.Tensor]:
  """The expert kernels of a family whose experts are stored either per expert
  (`<experts>{e}.gate_proj.weight`, up, down) or fused (`<experts>gate_up_proj`, `<experts>down_proj`)."""
  from meshlm.nn.moe import EXPERTS_AXES  # here, not at the top: reading config.json needs no jax
  return {"moe.gate": maps.Linear(experts + "{e}.gate_proj.weight", inner_axes=EXPERTS_AXES,
                                  fused=maps.Fused(experts + "gate_up_proj", 0, 2)),
          "moe.up": maps.Linear(experts + "{e}.up_proj.weight", inner_axes=EXPERTS_AXES,
                                fused=maps.Fused(experts + "gate_up_proj", 1, 2)),
          "moe.down": maps.Linear(experts + "{e}.down_proj.weight", inner_axes=EXPERTS_AXES,
                                  fused=maps.Fused(experts + "down_proj"))}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  from meshlm.nn.moe import EXPERTS_AXES  # here, not at the top: reading config.json needs no jax
  out = {k: v for k, v in maps.llama_like_layer_map(m).items() if not k.startswith("mlp.")}
  p = "model.layers.{i}.block_sparse_moe."
  return {**out,
          "moe.router": maps.Linear(p + "gate.weight"),
          "moe.gate": maps.Linear(p + "experts.{e}.w1.weight", inner_axes=EXPERTS_AXES),
          "moe.up": maps.Linear(p + "experts.{e}.w3.weight", inner_axes=EXPERTS_AXES),
          "moe.down": maps.Linear(p + "experts.{e}.w2.weight", inner_axes=EXPERTS_AXES)}


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
