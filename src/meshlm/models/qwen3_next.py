"""qwen3_next: a Gated DeltaNet hybrid (Qwen3-Next). Most layers are `linear_attn` (the gdn mixer, its fused
per-key-head projections), every full_attention_interval-th is `full_attn` (gated_gqa: output gate, (1 + w)
q/k norms, partial rotary); every feed-forward is a MoE with a gated shared expert. Every RMSNorm is
zero-centred, (1 + w), except the GDN's gated norm (a plain scale starting at ones).

The plan reads model.hybrid_layer_types (Hugging Face's layer_types) or model.full_attention_interval and
scans over the shortest repeating stretch of kinds (qwen3-next-80b-a3b: 3 linear + 1 full, 12 periods).
`hybrid_plan` and `validate_hybrid` (models/plans.py) are shared with qwen3_5 and qwen3_5_moe.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.models.family import Family, Kind
from meshlm.models.ffns.moe import moe_ffn
from meshlm.models.mixers.gated_gqa import gated_gqa
from meshlm.models.mixers.gdn import gdn
from meshlm.models.plans import hybrid_plan, validate_hybrid


def validate(m: ModelConfig) -> None:
  validate_hybrid(m, moe=True)


FAMILY = Family(
    "qwen3_next",
    kinds={"linear_attn": Kind(gdn(fused=True), moe_ffn(shared=True)),
           "full_attn": Kind(gated_gqa(), moe_ffn(shared=True))},
    plan=hybrid_plan, norm_plus_one=True, validate=validate)
