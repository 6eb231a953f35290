"""qwen3_5: the dense Qwen3.5 text model: qwen3_next's hybrid of `linear_attn` (gdn, with qwen3.5's separate
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) and `full_attn` (gated_gqa) layers, each with a dense GLU.
(1 + w) RMSNorms; the plan as qwen3_next's."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gated_gqa import gated_gqa
from meshlm.models.mixers.gdn import gdn
from meshlm.models.plans import hybrid_plan, validate_hybrid

FAMILY = Family(
    "qwen3_5",
    kinds={"linear_attn": Kind(gdn(fused=False), glu()),
           "full_attn": Kind(gated_gqa(), glu())},
    plan=hybrid_plan, norm_plus_one=True, validate=lambda m: validate_hybrid(m, moe=False))
