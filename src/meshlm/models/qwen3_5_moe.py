"""qwen3_5_moe: Qwen3.5's hybrid (qwen3_5's layers) with a MoE and a gated shared expert on every layer; the
top-k routing weights are always renormalized (Hugging Face's Qwen3.5-MoE router has no switch)."""
from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.models.family import Family, Kind
from meshlm.models.ffns.moe import knobs, moe_ffn
from meshlm.models.mixers.gated_gqa import gated_gqa
from meshlm.models.mixers.gdn import gdn
from meshlm.models.plans import hybrid_plan, validate_hybrid


def validate(m) -> None:
  validate_hybrid(m, moe=True)
  if not knobs(m).norm_topk_prob:
    raise ConfigError("model.parts.moe.norm_topk_prob=false: qwen3_5_moe always renormalizes its top-k routing "
                      "weights")


FAMILY = Family(
    "qwen3_5_moe",
    kinds={"linear_attn": Kind(gdn(fused=False), moe_ffn(shared=True)),
           "full_attn": Kind(gated_gqa(), moe_ffn(shared=True))},
    plan=hybrid_plan, norm_plus_one=True, validate=validate)
