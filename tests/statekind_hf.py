"""A Hugging Face mapping for the statekind test family (tests/statekind.py): llama's names and config, plus its
model-state leaf as `model.layers.{i}.mlp.ema`. Registered by tests that need it
(hf.adapters.ADAPTERS["statekind"] = "statekind_hf"), beside registry.FAMILIES["statekind"]."""
from meshlm.hf import maps
from meshlm.hf.adapters import llama


def from_hf_config(hf: dict) -> dict:
  return {**llama.from_hf_config(hf), "family": "statekind"}


def layer_map(m) -> dict:
  return {**maps.llama_like_layer_map(m), "mlp.ema": maps.Tensor("model.layers.{i}.mlp.ema")}


ADAPTER = maps.Adapter("statekind", ("StatekindForCausalLM",), from_hf_config, llama.to_hf_config, layer_map)
