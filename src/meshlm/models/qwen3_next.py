"""qwen3_next: a Gated DeltaNet hybrid (Qwen3-Next). Most layers are `linear_attn` (the gdn mixer, its fused
per-key-head projections), every full_attention_interval-th is `full_attn` (gated_gqa: output gate, (1 + w)
q/k norms, partial rotary); every feed-forward is a MoE with a gated shared expert. Every RMSNorm is
zero-centred, (1 + w), except the GDN's gated norm (a plain scale starting at ones).

The plan reads model.hybrid_layer_types (Hugging Face's layer_types) or model.full_attention_interval and
scans over the shortest repeating stretch of kinds (qwen3-next-80b-a3b: 3 linear + 1 full, 12 periods).
`hybrid_plan` and `validate_hybrid` are shared by qwen3_5 and qwen3_5_moe.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.moe import moe_ffn, validate_softmax_routing
from meshlm.models.mixers.gated_gqa import gated_gqa
from meshlm.models.mixers.gdn import gdn
from meshlm.models.qwen3_moe import periodic_plan

KINDS = {"linear_attention": "linear_attn", "full_attention": "full_attn"}


def hybrid_plan(m: ModelConfig) -> LayerPlan:
  kinds = tuple(KINDS[t] for t in m.hybrid_types())
  return periodic_plan(kinds, m.layer_contexts())


def validate_hybrid(m: ModelConfig, *, moe: bool) -> None:
  """The fields a GDN hybrid needs; one ConfigError line naming the key otherwise."""
  fam = m.family
  for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
    if getattr(m, key) is None:
      raise ConfigError(f"model.{key}: required by model.family={fam} (its linear-attention layers)")
  if m.hybrid_types() is None:
    raise ConfigError(f"model.hybrid_layer_types: model.family={fam} needs its layer pattern; set "
                      "model.hybrid_layer_types (one linear_attention or full_attention per layer) or "
                      "model.full_attention_interval")
  if m.layer_pattern is not None or m.sliding_window is not None:
    raise ConfigError(f"model.layer_pattern / model.sliding_window: model.family={fam} has no sliding-window "
                      "layers; leave them null")
  if moe:
    if not m.num_experts:
      raise ConfigError(f"model.num_experts: model.family={fam} has a MoE feed-forward on every layer; set "
                        "model.num_experts and model.moe_mlp_dim")
    if m.shared_expert_mlp_dim is None:
      raise ConfigError(f"model.shared_expert_mlp_dim: required by model.family={fam} (its gated shared expert)")
    if m.mlp_only_layers or m.decoder_sparse_step != 1:
      raise ConfigError(f"model.mlp_only_layers / model.decoder_sparse_step: model.family={fam} is built with "
                        "every layer MoE; leave them at [] and 1")
    validate_softmax_routing(m)
  elif m.num_experts:
    raise ConfigError(f"model.num_experts={m.num_experts}: model.family={fam} is dense; use qwen3_5_moe for experts")


def validate(m: ModelConfig) -> None:
  validate_hybrid(m, moe=True)


FAMILY = Family(
    "qwen3_next",
    kinds={"linear_attn": Kind(gdn(fused=True), moe_ffn(shared=True), plus_one=True),
           "full_attn": Kind(gated_gqa(), moe_ffn(shared=True), plus_one=True)},
    plan=hybrid_plan, norm_plus_one=True, validate=validate)
