"""llama 2/3: pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP.

mistral (sliding window) and qwen3 (q/k RMSNorm) reuse this block: both switches are ModelConfig
fields (`sliding_window`, `qk_norm`), and each family file owns only its Hugging Face mapping. The
window needs nothing here: with sliding_window set every layer is "local", and the decoder hands the
block a context whose mask is the sliding one.
"""
from __future__ import annotations

import jax

from meshlm.config import ConfigError, ModelConfig
from meshlm.hf import maps
from meshlm.models import spec as S
from meshlm.nn.attention import self_attention
from meshlm.nn.mlp import glu_mlp
from meshlm.nn.norm import rms_norm
from meshlm.parallel.sharding import constrain

ACT = ("batch", "length", "act_embed")


def attention_spec(m: ModelConfig) -> dict:
  D, N, K, H = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
  out = {
      "q": S.kernel((D, N, H), ("embed", "heads", "head_dim")),
      "k": S.kernel((D, K, H), ("embed", "kv_heads", "head_dim")),
      "v": S.kernel((D, K, H), ("embed", "kv_heads", "head_dim")),
      "o": S.kernel((N, H, D), ("heads", "head_dim", "embed"), n_in=2),
  }
  if m.qk_norm:
    out["q_norm"] = S.ones(H, "head_dim")
    out["k_norm"] = S.ones(H, "head_dim")
  return out


def mlp_spec(m: ModelConfig) -> dict:
  D, F = m.embed_dim, m.mlp_dim
  return {
      "gate": S.kernel((D, F), ("embed", "mlp")),
      "up": S.kernel((D, F), ("embed", "mlp")),
      "down": S.kernel((F, D), ("mlp", "embed")),
  }


def layer_spec(m: ModelConfig) -> dict:
  return {
      "attn_norm": S.ones(m.embed_dim),
      "attn": attention_spec(m),
      "mlp_norm": S.ones(m.embed_dim),
      "mlp": mlp_spec(m),
  }


def block(p: dict, x_BTD: jax.Array, ctx) -> jax.Array:
  m = ctx.model
  with jax.named_scope("attn"):
    h = rms_norm(p["attn_norm"], x_BTD, m.norm_eps)
    qk = {}
    if m.qk_norm:
      # Per-head RMSNorm over head_dim, before RoPE.
      qk = dict(q_norm=lambda q: rms_norm(p["attn"]["q_norm"], q, m.norm_eps),
                k_norm=lambda k: rms_norm(p["attn"]["k_norm"], k, m.norm_eps))
    x_BTD = x_BTD + self_attention(p["attn"], h, ctx, scale=m.head_dim ** -0.5, **qk)
  with jax.named_scope("mlp"):
    h = rms_norm(p["mlp_norm"], x_BTD, m.norm_eps)
    x_BTD = x_BTD + glu_mlp(p["mlp"], h, kernel_order=ctx.kernel_order, impl=ctx.impl)
  return constrain(x_BTD, ACT)


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
