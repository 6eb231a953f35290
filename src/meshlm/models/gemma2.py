"""gemma2: gemma with norms both before and after attention and the MLP ("sandwich" layers),
attention-logit soft-capping, query_pre_attn_scalar, and alternating local/global layers (the
layer pattern and the final-logit cap are the decoder's, from ModelConfig)."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

# Local and global layers share their parameters' shapes: one kind, run with two contexts.
FAMILY = Family("gemma2", kinds={"dense": Kind(gqa(), glu(), sandwich=True)},
                norm_plus_one=True, embed_scale=True)
