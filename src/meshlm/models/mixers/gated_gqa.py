"""The `gated_gqa` mixer (qwen3-next, qwen3.5 full-attention layers): gqa with an output gate, zero-centred
q/k norms and partial rotary.

    q | gate = q_proj(x)                  [B, T, N, 2H], split per head: q the first H dims, gate the last H
    q, k = (1 + w) RMSNorm over H         always, whatever Family.norm_plus_one (Hugging Face's own)
    q, k = RoPE on the first rot dims     rot = int(head_dim * partial_rotary_factor), half-split pairs within
                                          those rot dims (transformers' apply_rotary_pos_emb); the rest pass
    y = o_proj(attention(q, k, v) * sigmoid(gate))

qwen3.5's interleaved MRoPE (mrope_section over the rot / 2 frequencies, each frequency taking its angle from
the temporal, height or width position id) is ordinary RoPE on the rotated dims for text: text tokens carry
the same position in all three components, so every frequency reads the same position whichever component
it is assigned to, and the interleaving permutes nothing that differs.

Parameters (part key "attn"; Hugging Face torch weights in brackets): q [D, N, 2H] (head n: q(H) | gate(H))
[q_proj.weight [N*2H, D]: .T.reshape(D, N, 2H)], k/v [D, Kv, H], o [N, H, D], q_norm/k_norm [H] (zeros:
(1 + w) starts at unit scale). The attention core, the cache rows and the gather-once of q are gqa's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import Compute, Instrument, Part
from meshlm.models.mixers import gqa
from meshlm.nn import attention as A, gather_once
from meshlm.nn.norm import rms_norm
from meshlm.nn.rope import apply_rope


def spec(m: ModelConfig) -> dict:
  D, N, Kv, H = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
  return {
      "q": A.q_spec(D, N, 2 * H),  # head n: q(H) | gate(H)
      **A.kv_specs(D, Kv, H),
      "o": A.o_spec(N, H, D),
      "q_norm": S.zeros(H, "head_dim"),
      "k_norm": S.zeros(H, "head_dim"),
  }


def partial_rope(x_BNTH: jax.Array, cos: jax.Array, sin_signed: jax.Array, by_matmul: bool | None = None) -> jax.Array:
  """RoPE on the first rot = cos.shape[-1] dims of each head; the others pass unchanged. x [B, N, T, H]; cos and
  the sign-folded sin [B, T, rot] (apply_rope; by_matmul: the context's rope_swap)."""
  rot = cos.shape[-1]
  if rot == x_BNTH.shape[-1]:
    return apply_rope(x_BNTH, cos, sin_signed, by_matmul)
  return jnp.concatenate([apply_rope(x_BNTH[..., :rot], cos, sin_signed, by_matmul), x_BNTH[..., rot:]], axis=-1)


def apply(p: dict, x_BTD: jax.Array, ctx, state: dict | None = None):
  """As gqa.apply, with the gate: (y [B, T, D], the K/V rows or None, {})."""
  m = ctx.model
  dt = x_BTD.dtype
  H = m.head_dim
  with jax.named_scope("q"):
    q_kernel = gather_once.gathered(p["q"], p["q_full"], A.Q_AXES)
    qg = ctx.dense(x_BTD, q_kernel.astype(dt), "btd,dnh->bnth", A.HEADS)  # [B, N, T, 2H]
  q, gate = qg[..., :H], qg[..., H:]
  k, v = gqa.project_kv(p, x_BTD, ctx)
  q = rms_norm(p["q_norm"], q, m.norm_eps, plus_one=True)
  k = rms_norm(p["k_norm"], k, m.norm_eps, plus_one=True)
  cos, sin_signed = ctx.here.rope[m.rotary_dim()]
  q, k = (partial_rope(x, cos, sin_signed, ctx.rope_by_matmul) for x in (q, k))
  y, update = gqa.attend(q, k, v, ctx.cast(p["o"], dt), ctx, state, gate=gate)
  return y, update, {}


def gated_gqa() -> Part:
  return Part(name="gated_gqa", key="attn", spec=spec, apply=apply, state_spec=gqa.state_spec, needs=gqa.NEEDS,
              rotary_dims=lambda m: (m.rotary_dim(),), compute=Compute(prepare=gqa.prepare),
              instrument=Instrument(attention_width=gqa.attention_width, attention_shape=gqa.attention_shape))
