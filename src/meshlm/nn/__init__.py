"""Layers: plain functions of (params, x) that name their scopes."""
from meshlm.nn.attention import attention_mask, gqa_attention
from meshlm.nn.dense import dense
from meshlm.nn.embed import attend, embed
from meshlm.nn.mlp import glu_mlp
from meshlm.nn.norm import rms_norm
from meshlm.nn.rope import apply_rope, inv_frequencies, rope_angles

__all__ = ["apply_rope", "attend", "attention_mask", "dense", "embed", "glu_mlp", "gqa_attention",
           "inv_frequencies", "rms_norm", "rope_angles"]
