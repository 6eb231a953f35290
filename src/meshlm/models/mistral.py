"""mistral: llama's block with sliding-window attention on every layer (model.sliding_window)."""
from __future__ import annotations

from meshlm.models.blocks import dense_kind
from meshlm.models.family import Family

FAMILY = Family("mistral", kinds={"dense": dense_kind()})
