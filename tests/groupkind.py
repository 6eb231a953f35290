"""A test family with DeepSeek-V3's MoE feed-forward: the gqa mixer + moe_ffn(shared=True, shared_gate=False,
routing="group_sigmoid") on every layer, validated by validate_group_routing. Registered by the tests
that need it (registry.FAMILIES["groupkind"] = "groupkind"), so routing and the router-bias state are
tested apart from the deepseek_v3 family (its MLA mixer and dense prefix)."""
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.moe import moe_ffn, validate_group_routing
from meshlm.models.mixers.gqa import gqa


def plan(m) -> LayerPlan:
  return LayerPlan(kinds=("moe",) * m.num_layers, contexts=m.layer_contexts(), period=len(m.context_pattern()))


FAMILY = Family("groupkind", kinds={"moe": Kind(gqa(), moe_ffn(shared=True, shared_gate=False, routing="group_sigmoid"))},
                plan=plan, validate=lambda m: validate_group_routing(m, shared=True))
