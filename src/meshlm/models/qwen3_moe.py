"""qwen3_moe: qwen3's block (q/k RMSNorm) with mixture-of-experts MLPs on some layers.

Layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (transformers'
Qwen3MoeDecoderLayer, whose experts model.parts.moe.num_experts counts); the other layers are dense (an MLP of
mlp_dim). The plan's two keys are the family's, checked here (`validate`), not the moe part's.
The two kinds keep their own parameter stacks, and the plan scans over the shortest repeating
stretch of kinds (qwen3-moe-30b-a3b: every layer MoE, a scan of period 1).
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.glu import glu
from meshlm.models.ffns.moe import moe_ffn, validate_softmax_routing
from meshlm.models.mixers.gqa import gqa
from meshlm.models.plans import periodic_plan


def layer_kinds(m: ModelConfig) -> tuple[str, ...]:
  only = set(m.mlp_only_layers)
  return tuple("moe" if (i + 1) % m.decoder_sparse_step == 0 and i not in only else "dense"
               for i in range(m.num_layers))


def plan(m: ModelConfig) -> LayerPlan:
  return periodic_plan(layer_kinds(m), m.layer_contexts())


def validate(m: ModelConfig) -> None:
  """The plan's keys (each mlp_only_layers index a layer) and the softmax routing; one ConfigError line."""
  bad = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
  if bad:
    raise ConfigError(f"model.mlp_only_layers: layer {bad[0]} is not in [0, model.num_layers={m.num_layers})")
  validate_softmax_routing(m)


FAMILY = Family("qwen3_moe", kinds={"dense": Kind(gqa(), glu()), "moe": Kind(gqa(), moe_ffn())}, plan=plan,
                validate=validate)
