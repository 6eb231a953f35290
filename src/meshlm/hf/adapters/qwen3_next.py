"""Hugging Face adapter for qwen3_next (the family is models/qwen3_next.py): config.json fields and tensor names.

Qwen3-Next is a Gated DeltaNet hybrid: `layer_types` (or every full_attention_interval-th layer) says which
layers are gated full attention (`self_attn.*`) and which linear attention (`linear_attn.*`). The tensors and
their meshlm leaves (models/mixers/gdn.py and gated_gqa.py give the layouts):

  linear_attn.in_proj_qkvz.weight [K*(2H + 2GJ), D]  -> linear_attn.in_proj_qkvz [D, K, 2H + 2GJ] (per key head)
  linear_attn.in_proj_ba.weight   [2N, D]            -> linear_attn.in_proj_ba [D, K, 2G] (per key head b | a)
  linear_attn.conv1d.weight       [C, 1, W]          -> linear_attn.conv1d [W, C]
  linear_attn.A_log, dt_bias [N], norm.weight [J]    -> as they are
  linear_attn.out_proj.weight     [D, N*J]           -> linear_attn.out_proj [N, J, D]
  self_attn.q_proj.weight         [N*2H, D]          -> attn.q [D, N, 2H] (per head q | gate)

Every feed-forward is a MoE with a shared expert: the router `mlp.gate`, the experts `mlp.experts.{e}.*_proj`
(or fused, `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F], as transformers 5
holds them in memory; export writes one tensor per expert, as save_pretrained does), `mlp.shared_expert.*_proj`
and `mlp.shared_expert_gate`. The Hub checkpoints also carry a multi-token-prediction head (`mtp.*`), which
transformers does not load and neither does meshlm.

`hybrid_from_hf`, `hybrid_to_hf` and `hybrid_layer_map` are shared with qwen3_5 and qwen3_5_moe.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.mixtral import HF_DEFAULT_AUX_COEF, fused_experts, moe_from_hf
from meshlm.models.ffns import moe
from meshlm.models.mixers import gdn

HF_MODEL_TYPE = "qwen3_next"
HF_ARCHITECTURES = ("Qwen3NextForCausalLM",)
SKIPPED = ("mtp.",)
LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' defaults for fields a config.json may leave out (Qwen3NextConfig and the Qwen3.5 text configs).
HF_PARTIAL_ROTARY = 0.25
HF_FULL_ATTENTION_INTERVAL = 4
HF_CONV_KERNEL_DIM = 4
HF_INTERMEDIATE_SIZE = 5632  # Qwen3NextConfig's: the width of its (mlp_only_layers) dense MLPs, unused here


def hybrid_from_hf(hf: dict, family: str) -> dict:
  """The fields the three GDN hybrids share: the llama-like ones, gated full attention with partial rotary,
  the linear-attention geometry (the gdn part's section, model.parts.gdn: its heads, head dims and conv taps) and
  the layer pattern."""
  maps.refuse(hf, "attn_output_gate", True, "meshlm's full-attention layers are always gated")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  # rope_parameters.partial_rotary_factor (transformers 5), else the top-level field (transformers 4).
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", HF_PARTIAL_ROTARY))
  # qwen3.5's interleaved MRoPE (mrope_section, mrope_interleaved) is ordinary RoPE for text positions: every
  # frequency reads the same position whichever of the three position components it is assigned to.
  # mlp_dim (intermediate_size) is each family's to read.
  base = maps.llama_like_from_hf({**hf, "intermediate_size": hf.get("intermediate_size", 1)})
  del base["mlp_dim"]
  types = hf.get("layer_types")
  if types is not None:
    if not isinstance(types, list) or len(types) != base["num_layers"]:
      raise ConfigError(f"config.json: layer_types={types!r} must list one type per layer "
                        f"(num_hidden_layers={base['num_layers']})")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
      raise ConfigError(f"config.json: layer_types has {', '.join(map(repr, bad))}; meshlm's {family} reads only "
                        f"{' and '.join(LAYER_TYPES)}")
  out = {"family": family, **base, "partial_rotary_factor": float(partial),
         "parts": {"gdn": {"key_heads": int(maps.require(hf, "linear_num_key_heads")),
                           "value_heads": int(maps.require(hf, "linear_num_value_heads")),
                           "key_head_dim": int(maps.require(hf, "linear_key_head_dim")),
                           "value_head_dim": int(maps.require(hf, "linear_value_head_dim")),
                           "conv_kernel_dim": int(hf.get("linear_conv_kernel_dim", HF_CONV_KERNEL_DIM))}}}
  if types is not None:
    out["hybrid_layer_types"] = list(types)
  else:
    out["full_attention_interval"] = int(hf.get("full_attention_interval", HF_FULL_ATTENTION_INTERVAL))
  return out


def shared_moe_from_hf(hf: dict) -> dict:
  """The moe part's knobs (model.parts.moe) of the routed experts and the gated shared expert (qwen3_next,
  qwen3_5_moe)."""
  maps.refuse(hf, "decoder_sparse_step", 1, "every layer of these families is MoE")
  maps.refuse(hf, "mlp_only_layers", ([], None), "every layer of these families is MoE")
  return {**moe_from_hf(hf, "num_experts"),
          "mlp_dim": int(maps.require(hf, "moe_intermediate_size")),
          "shared_expert_mlp_dim": int(maps.require(hf, "shared_expert_intermediate_size"))}


def from_hf_config(hf: dict) -> dict:
  out = hybrid_from_hf(hf, "qwen3_next")
  out["parts"]["moe"] = {**shared_moe_from_hf(hf), "norm_topk_prob": bool(hf.get("norm_topk_prob", True))}
  return {**out, "mlp_dim": int(hf.get("intermediate_size", HF_INTERMEDIATE_SIZE))}


def hybrid_to_hf(m: ModelConfig) -> dict:
  if m.layer_pattern is not None or m.sliding_window is not None:
    raise ConfigError(f"model.layer_pattern / model.sliding_window: the Hugging Face {m.family} classes have no "
                      "sliding-window layers")
  out = {k: v for k, v in maps.llama_like_to_hf(m).items() if k != "mlp_bias"}  # not a field of these configs
  # transformers 5 reads partial_rotary_factor from rope_parameters, transformers 4 from the top level.
  out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": m.partial_rotary_factor}
  if "rope_scaling" in out:
    out["rope_scaling"] = {**out["rope_scaling"], "partial_rotary_factor": m.partial_rotary_factor}
  own = gdn.knobs(m)
  return {**out, "partial_rotary_factor": m.partial_rotary_factor, "layer_types": list(m.hybrid_types()),
          "linear_num_key_heads": own.key_heads, "linear_num_value_heads": own.value_heads,
          "linear_key_head_dim": own.key_head_dim, "linear_value_head_dim": own.value_head_dim,
          "linear_conv_kernel_dim": own.conv_kernel_dim}


def shared_moe_to_hf(m: ModelConfig) -> dict:
  own = moe.knobs(m)
  return {"num_experts": own.num_experts, "num_experts_per_tok": own.num_experts_per_tok,
          "moe_intermediate_size": own.mlp_dim, "shared_expert_intermediate_size": own.shared_expert_mlp_dim,
          "output_router_logits": own.router_aux_loss_coef > 0,
          "router_aux_loss_coef": own.router_aux_loss_coef or HF_DEFAULT_AUX_COEF}


def to_hf_config(m: ModelConfig) -> dict:
  return {**hybrid_to_hf(m), **shared_moe_to_hf(m), "norm_topk_prob": moe.knobs(m).norm_topk_prob,
          "decoder_sparse_step": 1, "mlp_only_layers": []}


def hybrid_layer_map(m: ModelConfig, *, fused: bool, moe: bool) -> dict[str, maps.Tensor]:
  """fused: qwen3-next's in_proj_qkvz / in_proj_ba, else qwen3.5's in_proj_qkv / _z / _b / _a. moe: the routed
  and shared experts, else a dense MLP."""
  p = "model.layers.{i}."
  la, sa, mlp = p + "linear_attn.", p + "self_attn.", p + "mlp."
  out = {
      "attn_norm": maps.Tensor(p + "input_layernorm.weight"),
      "mlp_norm": maps.Tensor(p + "post_attention_layernorm.weight"),
      # full-attention layers (gated_gqa)
      "attn.q": maps.Linear(sa + "q_proj.weight"),
      "attn.k": maps.Linear(sa + "k_proj.weight"),
      "attn.v": maps.Linear(sa + "v_proj.weight"),
      "attn.o": maps.Linear(sa + "o_proj.weight", n_in=2),
      "attn.q_norm": maps.Tensor(sa + "q_norm.weight"),
      "attn.k_norm": maps.Tensor(sa + "k_norm.weight"),
      # linear-attention layers (gdn)
      "linear_attn.conv1d": maps.Conv1d(la + "conv1d.weight"),
      "linear_attn.A_log": maps.Tensor(la + "A_log"),
      "linear_attn.dt_bias": maps.Tensor(la + "dt_bias"),
      "linear_attn.norm": maps.Tensor(la + "norm.weight"),
      "linear_attn.out_proj": maps.Linear(la + "out_proj.weight", n_in=2),
  }
  if fused:
    out["linear_attn.in_proj_qkvz"] = maps.Linear(la + "in_proj_qkvz.weight")
    out["linear_attn.in_proj_ba"] = maps.Linear(la + "in_proj_ba.weight")
  else:
    for proj in ("qkv", "z", "b", "a"):
      out[f"linear_attn.in_proj_{proj}"] = maps.Linear(la + f"in_proj_{proj}.weight")
  if not moe:
    return {**out, "mlp.gate": maps.Linear(mlp + "gate_proj.weight"), "mlp.up": maps.Linear(mlp + "up_proj.weight"),
            "mlp.down": maps.Linear(mlp + "down_proj.weight")}
  experts = mlp + "experts."
  return {**out,
          "moe.router": maps.Linear(mlp + "gate.weight"),
          **fused_experts(experts),
          "moe.shared_gate": maps.Linear(mlp + "shared_expert.gate_proj.weight"),
          "moe.shared_up": maps.Linear(mlp + "shared_expert.up_proj.weight"),
          "moe.shared_down": maps.Linear(mlp + "shared_expert.down_proj.weight"),
          "moe.shared_expert_gate": maps.Linear(mlp + "shared_expert_gate.weight")}


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return hybrid_layer_map(m, fused=True, moe=True)


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map,
                       skipped=SKIPPED)
