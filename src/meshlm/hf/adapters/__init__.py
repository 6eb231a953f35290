"""Hugging Face adapters, one file per family, apart from the family's block (models/<family>.py).

Family name -> the module defining its `ADAPTER` (meshlm.hf.maps.Adapter): hf/adapters/<family>.py for each
family of models/registry.FAMILIES that has one (the one family list; no second list here). A family without
the file trains but has no Hugging Face import or export.
"""
from pathlib import Path

from meshlm.models.registry import FAMILIES

ADAPTERS = {family: f"{__name__}.{family}" for family in FAMILIES
            if (Path(__file__).parent / f"{family}.py").is_file()}
