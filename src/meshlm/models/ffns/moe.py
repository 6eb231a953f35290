"""The `moe` feed-forward (mixtral, qwen3_moe): a float32 router, top-k and dropless experts (nn/moe.py).

Side outputs: the router statistics (`moe_load_balance_loss`, `moe_z_loss`, the per-expert fractions
and probabilities) and the routed expert ids (`moe_expert_ids` [B, T, k]); the decoder stacks them over
the MoE layers and the loss (train/step.py) adds the aux losses when their coefficients are set.
Router replay: the per-layer input `forced_expert_ids` [B, T, k] (-1 = not forced) forces the routing
(nn/router_replay.py). The router kernel is gathered once before the layer scan (`prepare`), and the
sort permutation is saved under remat (`remat_save_names`), so the backward does not sort again.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm.models.family import FORCED_EXPERT_IDS, Part
from meshlm.nn import moe
from meshlm.nn.mlp import ACTIVATIONS
from meshlm.nn.router_replay import check_forced_ids

FORCED_IDS = FORCED_EXPERT_IDS  # the per-layer input (ctx.layer) holding [B, T, k] forced ids
ROUTED_IDS = "moe_expert_ids"  # the side output holding the routed ids [B, T, k]
SIDE_NAMES = ("moe_load_balance_loss", "moe_z_loss", "moe_expert_fraction", "moe_expert_prob", ROUTED_IDS)


def prepare(p: dict, specs: dict) -> dict:
  return dict(p, router_full=moe.gather_router_once(p["router"], specs["router"].axes))


def check_forced(m: ModelConfig, forced, n_layers: int, shape_BT: tuple[int, int]) -> None:
  """forced_expert_ids [L_moe, B, T, k]: its shape, and its range when concrete."""
  check_forced_ids(forced, (n_layers, *shape_BT, m.num_experts_per_tok), m.num_experts)


def apply(p: dict, x_BTD: jax.Array, ctx, state=None, *, norm_topk: bool | None = None):
  """norm_topk: renormalize the top-k weights (mixtral: always); None reads model.norm_topk_prob."""
  m = ctx.model
  y, side = moe.moe_mlp(p, x_BTD, ctx, num_experts=m.num_experts, k=m.num_experts_per_tok,
                        norm_topk=m.norm_topk_prob if norm_topk is None else norm_topk,
                        activation=ACTIVATIONS[m.hidden_activation], router_dtype=jnp.dtype(m.router_dtype),
                        impl=m.moe_impl, forced_ids_BTk=ctx.layer.get(FORCED_IDS), router_full=p["router_full"])
  return y, None, side


def moe_ffn(*, norm_topk: bool | None = None) -> Part:
  return Part(name="moe", key="moe", spec=moe.moe_spec, apply=functools.partial(apply, norm_topk=norm_topk),
              prepare=prepare, remat_save_names=moe.REMAT_SAVE_NAMES, layer_inputs={FORCED_IDS: check_forced},
              side_names=SIDE_NAMES, replays={ROUTED_IDS: FORCED_IDS})
