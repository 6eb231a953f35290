"""Hugging Face adapters, one file per family, apart from the family's block (models/<family>.py).

Family name -> the module defining its `ADAPTER` (meshlm.hf.maps.Adapter). A family without an
entry trains but has no Hugging Face import or export.
"""
ADAPTERS = {
    "llama": "meshlm.hf.adapters.llama",
    "mistral": "meshlm.hf.adapters.mistral",
    "qwen3": "meshlm.hf.adapters.qwen3",
    "gemma": "meshlm.hf.adapters.gemma",
    "gemma2": "meshlm.hf.adapters.gemma2",
    "gemma3": "meshlm.hf.adapters.gemma3",
    "mixtral": "meshlm.hf.adapters.mixtral",
    "qwen3_moe": "meshlm.hf.adapters.qwen3_moe",
    "qwen3_next": "meshlm.hf.adapters.qwen3_next",
    "qwen3_5": "meshlm.hf.adapters.qwen3_5",
    "qwen3_5_moe": "meshlm.hf.adapters.qwen3_5_moe",
    "deepseek_v3": "meshlm.hf.adapters.deepseek_v3",
}
