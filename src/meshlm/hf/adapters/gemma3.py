"""Hugging Face adapter for gemma3 (the block is models/gemma3.py): config.json fields and tensor names."""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.hf import maps
from meshlm.hf.adapters.gemma2 import hf_layer_map, pattern_from_hf, sandwich_from_hf, sandwich_to_hf

# The text-only Gemma3ForCausalLM.
HF_MODEL_TYPE = "gemma3_text"
HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
# transformers' Gemma3TextConfig defaults, which it uses for any field a config.json leaves out
# (the published gemma-3 text_config lists only what differs from them).
HF_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "head_dim": 256, "num_key_value_heads": 4, "tie_word_embeddings": True,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
               "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}


def _ropes_from_hf(hf: dict) -> tuple[dict, float | None]:
  """(config.json view whose rope fields describe the global layers, local theta or None for "same").

  transformers 5 writes rope_parameters per attention context (its layer_types); older files have rope_theta, rope_scaling
  (global layers only) and rope_local_base_freq.
  """
  params = hf.get("rope_parameters")
  if not (isinstance(params, dict) and {"full_attention", "sliding_attention"} & params.keys()):
    view = {**hf, "rope_parameters": None}
    return view, float(hf["rope_local_base_freq"])
  full = {"rope_type": "default", "rope_theta": hf["rope_theta"], **(params.get("full_attention") or {})}
  local = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"], **(params.get("sliding_attention") or {})}
  view = {**hf, "rope_parameters": full, "rope_scaling": None}
  if local == full:
    return view, None
  if local["rope_type"] != "default":
    raise ConfigError(f"config.json: rope_parameters.sliding_attention={local!r} is not supported (meshlm's "
                      "local layers take plain RoPE with their own theta, or exactly the global layers' RoPE)")
  return view, float(local["rope_theta"])


def from_hf_config(hf: dict) -> dict:
  hf = {**HF_DEFAULTS, **hf}
  view, local_theta = _ropes_from_hf(hf)
  out = sandwich_from_hf(view, "gemma3")
  period = int(hf["sliding_window_pattern"])
  default = ["local"] * (period - 1) + ["global"]
  # Gemma3's attention never applies attn_logit_softcapping (the field is inert in transformers).
  return out | {"attn_logit_softcap": None, "qk_norm": True, "rope_local_theta": local_theta,
                "layer_pattern": pattern_from_hf(hf, out["num_layers"], default)}


def to_hf_config(m: ModelConfig) -> dict:
  if not m.qk_norm:
    raise ConfigError("model.qk_norm=false: Gemma3ForCausalLM always has q/k norms; use model.family=gemma2")
  if m.attn_logit_softcap is not None:
    raise ConfigError("model.attn_logit_softcap: Gemma3ForCausalLM ignores attention soft-capping; set it to null")
  out = sandwich_to_hf(m)
  full = out["rope_parameters"]
  local = dict(full) if m.rope_local_theta is None else {"rope_type": "default", "rope_theta": m.rope_local_theta}
  out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
  # Older transformers read these instead.
  out["rope_local_base_freq"] = local["rope_theta"]
  pattern = m.context_pattern()
  if pattern[-1] == "global" and all(c == "local" for c in pattern[:-1]):
    out["sliding_window_pattern"] = len(pattern)
  return out


ADAPTER = maps.Adapter(HF_MODEL_TYPE, HF_ARCHITECTURES, from_hf_config, to_hf_config, hf_layer_map)
