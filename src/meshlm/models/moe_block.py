"""The "moe" layer kind (mixtral, qwen3_moe): the dense kind's pre-norm attention, then a mixture-of-
experts feed-forward (nn/moe.py) in place of the MLP.

Its side outputs are the MoE layer's router statistics (`moe_load_balance_loss`, `moe_z_loss`, the
per-expert fractions and probabilities) and its routed expert ids (`moe_expert_ids` [B, T, k]); the
decoder stacks them over the MoE layers and the loss (train/step.py) adds the aux losses when their
coefficients are set. Router replay: a per-layer input `ctx.layer["forced_expert_ids"]` [B, T, k]
(decoder.forward's forced_expert_ids, one row per MoE layer) forces the routing (nn/router_replay.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm.models import blocks
from meshlm import spec as S
from meshlm.models.family import Kind
from meshlm.nn import moe
from meshlm.nn.mlp import ACTIVATIONS
from meshlm.nn.norm import rms_norm
from meshlm.parallel.sharding import ACT, constrain

KIND = "moe"  # the kind name families register this block under; forced ids go to its layers
FORCED_IDS = "forced_expert_ids"  # the per-layer input (ctx.layer) holding [B, T, k] forced ids


def layer_spec(m: ModelConfig) -> dict:
  return {
      "attn_norm": S.ones(m.embed_dim),
      "attn": blocks.attention_spec(m),
      "mlp_norm": S.ones(m.embed_dim),
      "moe": moe.moe_spec(m),
  }


def block(p: dict, x_BTD: jax.Array, ctx, state=None, *, norm_topk: bool | None = None):
  """norm_topk: renormalize the top-k weights (mixtral: always); None reads model.norm_topk_prob."""
  m = ctx.model
  x_BTD, state = blocks.attention_residual(p, x_BTD, ctx, state)
  with jax.named_scope("mlp"):
    h = rms_norm(p["mlp_norm"], x_BTD, m.norm_eps)
    y, side = moe.moe_mlp(p["moe"], h, ctx, num_experts=m.num_experts, k=m.num_experts_per_tok,
                          norm_topk=m.norm_topk_prob if norm_topk is None else norm_topk,
                          activation=ACTIVATIONS[m.hidden_activation], router_dtype=jnp.dtype(m.router_dtype),
                          impl=m.moe_impl, forced_ids_BTk=ctx.layer.get(FORCED_IDS))
    x_BTD = x_BTD + y
  return constrain(x_BTD, ACT), state, side


def moe_kind(*, norm_topk: bool | None = None) -> Kind:
  return Kind(spec=layer_spec, block=functools.partial(block, norm_topk=norm_topk))
