"""llama 2/3: pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP."""
from __future__ import annotations

import jax

from meshlm.config import ModelConfig
from meshlm.models import spec as S
from meshlm.nn.attention import self_attention
from meshlm.nn.mlp import glu_mlp
from meshlm.nn.norm import rms_norm
from meshlm.parallel.sharding import constrain

ACT = ("batch", "length", "act_embed")


def attention_spec(m: ModelConfig) -> dict:
  D, N, K, H = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
  return {
      "q": S.kernel((D, N, H), ("embed", "heads", "head_dim")),
      "k": S.kernel((D, K, H), ("embed", "kv_heads", "head_dim")),
      "v": S.kernel((D, K, H), ("embed", "kv_heads", "head_dim")),
      "o": S.kernel((N, H, D), ("heads", "head_dim", "embed"), n_in=2),
  }


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
    x_BTD = x_BTD + self_attention(p["attn"], h, ctx, scale=m.head_dim ** -0.5)
  with jax.named_scope("mlp"):
    h = rms_norm(p["mlp_norm"], x_BTD, m.norm_eps)
    x_BTD = x_BTD + glu_mlp(p["mlp"], h, kernel_order=ctx.kernel_order, impl=ctx.impl)
  return constrain(x_BTD, ACT)
