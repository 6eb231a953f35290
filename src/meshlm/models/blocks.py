"""The "dense" layer kind every dense family uses: pre-norm GQA attention with RoPE, then a GLU MLP.

Switches, all from the config or the family: q/k RMSNorm over head_dim before RoPE
(`model.qk_norm`: qwen3, gemma3), (1 + w) norms (gemma's `norm_plus_one`), norms after attention and
after the MLP too ("sandwich": gemma2/3), the GLU's activation (`model.hidden_activation`), the score
scale (`model.query_pre_attn_scalar`, default head_dim) and attention soft-capping
(`model.attn_logit_softcap`). Sliding windows need nothing here: the decoder hands local layers a
context whose mask (and cache) is the window's.
"""
from __future__ import annotations

import functools

import jax

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import Kind
from meshlm.nn.attention import self_attention
from meshlm.nn.mlp import ACTIVATIONS, glu_mlp
from meshlm.nn.norm import rms_norm
from meshlm.parallel.sharding import ACT, constrain


def attention_spec(m: ModelConfig, plus_one: bool = False) -> dict:
  D, N, K, H = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
  out = {
      "q": S.kernel((D, N, H), ("embed", "heads", "head_dim")),
      "k": S.kernel((D, K, H), ("embed", "kv_heads", "head_dim")),
      "v": S.kernel((D, K, H), ("embed", "kv_heads", "head_dim")),
      "o": S.kernel((N, H, D), ("heads", "head_dim", "embed"), n_in=2),
  }
  if m.qk_norm:
    # (1 + w) norms start at w = 0, i.e. unit scale.
    norm = S.zeros if plus_one else S.ones
    out["q_norm"] = norm(H, "head_dim")
    out["k_norm"] = norm(H, "head_dim")
  return out


def mlp_spec(m: ModelConfig) -> dict:
  D, F = m.embed_dim, m.mlp_dim
  return {
      "gate": S.kernel((D, F), ("embed", "mlp")),
      "up": S.kernel((D, F), ("embed", "mlp")),
      "down": S.kernel((F, D), ("mlp", "embed")),
  }


def layer_spec(m: ModelConfig, *, plus_one: bool = False, sandwich: bool = False) -> dict:
  norm = S.zeros if plus_one else S.ones
  out = {
      "attn_norm": norm(m.embed_dim),
      "attn": attention_spec(m, plus_one),
      "mlp_norm": norm(m.embed_dim),
      "mlp": mlp_spec(m),
  }
  if sandwich:
    out["attn_post_norm"] = norm(m.embed_dim)
    out["mlp_post_norm"] = norm(m.embed_dim)
  return out


def attention_residual(p: dict, x_BTD: jax.Array, ctx, state=None, *, plus_one: bool = False,
                       sandwich: bool = False):
  """The attention half of a layer, x + attn(norm(x)) (post-normed when sandwich): (x [B, T, D], state).
  Every kind with pre-norm attention (dense, moe) runs this, then its own feed-forward."""
  m = ctx.model

  def norm(scale, y):
    return rms_norm(scale, y, m.norm_eps, plus_one=plus_one)

  with jax.named_scope("attn"):
    h = norm(p["attn_norm"], x_BTD)
    qk = {}
    if m.qk_norm:
      # Per-head RMSNorm over head_dim, before RoPE.
      qk = dict(q_norm=lambda q: norm(p["attn"]["q_norm"], q), k_norm=lambda k: norm(p["attn"]["k_norm"], k))
    a, state = self_attention(p["attn"], h, ctx, state, scale=(m.query_pre_attn_scalar or m.head_dim) ** -0.5,
                              softcap=m.attn_logit_softcap, **qk)
    x_BTD = x_BTD + (norm(p["attn_post_norm"], a) if sandwich else a)
  return x_BTD, state


def block(p: dict, x_BTD: jax.Array, ctx, state=None, *, plus_one: bool = False, sandwich: bool = False):
  m = ctx.model

  def norm(scale, y):
    return rms_norm(scale, y, m.norm_eps, plus_one=plus_one)

  x_BTD, state = attention_residual(p, x_BTD, ctx, state, plus_one=plus_one, sandwich=sandwich)
  with jax.named_scope("mlp"):
    h = norm(p["mlp_norm"], x_BTD)
    h = glu_mlp(p["mlp"], h, dense=ctx.dense, activation=ACTIVATIONS[m.hidden_activation])
    x_BTD = x_BTD + (norm(p["mlp_post_norm"], h) if sandwich else h)
  return constrain(x_BTD, ACT), state, {}


def dense_kind(*, plus_one: bool = False, sandwich: bool = False) -> Kind:
  return Kind(spec=functools.partial(layer_spec, plus_one=plus_one, sandwich=sandwich),
              block=functools.partial(block, plus_one=plus_one, sandwich=sandwich))
