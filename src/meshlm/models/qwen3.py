"""qwen3: llama's layers with RMSNorm on each q and k head before RoPE (model.qk_norm), tied or
untied head."""
from __future__ import annotations

from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu
from meshlm.models.mixers.gqa import gqa

FAMILY = Family("qwen3", kinds={"dense": Kind(gqa(), glu())})
