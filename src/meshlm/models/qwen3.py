"""qwen3: llama's block with RMSNorm on each q and k head before RoPE (model.qk_norm), tied or
untied head."""
from __future__ import annotations

from meshlm.models.blocks import dense_kind
from meshlm.models.family import Family

FAMILY = Family("qwen3", kinds={"dense": dense_kind()})
