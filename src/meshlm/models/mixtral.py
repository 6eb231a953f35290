"""mixtral: mistral's attention (an optional sliding window, model.sliding_window) with every layer's MLP
a mixture of experts (models/moe_block.py); the top-k routing weights are always renormalized."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.models.family import Family, LayerPlan
from meshlm.models.moe_block import moe_kind


def plan(m: ModelConfig) -> LayerPlan:
  # ModelConfig refuses a mixtral without experts or with norm_topk_prob=false.
  types = m.layer_types()
  return LayerPlan(kinds=("moe",) * m.num_layers, contexts=tuple(types[i % len(types)] for i in range(m.num_layers)),
                   period=len(types))


FAMILY = Family("mixtral", kinds={"moe": moe_kind(norm_topk=True)}, plan=plan)
