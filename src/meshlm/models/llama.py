"""llama 2/3: pre-norm layers of GQA attention with RoPE and a SwiGLU MLP."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

FAMILY = Family("llama", kinds={"dense": Kind(gqa(), glu())})
