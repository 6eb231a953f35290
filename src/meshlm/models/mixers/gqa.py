"""The `gqa` mixer: grouped-query attention with RoPE, an optional sliding window (the context's mask
and cache), optional per-head q/k RMSNorm before RoPE (`model.qk_norm`: qwen3, gemma3), the score
scale `model.query_pre_attn_scalar` (default head_dim) and attention soft-capping
(`model.attn_logit_softcap`). Its decode state is K/V rows at the context's cache slots.

Under FSDP the query kernel is gathered once before the layer scan (`prepare`), in the compute dtype, as
the router is: each layer reads its slice of the gathered stack and its gradient is pinned back to the kernel's
sharding per layer (nn/gather_once.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import Compute, Instrument, Part, StateLeaf
from meshlm.nn import attention as A, gather_once
from meshlm.nn.kv_cache import CACHE_AXES
from meshlm.nn.norm import rms_norm


# The head fields attention reads (null by default: a model without attention needs none).
NEEDS = ("num_heads", "num_kv_heads", "head_dim")


def spec(m: ModelConfig, *, plus_one: bool = False) -> dict:
  D, N, Kv, H = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
  out = {"q": A.q_spec(D, N, H), **A.kv_specs(D, Kv, H), "o": A.o_spec(N, H, D)}
  if m.qk_norm:
    # (1 + w) norms start at w = 0, i.e. unit scale.
    norm = S.zeros if plus_one else S.ones
    out["q_norm"] = norm(H, "head_dim")
    out["k_norm"] = norm(H, "head_dim")
  return out


def state_spec(m: ModelConfig, batch: int, size: int) -> dict[str, StateLeaf]:
  shape = (batch, m.num_kv_heads, size, m.head_dim)  # [B, K, C, H]
  # Read in place: the pallas decode attention indexes a scanned layer's slots in the stacked cache itself.
  return {"k": StateLeaf(shape, CACHE_AXES, slot_axis=2, in_place=True),
          "v": StateLeaf(shape, CACHE_AXES, slot_axis=2, in_place=True)}


def prepare(p: dict, specs: dict, dtype) -> dict:
  """The query kernel stack gathered once (all but its layer and tensor-sharded axes) in the compute dtype,
  "q_full"."""
  return dict(p, q_full=gather_once.gather_stack(p["q"], specs["q"].axes, "q_gather_once", dtype))


def apply(p: dict, x_BTD: jax.Array, ctx, state: dict | None = None, *, plus_one: bool = False):
  """(attention output [B, T, D], update, {}). update: the new K/V rows ({"k", "v"} [B, Kv, T, H] in
  prefill, [B, Kv, 1, H] in decode), None when training. q, k and v are projected heads-first ([B, N, T, H],
  [B, Kv, T, H]: every core's rows and the cache's), in every mode.

  p: q [D, N, H] (+ q_full, its gathered copy), k/v [D, Kv, H], o [N, H, D], q_norm/k_norm [H].
  state (decode): the layer's cache {"k", "v"} [B, Kv, C, H], read only: the new position attends to
  the cache's other slots and to its own K/V, and the decoder writes the rows into the cache after
  the layer scan.
  """
  m = ctx.model
  dt = x_BTD.dtype
  with jax.named_scope("q"):
    q_kernel = gather_once.gathered(p["q"], p["q_full"], A.Q_AXES)
    q = ctx.dense(x_BTD, q_kernel.astype(dt), "btd,dnh->bnth", A.HEADS)  # [B, N, T, H]
  k, v = project_kv(p, x_BTD, ctx)
  if m.qk_norm:
    # Per-head RMSNorm over head_dim, before RoPE.
    q = rms_norm(p["q_norm"], q, m.norm_eps, plus_one=plus_one)
    k = rms_norm(p["k_norm"], k, m.norm_eps, plus_one=plus_one)
  q, k = ctx.rope(q, m.head_dim), ctx.rope(k, m.head_dim)
  y, update = attend(q, k, v, ctx.cast(p["o"], dt), ctx, state)
  return y, update, {}


def project_kv(p: dict, x_BTD: jax.Array, ctx) -> tuple[jax.Array, jax.Array]:
  """k, v [B, Kv, T, H] through ctx.dense: the dot emits the heads-first rows itself, so no transpose sits between
  it and the core (nor, in the backward, between the output projection's dot and the core)."""
  dt = x_BTD.dtype
  with jax.named_scope("k"):
    k = ctx.dense(x_BTD, ctx.cast(p["k"], dt), "btd,dkh->bkth", A.KV)
  with jax.named_scope("v"):
    v = ctx.dense(x_BTD, ctx.cast(p["v"], dt), "btd,dkh->bkth", A.KV)
  return k, v


def attend(q: jax.Array, k: jax.Array, v: jax.Array, w_o: jax.Array, ctx, state: dict | None = None,
           gate: jax.Array | None = None):
  """The attention core against the context's mask (and, in decode, the cache) and the output projection:
  (y [B, T, D], update). q [B, N, T, H], k/v [B, Kv, T, H] after RoPE; w_o [N, H, D] in the compute dtype.
  gate [B, N, T, H] (gated_gqa; laid out as q): the core's output times sigmoid(gate) before the projection. The
  update is the K/V rows, already in the cache's layout [B, Kv, T, H] (None when training); the cache is only
  read here. Training and prefill: ctx.attend (the context's core); decode: one new position against the cache,
  in the same attend-and-project region (nn/attention.attend_and_project)."""
  m = ctx.model
  scale = (m.query_pre_attn_scalar or m.head_dim) ** -0.5
  softcap = m.attn_logit_softcap
  update = None if ctx.mode == "train" else {"k": k, "v": v}
  if ctx.mode != "decode":
    return ctx.attend(q, k, v, w_o, scale=scale, softcap=softcap, gate=gate), update

  def decode(q, k, v, k_cache, v_cache, slots):  # the cache leaves: the layer's rows, or LayerRows of the stack
    return ctx.decode.attend(q, k, v, k_cache, v_cache, slots, scale=scale, softcap=softcap)
  y = A.attend_and_project(decode, (q, k, v, state["k"], state["v"], ctx.here.cache), w_o, ctx.dense,
                           rows=(q.shape[0], 1), gate=gate)
  return y, update


def attention_shape(m: ModelConfig) -> A.Shape:
  """N query heads over Kv KV heads, head_dim for q/k and v, the logit soft-cap."""
  return A.Shape(m.num_heads, m.num_kv_heads, m.head_dim, m.head_dim, m.attn_logit_softcap)


def attention_width(m: ModelConfig) -> int:
  """N x (qk + v head dims), H each: what a query's scores and values multiply per key it sees (the model FLOPs)."""
  return 2 * m.num_heads * m.head_dim


def gqa() -> Part:
  """The part with plain q/k norms; a Family with norm_plus_one (gemma3) makes them (1 + w) (with_plus_one)."""
  return Part(name="gqa", key="attn", spec=spec, apply=apply, state_spec=state_spec, needs=NEEDS,
              rotary_dims=lambda m: (m.head_dim,), compute=Compute(prepare=prepare, with_plus_one=with_plus_one),
              instrument=Instrument(attention_width=attention_width, attention_shape=attention_shape))


def _is_own(fn, base) -> bool:
  """fn is `base` or a functools.partial of it (gqa's spec/apply, plain or with plus_one bound)."""
  return fn is base or (isinstance(fn, functools.partial) and fn.func is base)


def with_plus_one(part: Part, on: bool) -> Part:
  """`part` (gqa's, or a copy with other fields replaced: name, state_spec, ...) with its q/k norms scaling by
  (1 + w) when on, plainly otherwise; a family built again from another's kinds switches them back. A part whose
  spec or apply is no longer gqa's (a test's broken twin) is kept as it is when off, and refused when on: the
  switch cannot reach into someone else's apply."""
  if not (_is_own(part.spec, spec) and _is_own(part.apply, apply)):
    if not on:
      return part
    raise ValueError(f"part {part.name!r}: its spec or apply is not gqa's, so norm_plus_one cannot make its q/k "
                     "norms (1 + w); give the part that does")
  return dataclasses.replace(part, spec=functools.partial(spec, plus_one=on),
                             apply=functools.partial(apply, plus_one=on))
