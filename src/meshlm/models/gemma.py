"""gemma: llama-shaped pre-norm layers with (1 + w) RMSNorms, a tanh-GELU GLU, an embedding scaled by
sqrt(D) and a tied head (the last two live in the decoder, switched on by the family's flags)."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

# (1 + w) norms everywhere (layers, q/k, final: norm_plus_one); embeddings are multiplied by sqrt(D).
FAMILY = Family("gemma", kinds={"dense": Kind(gqa(), glu())}, norm_plus_one=True, embed_scale=True)
