"""gemma3 (text): gemma2's sandwich blocks plus per-head q/k (1 + w) RMSNorms (model.qk_norm), with
5 local : 1 global layers whose RoPE differs (local: rope_local_theta, unscaled; global: rope_theta
with linear rope_scaling). The pattern, the ropes and the grouped scan are the decoder's."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

# gemma2's layers (one kind, run with two contexts); the q/k norms are on when model.qk_norm is.
FAMILY = Family("gemma3", kinds={"dense": Kind(gqa(), glu(), sandwich=True)},
                norm_plus_one=True, embed_scale=True)
