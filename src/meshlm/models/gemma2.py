"""gemma2: gemma with norms both before and after attention and the MLP ("sandwich" blocks),
attention-logit soft-capping, query_pre_attn_scalar, and alternating local/global layers (the
layer pattern and the final-logit cap are the decoder's, from ModelConfig)."""
from __future__ import annotations

from meshlm.models.blocks import dense_kind
from meshlm.models.family import Family

# Local and global layers share their parameters' shapes: one kind, run with two contexts.
FAMILY = Family("gemma2", kinds={"dense": dense_kind(plus_one=True, sandwich=True)}, norm_plus_one=True,
                embed_scale=True)
