"""mistral: llama's layers with sliding-window attention on every layer (model.sliding_window)."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

FAMILY = Family("mistral", kinds={"dense": Kind(gqa(), glu())})
