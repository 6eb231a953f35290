"""qwen3_moe: qwen3's block (q/k RMSNorm) with mixture-of-experts MLPs on some layers.

Layer i is MoE when num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is not in
mlp_only_layers (transformers' Qwen3MoeDecoderLayer); the other layers are dense (an MLP of mlp_dim).
The two kinds keep their own parameter stacks, and the plan scans over the shortest repeating
stretch of kinds (qwen3-moe-30b-a3b: every layer MoE, a scan of period 1).
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.glu import glu
from meshlm.models.ffns.moe import moe_ffn, validate_softmax_routing
from meshlm.models.mixers.gqa import gqa
from meshlm.models.plans import periodic_plan


def layer_kinds(m: ModelConfig) -> tuple[str, ...]:
  only = set(m.mlp_only_layers)
  return tuple("moe" if m.num_experts and (i + 1) % m.decoder_sparse_step == 0 and i not in only else "dense"
               for i in range(m.num_layers))


def plan(m: ModelConfig) -> LayerPlan:
  return periodic_plan(layer_kinds(m), m.layer_contexts())


FAMILY = Family("qwen3_moe", kinds={"dense": Kind(gqa(), glu()), "moe": Kind(gqa(), moe_ffn())}, plan=plan,
                validate=validate_softmax_routing)
