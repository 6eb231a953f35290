"""mixtral: mistral's attention (an optional sliding window, model.sliding_window) with every layer's
feed-forward a mixture of experts (models/ffns/moe.py); the top-k routing weights are always
renormalized."""
from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.moe import knobs, moe_ffn, validate_softmax_routing
from meshlm.models.mixers.gqa import gqa


def validate(m) -> None:
  if not knobs(m).norm_topk_prob:
    raise ConfigError("model.parts.moe.norm_topk_prob=false: mixtral always renormalizes its top-k routing weights")
  validate_softmax_routing(m)


def plan(m) -> LayerPlan:
  return LayerPlan(kinds=("moe",) * m.num_layers, contexts=m.layer_contexts(), period=len(m.context_pattern()))


FAMILY = Family("mixtral", kinds={"moe": Kind(gqa(), moe_ffn())}, plan=plan, validate=validate)
