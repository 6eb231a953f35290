"""deepseek_v3: multi-head latent attention (the mla mixer) on every layer; the first
model.first_k_dense_replace layers have a dense GLU of mlp_dim, the rest a MoE of model.parts.moe.mlp_dim wide
experts routed by group-limited sigmoid scores with a routing bias (model state), beside ungated shared experts
(model.parts.moe.shared_expert_mlp_dim wide), as transformers' DeepseekV3DecoderLayer.

The plan: the dense layers are an unrolled prefix, the MoE layers one scan (deepseek-v3: 3 dense, 58 MoE).
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.glu import glu
from meshlm.models.ffns.moe import moe_ffn, validate_group_routing
from meshlm.models.mixers.mla import mla

def plan(m: ModelConfig) -> LayerPlan:
  k = m.first_k_dense_replace
  kinds = tuple("dense" if i < k else "moe" for i in range(m.num_layers))
  return LayerPlan(kinds=kinds, contexts=m.layer_contexts(), period=1, prefix=min(k, m.num_layers))


def validate(m: ModelConfig) -> None:
  """deepseek_v3's rules beyond the fields and knobs its parts need (Part.needs, their sections); one ConfigError
  line naming the key."""
  fam = m.family
  if m.first_k_dense_replace > m.num_layers:
    raise ConfigError(f"model.first_k_dense_replace={m.first_k_dense_replace}: more dense layers than "
                      f"model.num_layers={m.num_layers}")
  if m.first_k_dense_replace < m.num_layers:
    validate_group_routing(m, shared=True)
  if m.layer_pattern is not None or m.sliding_window is not None:
    raise ConfigError(f"model.layer_pattern / model.sliding_window: model.family={fam} has no sliding-window "
                      "layers; leave them null")
  if m.mlp_only_layers or m.decoder_sparse_step != 1:
    raise ConfigError(f"model.mlp_only_layers / model.decoder_sparse_step: model.family={fam} places its dense "
                      "layers with model.first_k_dense_replace; leave them at [] and 1")


FAMILY = Family("deepseek_v3",
                kinds={"dense": Kind(mla(), glu()),
                       "moe": Kind(mla(), moe_ffn(shared=True, shared_gate=False, routing="group_sigmoid"))},
                plan=plan, validate=validate)
