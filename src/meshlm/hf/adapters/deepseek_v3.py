"""Hugging Face adapter for deepseek_v3 (the family is models/deepseek_v3.py): config.json fields and tensor names.

Attention is multi-head latent attention (models/mixers/mla.py gives the layouts):

  self_attn.q_a_proj.weight           [Rq, D]            -> attn.q_a [D, Rq]          (with q_lora_rank)
  self_attn.q_a_layernorm.weight      [Rq]               -> attn.q_a_norm
  self_attn.q_b_proj.weight           [N*(Hn+Hr), Rq]    -> attn.q_b [Rq, N, Hn+Hr]
  self_attn.q_proj.weight             [N*(Hn+Hr), D]     -> attn.q [D, N, Hn+Hr]     (without q_lora_rank)
  self_attn.kv_a_proj_with_mqa.weight [Rkv+Hr, D]        -> attn.kv_a [D, Rkv+Hr]
  self_attn.kv_a_layernorm.weight     [Rkv]              -> attn.kv_a_norm
  self_attn.kv_b_proj.weight          [N*(Hn+Hv), Rkv]   -> attn.k_b [Rkv, N, Hn] and attn.v_b [Rkv, N, Hv]
                                                            (each head's rows: k_nope, then v; maps.HeadSplit)
  self_attn.o_proj.weight             [D, N*Hv]          -> attn.o [N, Hv, D]

The first first_k_dense_replace layers have a dense MLP (`mlp.gate_proj/up_proj/down_proj`); the others a MoE:
the router `mlp.gate.weight`, its bias `mlp.gate.e_score_correction_bias` (model state, moe.router_bias), the
experts `mlp.experts.{e}.*_proj` (or fused, as transformers 5 holds them) and the shared experts
`mlp.shared_experts.*_proj`, whose width is n_shared_experts * moe_intermediate_size. The published checkpoints'
multi-token-prediction layer (`model.layers.61.*`, past num_hidden_layers) is skipped on import with one notice, as
transformers does; export writes none (num_nextn_predict_layers 0). Their fp8 weights are hf/fp8.py's.

RoPE: transformers' rope_parameters (or rope_theta + rope_scaling), default or yarn. The YaRN attention factor
follows transformers' _compute_yarn_parameters: mscale / mscale_all_dim when both are set, else 0.1 ln(factor) + 1
(written as attention_factor); the softmax scale's mscale_all_dim is the mla mixer's.
"""
from __future__ import annotations

import math

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.mixtral import fused_experts
from meshlm.models.ffns import moe
from meshlm.models.mixers import mla

HF_MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# DeepseekV3Config's defaults for the fields a config.json may leave out (transformers 5).
HF_DEFAULTS = {"q_lora_rank": 1536, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "n_shared_experts": 1,
               "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_interleave": True}


def _get(hf: dict, key: str):
  return hf[key] if key in hf else HF_DEFAULTS[key]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
  """(rope_theta, None or the yarn rope_scaling) from rope_parameters (transformers 5) or rope_theta + rope_scaling."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict):
    raise ConfigError(f"config.json: rope_parameters must be an object, got {params!r}")
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "yarn":
    raise ConfigError(f"config.json: rope_type={kind!r} is not supported for deepseek_v3 (meshlm reads default and "
                      "yarn)")
  maps.refuse(params, "truncate", True, "meshlm's YaRN truncates the correction range, as transformers' default")
  old = params.get("original_max_position_embeddings")
  if old is None:
    raise ConfigError("config.json: yarn rope parameters lack 'original_max_position_embeddings'")
  factor = params.get("factor") or maps.require(hf, "max_position_embeddings") / old
  out = {"rope_type": "yarn", "factor": float(factor), "original_max_position": float(old),
         "beta_fast": float(params.get("beta_fast") or 32.0), "beta_slow": float(params.get("beta_slow") or 1.0)}
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  if params.get("attention_factor") is not None:
    out["attention_factor"] = float(params["attention_factor"])
  elif not (mscale and mscale_all_dim):
    out["attention_factor"] = _yarn_mscale(float(factor))  # transformers then ignores mscale
  if mscale:
    out["mscale"] = float(mscale)
  if mscale_all_dim:
    out["mscale_all_dim"] = float(mscale_all_dim)
  return theta, out


def rope_to_hf(m: ModelConfig) -> dict:
  """rope_parameters (transformers 5) and rope_theta + rope_scaling (transformers 4)."""
  s = m.rope_scaling
  if not s:
    return {"rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
  if s.get("rope_type") != "yarn":
    raise ConfigError(f"model.rope_scaling.rope_type={s.get('rope_type')!r}: DeepseekV3ForCausalLM takes default or "
                      "yarn rope")
  params = {"rope_type": "yarn", "factor": s["factor"], "original_max_position_embeddings": int(s["original_max_position"]),
            "beta_fast": s.get("beta_fast", 32.0), "beta_slow": s.get("beta_slow", 1.0),
            **{k: s[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if k in s}}
  return {"rope_theta": m.rope_theta, "rope_scaling": dict(params),
          "rope_parameters": {**params, "rope_theta": m.rope_theta}}


def from_hf_config(hf: dict) -> dict:
  maps.refuse(hf, "hidden_act", ("silu",), "the MLPs are SwiGLU")
  maps.refuse(hf, "attention_bias", False, "projections have no bias")
  maps.refuse(hf, "scoring_func", "sigmoid", "DeepSeek-V3 routes by sigmoid scores")
  maps.refuse(hf, "topk_method", "noaux_tc", "DeepSeek-V3 picks experts by group-limited, bias-corrected scores")
  maps.refuse(hf, "moe_layer_freq", 1, "every layer after the first first_k_dense_replace is MoE")
  heads = int(maps.require(hf, "num_attention_heads"))
  if hf.get("num_key_value_heads") not in (None, heads):
    raise ConfigError(f"config.json: num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads="
                      f"{heads} (latent attention has one key and value per query head)")
  shared = int(_get(hf, "n_shared_experts") or 0)
  if shared < 1:
    raise ConfigError(f"config.json: n_shared_experts={shared} is not supported (DeepseekV3ForCausalLM always runs "
                      "shared experts)")
  moe_dim = int(maps.require(hf, "moe_intermediate_size"))
  nope, rope = int(maps.require(hf, "qk_nope_head_dim")), int(maps.require(hf, "qk_rope_head_dim"))
  q_lora = _get(hf, "q_lora_rank")
  theta, scaling = rope_from_hf(hf)
  return {
      "family": "deepseek_v3",
      "vocab_size": int(maps.require(hf, "vocab_size")),
      "embed_dim": int(maps.require(hf, "hidden_size")),
      "num_layers": int(maps.require(hf, "num_hidden_layers")),
      "num_heads": heads,
      "num_kv_heads": heads,
      "head_dim": rope,  # as transformers sets it (the rotary width); the mla mixer reads the MLA dims
      "mlp_dim": int(maps.require(hf, "intermediate_size")),
      "max_position": int(hf.get("max_position_embeddings", 4096)),
      "rope_theta": theta,
      "rope_scaling": scaling,
      "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
      "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
      "first_k_dense_replace": int(_get(hf, "first_k_dense_replace")),
      "parts": {"mla": {  # latent attention: the mla part's knobs
          "q_lora_rank": None if q_lora is None else int(q_lora),
          "kv_lora_rank": int(maps.require(hf, "kv_lora_rank")),
          "qk_nope_head_dim": nope,
          "qk_rope_head_dim": rope,
          "v_head_dim": int(maps.require(hf, "v_head_dim")),
          "rope_interleave": bool(_get(hf, "rope_interleave")),
      }, "moe": {  # routing: the moe part's knobs
          "num_experts": int(maps.require(hf, "n_routed_experts")),
          "num_experts_per_tok": int(maps.require(hf, "num_experts_per_tok")),
          "mlp_dim": moe_dim,
          "shared_expert_mlp_dim": shared * moe_dim,
          "norm_topk_prob": bool(_get(hf, "norm_topk_prob")),
          "router_scoring": "sigmoid",
          "n_group": int(_get(hf, "n_group")),
          "topk_group": int(_get(hf, "topk_group")),
          "routed_scaling_factor": float(_get(hf, "routed_scaling_factor")),
          # transformers 5's DeepseekV3TopkRouter scores the dropped groups' experts -inf (transformers 4 and
          # DeepSeek's remote code: 0.0, meshlm's default); they pick different experts when kept experts' biased
          # scores go negative
          "router_group_mask": "-inf",
          # DeepseekV3ForCausalLM computes no auxiliary loss; a coefficient meshlm wrote comes back
          "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits")
          else 0.0,
      }},
  }


def to_hf_config(m: ModelConfig) -> dict:
  own, lat = moe.knobs(m), mla.knobs(m)
  if own.router_scoring != "sigmoid":
    raise ConfigError(f"model.parts.moe.router_scoring={own.router_scoring!r}: DeepseekV3ForCausalLM routes by "
                      "sigmoid scores")
  if m.num_kv_heads != m.num_heads:
    raise ConfigError(f"model.num_kv_heads={m.num_kv_heads}: DeepseekV3ForCausalLM has one latent key and value per "
                      f"query head (num_heads={m.num_heads})")
  shared, moe_dim = own.shared_expert_mlp_dim, own.mlp_dim
  if not shared or shared % moe_dim:
    raise ConfigError(f"model.parts.moe.shared_expert_mlp_dim={shared}: DeepseekV3ForCausalLM's shared experts are "
                      "n_shared_experts x moe_intermediate_size, a positive multiple of model.parts.moe.mlp_dim="
                      f"{moe_dim}")
  return {
      "vocab_size": m.vocab_size, "hidden_size": m.embed_dim, "intermediate_size": m.mlp_dim,
      "moe_intermediate_size": moe_dim, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_heads, "n_shared_experts": shared // moe_dim, "n_routed_experts": own.num_experts,
      "routed_scaling_factor": own.routed_scaling_factor, "kv_lora_rank": lat.kv_lora_rank,
      "q_lora_rank": lat.q_lora_rank, "qk_rope_head_dim": lat.qk_rope_head_dim, "v_head_dim": lat.v_head_dim,
      "qk_nope_head_dim": lat.qk_nope_head_dim,
      "n_group": own.n_group, "topk_group": own.topk_group, "num_experts_per_tok": own.num_experts_per_tok,
      "first_k_dense_replace": m.first_k_dense_replace, "norm_topk_prob": own.norm_topk_prob,
      "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
      "max_position_embeddings": m.max_position, "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
      "rope_interleave": lat.rope_interleave, "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
      "num_nextn_predict_layers": 0,  # meshlm has no multi-token-prediction layers to write
      "output_router_logits": own.router_aux_loss_coef > 0, "router_aux_loss_coef": own.router_aux_loss_coef,
      **rope_to_hf(m),
  }


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  p = "model.layers.{i}."
  sa, mlp = p + "self_attn.", p + "mlp."
  experts = mlp + "experts."
  kv_b = sa + "kv_b_proj.weight"
  lat = mla.knobs(m)
  sizes = (lat.qk_nope_head_dim, lat.v_head_dim)
  out = {
      "attn_norm": maps.Tensor(p + "input_layernorm.weight"),
      "mlp_norm": maps.Tensor(p + "post_attention_layernorm.weight"),
      "attn.kv_a": maps.Linear(sa + "kv_a_proj_with_mqa.weight"),
      "attn.kv_a_norm": maps.Tensor(sa + "kv_a_layernorm.weight"),
      "attn.k_b": maps.HeadSplit(kv_b, sizes=sizes, part=0),
      "attn.v_b": maps.HeadSplit(kv_b, sizes=sizes, part=1),
      "attn.o": maps.Linear(sa + "o_proj.weight", n_in=2),
      # dense layers
      "mlp.gate": maps.Linear(mlp + "gate_proj.weight"),
      "mlp.up": maps.Linear(mlp + "up_proj.weight"),
      "mlp.down": maps.Linear(mlp + "down_proj.weight"),
      # MoE layers
      "moe.router": maps.Linear(mlp + "gate.weight"),
      "moe.router_bias": maps.Tensor(mlp + "gate.e_score_correction_bias"),
      **fused_experts(experts),
      "moe.shared_gate": maps.Linear(mlp + "shared_experts.gate_proj.weight"),
      "moe.shared_up": maps.Linear(mlp + "shared_experts.up_proj.weight"),
      "moe.shared_down": maps.Linear(mlp + "shared_experts.down_proj.weight"),
  }
  if lat.q_lora_rank is None:
    out["attn.q"] = maps.Linear(sa + "q_proj.weight")
  else:
    out["attn.q_a"] = maps.Linear(sa + "q_a_proj.weight")
    out["attn.q_a_norm"] = maps.Tensor(sa + "q_a_layernorm.weight")
    out["attn.q_b"] = maps.Linear(sa + "q_b_proj.weight")
  return out


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map, mtp_layers=True)
