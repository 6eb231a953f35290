"""The generic decoder: embed -> layers (by plan) -> final norm -> head.

A family (models/family.py) gives the layer kinds and the plan; `models/model.py` resolves them once
per config (every entry point here takes a Config or that Model). The trees (parameter and model-state
specs, init, shardings) live in models/params.py and the layer loop (prefix unrolled, a scan over whole
periods, the rest unrolled; the decode state) in models/layers.py: import those names from there (this
module re-exports none of them; tests/test_imports.py holds that).

Three entry points share one path: `forward` (training and scoring: logits for every position),
`prefill` (a right-padded prompt block; returns the logits and a fresh cache) and `decode` (one new
token per row against the cache). A loss reads the targets' log-probs from models/logprobs.py, which starts
from `features` (forward without the head) and runs the head materialized or blockwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.config import Config
from meshlm.models import layers as L
from meshlm.models.context import Context, make_context
from meshlm.models.model import Model, resolve
from meshlm.nn.dense import dense
from meshlm.nn.embed import attend, embed, lookup_table
from meshlm.nn.norm import rms_norm
from meshlm.parallel.sharding import ACT, LOGITS, constrain, einsum

__all__ = ["apply", "context", "decode", "features", "forward", "head", "input_readers", "loop_invariants",
           "plan", "prefill", "trunk"]


def plan(cfg: Config | Model):
  """cfg's LayerPlan."""
  return resolve(cfg).plan


def input_readers(cfg: Config | Model, name: str) -> list[int]:
  """The model layers (in order) whose kind has a part that reads the per-layer input `name`."""
  return resolve(cfg).input_readers(name)


def head(cfg: Config | Model, params: dict, x_BTD: jax.Array) -> jax.Array:
  """Logits [B, T, V] from the final-normed activations, soft-capped when the model asks for it."""
  cfg = resolve(cfg).cfg
  with jax.named_scope("lm_head"):
    if cfg.model.tie_embeddings:
      logits = attend(params["embed"], x_BTD)
    else:
      logits = dense(x_BTD, params["lm_head"].astype(x_BTD.dtype), "btd,dv->btv", LOGITS,
                     kernel_order=cfg.lm_head_kernel_order, impl=cfg.weight_grad_impl, scatter=cfg.scatter_leading)
    cap = cfg.model.final_logit_softcap
    if cap is not None:
      logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
    return logits


def loop_invariants(cfg: Config | Model, params: dict) -> dict:
  """What a forward computes from the parameters alone, before its tokens: each kind's layer stack prepared
  (layers.prepare: the kernels gathered once) and the embedding table as the lookup reads it (nn/embed.py
  lookup_table: whole under explicit sharding). The decode loop computes it once per call and hands it to every
  step (`prepared=`), which would otherwise redo it per token."""
  M = resolve(cfg)
  return {"layers": L.prepare(M, params["layers"]),
          "embed": lookup_table(params["embed"], jnp.dtype(M.cfg.train.compute_dtype))}


def apply(cfg: Config | Model, params: dict, tokens_BT: jax.Array, ctx: Context, cache: L.Cache | None = None,
          collect: bool = False, last_B: jax.Array | None = None,
          layer_inputs: dict | None = None, prepared: dict | None = None) -> tuple[jax.Array, L.Cache | None, dict]:
  """embed -> layers -> final norm -> head: (logits [B, T, V], new cache, side outputs).

  With last_B, only row b's position last_B[b] goes through the head: logits [B, 1, V] (a prefill
  needs the next-token logits of each prompt's last real token, not [B, T, V]).
  layer_inputs: {name: [n_readers, ...]} (see forward). prepared: loop_invariants(cfg, params), computed by the caller.
  """
  x, cache, side = trunk(cfg, params, tokens_BT, ctx, cache, collect, last_B, layer_inputs, prepared)
  return head(cfg, params, x), cache, side


def trunk(cfg: Config | Model, params: dict, tokens_BT: jax.Array, ctx: Context, cache: L.Cache | None = None,
          collect: bool = False, last_B: jax.Array | None = None,
          layer_inputs: dict | None = None, prepared: dict | None = None) -> tuple[jax.Array, L.Cache | None, dict]:
  """embed -> layers -> final norm: (the head's input [B, T, D] ([B, 1, D] with last_B), new cache, side).
  prepared: loop_invariants(cfg, params) where the caller computed it (the decode loop, once per call)."""
  M = resolve(cfg)
  m, fam = M.m, M.family
  by_kind = L.split_layer_inputs(M, layer_inputs or {}, tokens_BT.shape)  # checked before anything runs
  dt = jnp.dtype(M.cfg.train.compute_dtype)
  x = constrain(embed(prepared["embed"] if prepared else params["embed"], tokens_BT, dt, M.cfg.scatter_leading),
                ACT)  # [B, T, D]
  if fam.embed_scale:
    # sqrt(D) rounded to the compute dtype first, as HF does: bf16 runs see the same factor.
    x = x * jnp.asarray(m.embed_dim ** 0.5, dt)
  layers = prepared["layers"] if prepared else L.prepare(M, params["layers"])
  x, cache, side = L.run_layers(M, layers, x, ctx, cache, collect, by_kind)
  x = rms_norm(params["final_norm"], x, m.norm_eps, plus_one=fam.norm_plus_one)
  if last_B is not None:
    pick = jax.nn.one_hot(last_B, x.shape[1], dtype=x.dtype)  # [B, T]
    x = einsum("btd,bt->bd", x, pick, ("batch", "act_embed"))[:, None]  # [B, 1, D]
  return x, cache, side


def _positions(tokens_BT: jax.Array, positions_BT=None) -> jax.Array:
  if positions_BT is not None:
    return positions_BT
  B, T = tokens_BT.shape
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def context(cfg: Config | Model, positions_BT: jax.Array, segment_ids_BT=None, **kw) -> Context:
  """The Context for this config's plan: its contexts and the RoPE widths its parts read."""
  M = resolve(cfg)
  return make_context(M.cfg, M.plan.contexts, M.rotary_dims, positions_BT, segment_ids_BT,
                      attention_shapes=M.attention_shapes, **kw)


def forward(cfg: Config | Model, params: dict, tokens_BT: jax.Array, positions_BT=None, segment_ids_BT=None,
            return_hidden: bool = False, return_side: bool = False, layer_inputs: dict | None = None):
  """Logits [B, T, V] in the compute dtype.

  tokens_BT must lie in [0, model.vocab_size): an id outside it reads no embedding row (JAX clamps
  or fills out-of-range gathers) and gives meaningless, possibly NaN, logits. The data pipeline
  refuses tokenizers whose ids do not fit the model; callers passing ids directly must check.
  positions and segment ids describe packed rows (each document restarts its positions, and
  attention never crosses segments). With return_hidden, returns (logits, hidden) where hidden
  [L, B, T, D] holds each layer's output (before the final norm), in layer order. With
  return_side, returns (logits, side outputs): {name: [n, B, T, ...]} stacked over the n layers whose
  parts return it (Part.side_names), in model order.

  layer_inputs: {name: [n, B, T, ...]}, a per-layer input stacked over the n model layers that read it
  (Model.input_readers(name)), in model order; each is checked by the part that reads it (its shape, and
  its values when the array is concrete, called outside jit). A part's replayed side output (Replay.replays)
  fed back as its layer input replays that part's choices.
  """
  M = resolve(cfg)
  positions_BT = _positions(tokens_BT, positions_BT)
  ctx = context(M, positions_BT, segment_ids_BT)
  logits, _, side = apply(M, params, tokens_BT, ctx, collect=return_hidden, layer_inputs=layer_inputs)
  if return_hidden:
    return logits, side.pop("hidden")
  return (logits, side) if return_side else logits


def features(cfg: Config | Model, params: dict, tokens_BT: jax.Array, positions_BT=None, segment_ids_BT=None,
             layer_inputs: dict | None = None) -> tuple[jax.Array, dict]:
  """(the head's input [B, T, D]: final-normed, side outputs as forward's return_side): forward without the
  head, for a loss that applies the head itself (models/logprobs.py)."""
  M = resolve(cfg)
  positions_BT = _positions(tokens_BT, positions_BT)
  x, _, side = trunk(M, params, tokens_BT, context(M, positions_BT, segment_ids_BT), layer_inputs=layer_inputs)
  return x, side


def prefill(cfg: Config | Model, params: dict, tokens_BT: jax.Array, lengths_B: jax.Array, cache_len: int,
            layer_inputs: dict | None = None) -> tuple[jax.Array, L.Cache, dict]:
  """Runs right-padded prompts (row b holds lengths_B[b] real tokens): (next-token logits [B, V] at
  each row's last real token, the cache, side outputs [n, B, T, ...]).

  The cache holds room for cache_len positions per row (local layers: a ring of their window).
  """
  M = resolve(cfg)
  ctx = context(M, _positions(tokens_BT), mode="prefill", cache_len=cache_len, lengths_B=lengths_B)
  empty = L.Cache([None] * len(M.unrolled_ids), None, cache_len)
  logits, cache, side = apply(M, params, tokens_BT, ctx, empty, last_B=lengths_B - 1, layer_inputs=layer_inputs)
  return logits[:, 0], cache, side


def decode(cfg: Config | Model, params: dict, tokens_B: jax.Array, positions_B: jax.Array, cache: L.Cache,
           layer_inputs: dict | None = None, prepared: dict | None = None) -> tuple[jax.Array, L.Cache, dict]:
  """One new token per row at its position: (logits [B, V], the cache with the new rows written in
  place, side outputs [n, B, 1, ...]). Donate the cache (jax.jit(donate_argnums=...)) so XLA writes
  its buffers instead of copying them. prepared: loop_invariants(cfg, params), computed once for many steps."""
  M = resolve(cfg)
  ctx = context(M, positions_B[:, None], mode="decode", cache_len=cache.length)
  logits, cache, side = apply(M, params, tokens_B[:, None], ctx, cache, layer_inputs=layer_inputs,
                              prepared=prepared)
  return logits[:, 0], cache, side
