"""llama 2/3: pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP (models/blocks.py)."""
from __future__ import annotations

from meshlm.config import ConfigError, ModelConfig
from meshlm.hf import maps
from meshlm.models.blocks import dense_kind
from meshlm.models.family import Family

FAMILY = Family("llama", kinds={"dense": dense_kind()})


# Hugging Face mapping (see meshlm.hf.maps for the protocol).
HF_MODEL_TYPE = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM",)


def from_hf_config(hf: dict) -> dict:
  return {"family": "llama", **maps.llama_like_from_hf(hf)}


def to_hf_config(m: ModelConfig) -> dict:
  if m.sliding_window is not None or m.qk_norm:
    raise ConfigError("model.sliding_window / model.qk_norm: LlamaForCausalLM has neither; "
                      "use model.family=mistral or qwen3")
  return maps.llama_like_to_hf(m)


def hf_layer_map(m: ModelConfig) -> dict[str, maps.Tensor]:
  return maps.llama_like_layer_map(m)
