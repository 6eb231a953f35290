"""The `mla` mixer (deepseek_v3): multi-head latent attention, as transformers' DeepseekV3Attention.

    q           = q_b(rms(q_a(x)))  with q_lora_rank, else q(x)             [B, T, N, Hn + Hr]: [nope, rope]
    c | k_rope  = kv_a(x)                                                   [B, T, Rkv + Hr]
    c           = rms(c)                                                    the compressed kv (the latent)
    k_nope, v   = k_b(c), v_b(c)                                            [B, T, N, Hn], [B, T, N, Hv]
    q_rope, k_rope = RoPE on the rope dims only; k_rope is one head, shared by every query head
    y           = o(softmax(q . [k_nope, k_rope] * scale) v)

RoPE rotates rotate-half pairs, or adjacent pairs with rope_interleave (nn/rope.apply_rope_interleave).
The context gives cos/sin at width Hr from the positions (nn/rope.freqs_at), carrying YaRN's attention factor;
the softmax scale carries YaRN's other correction: (Hn + Hr) ** -0.5 * mscale(factor, mscale_all_dim) ** 2
(nn/rope.softmax_mscale, transformers' yarn_apply_mscale). The q_a and kv_a norms use eps 1e-6, as
transformers' (DeepseekV3RMSNorm's default, not rms_norm_eps).

Decode state: the latent, not per-head K/V: "kv" [B, C, Rkv] (c after its norm) and "k_rope" [B, C, Hr] (after
RoPE), Rkv + Hr numbers per cached position. Training and prefill run the plain path (K/V expanded from the
latent). Decode with absorb (default) absorbs k_b into the query (q_nope k_b^T: a query in the latent space) and
v_b into the output side, so the new position attends to the latent rows directly (DeepSeek's own inference, vLLM
and SGLang do this); with absorb=false it rebuilds K/V from the latent rows (the plain path, the reference the
absorbed one is tested against).

Its own knobs, model.parts.mla.<knob> (`MLAConfig`; the old flat keys, model.q_lora_rank, model.kv_lora_rank,
model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.rope_interleave and model.mla_absorb, still
set them): the ranks and head dims (Rq, Rkv, Hn, Hr, Hv) are required but q_lora_rank (null: a plain q
projection), Hr is even; absorb says how decode computes (COMPUTE: a checkpoint resumes under either). The query
heads are the model's num_heads (Part.needs), as attention's are.

Parameters (part key "attn"; Hugging Face torch weights in brackets, each transposed): q_a [D, Rq]
[q_a_proj], q_a_norm [Rq] [q_a_layernorm], q_b [Rq, N, Hn + Hr] [q_b_proj] (or q [D, N, Hn + Hr] [q_proj]),
kv_a [D, Rkv + Hr] [kv_a_proj_with_mqa], kv_a_norm [Rkv] [kv_a_layernorm], k_b [Rkv, N, Hn] and v_b [Rkv, N,
Hv] [kv_b_proj's per-head rows, k_nope then v], o [N, Hv, D] [o_proj]. Every projection goes through
ctx.dense; the attention core and o run in one auto-axes region, as gqa's do. q, k_nope and v are projected
heads-first, [B, N, T, .], every core's rows, and o contracts the core's output as it is: no transpose sits apart
from its dot (0 blocked pairs under explicit).
"""
from __future__ import annotations

from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import pydantic
from pydantic import Field

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import Instrument, Part, PartConfig, StateLeaf, section
from meshlm.nn import attention as A, mla as mla_core
from meshlm.nn.norm import rms_norm
from meshlm.nn.rope import apply_rope_interleave, softmax_mscale
from meshlm.parallel.sharding import axes

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm (their default eps)
LATENT = axes("batch", "length", None)  # a latent row [B, T, Rq] or [B, T, Rkv + Hr]
HEADS_LATENT = axes("batch", "heads", "length", None)  # the absorbed query [B, N, 1, Rkv]
CACHE_AXES = axes("batch", None, None)  # "kv" [B, C, Rkv], "k_rope" [B, C, Hr]
# The model fields it reads that default to null (the query heads); its ranks and head dims are its own knobs.
NEEDS = ("num_heads",)


class MLAConfig(PartConfig):
  """The mla part's own knobs: model.parts.mla.<knob> (their old flat keys, ModelConfig.MOVED, still set them).
  Letters (docs/architecture.md): Rq/Rkv the lora ranks, Hn/Hr/Hv the nope, rope and value head dims; each
  query/key head is Hn + Hr wide, [nope, rope]."""
  # How the layer computes with the same parameters (a checkpoint resumes under another value).
  COMPUTE: ClassVar[tuple[str, ...]] = ("absorb",)
  q_lora_rank: Optional[int] = Field(default=None, gt=0, description="rank Rq of the query's low-rank projection "
                                     "(q_a -> q_a_norm -> q_b); null: a plain q projection")
  kv_lora_rank: int = Field(gt=0, description="rank Rkv of the compressed kv (the latent the decode cache holds)")
  qk_nope_head_dim: int = Field(gt=0, description="per-head query/key dims without RoPE (Hn)")
  qk_rope_head_dim: int = Field(gt=0, description="per-head query dims with RoPE, and the width of the one rope key "
                                "shared by every head (Hr, even)")
  v_head_dim: int = Field(gt=0, description="per-head value dims (Hv)")
  rope_interleave: bool = Field(default=False, description="RoPE rotates adjacent pairs (x0, x1), (x2, x3) of the "
                                "rope dims, as transformers' apply_rotary_pos_emb_interleave; false: rotate-half pairs")
  absorb: bool = Field(default=True, description="decode: absorb k_b into the query and v_b into the output, "
                       "attending against the latent cache directly; false: rebuild K/V from it")

  @pydantic.field_validator("qk_rope_head_dim")
  @classmethod
  def _even(cls, h: int) -> int:
    if h % 2:
      raise ValueError(f"{h} must be even (RoPE rotates pairs)")
    return h


def knobs(m: ModelConfig) -> MLAConfig:
  """model.parts.mla, its defaults filled in."""
  return section(m, PART)


def spec(m: ModelConfig) -> dict:
  own = knobs(m)
  D, N, R, Rq = m.embed_dim, m.num_heads, own.kv_lora_rank, own.q_lora_rank
  Hn, Hr, Hv = own.qk_nope_head_dim, own.qk_rope_head_dim, own.v_head_dim
  out = {}
  if Rq is not None:
    out["q_a"] = S.kernel((D, Rq), ("embed", None))
    out["q_a_norm"] = S.vector(Rq, "ones")
    out["q_b"] = S.kernel((Rq, N, Hn + Hr), ("latent", "heads", "head_dim"))
  else:
    out["q"] = A.q_spec(D, N, Hn + Hr)
  out["kv_a"] = S.kernel((D, R + Hr), ("embed", None))
  out["kv_a_norm"] = S.vector(R, "ones")
  out["k_b"] = S.kernel((R, N, Hn), ("latent", "heads", "head_dim"))
  out["v_b"] = S.kernel((R, N, Hv), ("latent", "heads", "head_dim"))
  out["o"] = A.o_spec(N, Hv, D)
  return out


def state_spec(m: ModelConfig, batch: int, size: int) -> dict[str, StateLeaf]:
  own = knobs(m)
  return {"kv": StateLeaf((batch, size, own.kv_lora_rank), CACHE_AXES),
          "k_rope": StateLeaf((batch, size, own.qk_rope_head_dim), CACHE_AXES)}


def softmax_scale(m: ModelConfig) -> float:
  own = knobs(m)
  return (own.qk_nope_head_dim + own.qk_rope_head_dim) ** -0.5 * softmax_mscale(m.rope_scaling)


def project_q(p: dict, x_BTD: jax.Array, ctx) -> jax.Array:
  """q [B, N, T, Hn + Hr] (heads-first rows, gqa's) through ctx.dense (q_a -> norm -> q_b, or q)."""
  dt = x_BTD.dtype
  if knobs(ctx.model).q_lora_rank is None:
    with jax.named_scope("q"):
      return ctx.dense(x_BTD, ctx.cast(p["q"], dt), "btd,dnh->bnth", A.HEADS)
  with jax.named_scope("q_a"):
    qa = ctx.dense(x_BTD, ctx.cast(p["q_a"], dt), "btd,dr->btr", LATENT)  # [B, T, Rq]
  qa = rms_norm(p["q_a_norm"], qa, LATENT_NORM_EPS)
  with jax.named_scope("q_b"):
    return ctx.dense(qa, ctx.cast(p["q_b"], dt), "btr,rnh->bnth", A.HEADS)


def project_latent(p: dict, x_BTD: jax.Array, ctx) -> tuple[jax.Array, jax.Array]:
  """(c [B, T, Rkv] after its norm, the rope key [B, T, Hr] before RoPE), through ctx.dense."""
  R = knobs(ctx.model).kv_lora_rank
  with jax.named_scope("kv_a"):
    ckr = ctx.dense(x_BTD, ctx.cast(p["kv_a"], x_BTD.dtype), "btd,dr->btr", LATENT)  # [B, T, Rkv + Hr]
  return rms_norm(p["kv_a_norm"], ckr[..., :R], LATENT_NORM_EPS), ckr[..., R:]


def apply(p: dict, x_BTD: jax.Array, ctx, state: dict | None = None):
  """(attention output [B, T, D], update, {}). update: the latent rows {"kv" [B, T, Rkv], "k_rope" [B, T, Hr]}
  (T = 1 in decode), None when training. state (decode): the layer's latent cache, read only."""
  m, own = ctx.model, knobs(ctx.model)
  dt = x_BTD.dtype
  Hn = own.qk_nope_head_dim
  q = project_q(p, x_BTD, ctx)  # [B, N, T, Hn + Hr]
  c, k_rope = project_latent(p, x_BTD, ctx)
  Hr = own.qk_rope_head_dim
  cos, sin_signed = ctx.here.rope[Hr]
  rope = (lambda x: apply_rope_interleave(x, cos, sin_signed)) if own.rope_interleave else (lambda x: ctx.rope(x, Hr))
  q_nope, q_rope = q[..., :Hn], rope(q[..., Hn:])
  k_rope = rope(k_rope[:, None])[:, 0]  # [B, T, Hr]: one head, shared by every query head
  update = None if ctx.mode == "train" else {"kv": c, "k_rope": k_rope}
  w = {name: ctx.cast(p[name], dt) for name in ("k_b", "v_b", "o")}
  if ctx.mode == "decode":
    return decode(q_nope, q_rope, c, k_rope, w, ctx, state), update, {}
  with jax.named_scope("k_b"):
    k_nope = ctx.dense(c, w["k_b"], "btr,rnh->bnth", A.HEADS)  # [B, N, T, Hn]
  with jax.named_scope("v_b"):
    v = ctx.dense(c, w["v_b"], "btr,rnh->bnth", A.HEADS)  # [B, N, T, Hv]

  def rows(q, k, v):  # inside the region: q's nope and rope dims joined, the one rope key given to every head
    (q_nope, q_rope), (k_nope, k_rope) = q, k
    shared = jnp.broadcast_to(k_rope[:, None], k_nope.shape[:3] + k_rope.shape[-1:])  # [B, N, T, Hr]
    return jnp.concatenate([q_nope, q_rope], axis=-1), jnp.concatenate([k_nope, shared], axis=-1), v
  y = ctx.attend((q_nope, q_rope), (k_nope, k_rope), v, w["o"], scale=softmax_scale(m), rows=rows)
  return y, update, {}


def decode(q_nope, q_rope, c, k_rope, w: dict, ctx, state: dict) -> jax.Array:
  """One new position per row against the latent cache: y [B, 1, D], absorbed (model.parts.mla.absorb) or plain."""
  m, here, dense = ctx.model, ctx.here, ctx.dense
  scale = softmax_scale(m)
  mask = A.decode_mask(here.cache.read_mask, here.cache.write)  # [B, 1, 1, 1, C]

  def absorbed(q_nope, q_rope, c, k_rope, kv, kr, mask, k_b, v_b):
    with jax.named_scope("k_b"):
      q_lat = dense(q_nope, k_b, "bnth,rnh->bntr", HEADS_LATENT)  # [B, N, 1, Rkv]
    o_lat = mla_core.absorbed_decode(q_lat, q_rope, c, k_rope, kv, kr, mask, scale=scale)  # [B, N, 1, Rkv]
    with jax.named_scope("v_b"):
      return dense(o_lat, v_b, "bntr,rnh->bnth", A.HEADS)  # [B, N, 1, Hv]

  def plain(q_nope, q_rope, c, k_rope, kv, kr, mask, k_b, v_b):
    return mla_core.expanded_decode(q_nope, q_rope, c, k_rope, kv, kr, mask, k_b, v_b, scale=scale, dense=dense)

  args = (q_nope, q_rope, c, k_rope, state["kv"], state["k_rope"], mask, w["k_b"], w["v_b"])
  return A.attend_and_project(absorbed if knobs(m).absorb else plain, args, w["o"], dense, rows=(q_nope.shape[0], 1))


def attention_shape(m: ModelConfig) -> A.Shape:
  """N query heads, each its own key (G = 1: the shared rope key is broadcast to every head), q/k Hn + Hr, v Hv."""
  own = knobs(m)
  return A.Shape(m.num_heads, m.num_heads, own.qk_nope_head_dim + own.qk_rope_head_dim, own.v_head_dim)


def attention_width(m: ModelConfig) -> int:
  """N x (Hn + Hr + Hv): what a query's scores and values multiply per key it sees (the model FLOPs)."""
  own = knobs(m)
  return m.num_heads * (own.qk_nope_head_dim + own.qk_rope_head_dim + own.v_head_dim)


PART = Part(name="mla", key="attn", spec=spec, apply=apply, state_spec=state_spec,
            rotary_dims=lambda m: (knobs(m).qk_rope_head_dim,), config=MLAConfig, needs=NEEDS,
            instrument=Instrument(attention_width=attention_width, attention_shape=attention_shape))


def mla() -> Part:
  return PART
