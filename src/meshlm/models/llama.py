"""llama 2/3: pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP (models/blocks.py)."""
from __future__ import annotations

from meshlm.models.blocks import dense_kind
from meshlm.models.family import Family

FAMILY = Family("llama", kinds={"dense": dense_kind()})
