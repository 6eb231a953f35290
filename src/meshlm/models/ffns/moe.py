"""The `moe` feed-forward (mixtral, qwen3_moe): a float32 router, top-k and dropless experts (nn/moe.py).

Side outputs: the router statistics (`moe_load_balance_loss`, `moe_z_loss`, the per-expert fractions
and probabilities) and the routed expert ids (`moe_expert_ids` [B, T, k]); the decoder stacks them over
the MoE layers and the loss (train/step.py) adds the aux losses when their coefficients are set.
Router replay: the per-layer input `forced_expert_ids` [B, T, k] (-1 = not forced) forces the routing
(nn/router_replay.py). The router kernel is gathered once before the layer scan (`prepare`), and the
sort permutation is saved under remat (`remat_save_names`), so the backward does not sort again.

Shared expert (`moe_ffn(shared=True)`: qwen3-next, qwen3.5-moe): a GLU of width model.shared_expert_mlp_dim (S)
beside the routed experts on every token, scaled by sigmoid(shared_expert_gate(x)):
  y = moe(x) + sigmoid(x @ shared_expert_gate) * down(silu(gate(x)) * up(x))
Its parameters sit beside the experts': shared_gate [D, S], shared_up [D, S], shared_down [S, D],
shared_expert_gate [D, 1] (Hugging Face mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate,
each weight transposed).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import FORCED_EXPERT_IDS, Part
from meshlm.nn import moe
from meshlm.nn.mlp import ACTIVATIONS, glu_mlp
from meshlm.nn.router_replay import check_forced_ids

FORCED_IDS = FORCED_EXPERT_IDS  # the per-layer input (ctx.layer) holding [B, T, k] forced ids
ROUTED_IDS = "moe_expert_ids"  # the side output holding the routed ids [B, T, k]
SIDE_NAMES = ("moe_load_balance_loss", "moe_z_loss", "moe_expert_fraction", "moe_expert_prob", ROUTED_IDS)


def prepare(p: dict, specs: dict) -> dict:
  return dict(p, router_full=moe.gather_router_once(p["router"], specs["router"].axes))


def check_forced(m: ModelConfig, forced, n_layers: int, shape_BT: tuple[int, int]) -> None:
  """forced_expert_ids [L_moe, B, T, k]: its shape, and its range when concrete."""
  check_forced_ids(forced, (n_layers, *shape_BT, m.num_experts_per_tok), m.num_experts)


def apply(p: dict, x_BTD: jax.Array, ctx, state=None, *, norm_topk: bool | None = None, shared: bool = False):
  """norm_topk: renormalize the top-k weights (mixtral: always); None reads model.norm_topk_prob.
  shared: add the gated shared expert."""
  m = ctx.model
  y, side = moe.moe_mlp(p, x_BTD, ctx, num_experts=m.num_experts, k=m.num_experts_per_tok,
                        norm_topk=m.norm_topk_prob if norm_topk is None else norm_topk,
                        activation=ACTIVATIONS[m.hidden_activation], router_dtype=jnp.dtype(m.router_dtype),
                        impl=m.moe_impl, forced_ids_BTk=ctx.layer.get(FORCED_IDS), router_full=p["router_full"])
  if shared:
    y = y + shared_expert(p, x_BTD, ctx)
  return y, None, side


def shared_spec(m: ModelConfig) -> dict:
  D, F = m.embed_dim, m.shared_expert_mlp_dim
  return {
      "shared_gate": S.kernel((D, F), ("embed", "mlp")),
      "shared_up": S.kernel((D, F), ("embed", "mlp")),
      "shared_down": S.kernel((F, D), ("mlp", "embed")),
      "shared_expert_gate": S.kernel((D, 1), ("embed", None)),
  }


def shared_expert(p: dict, x_BTD: jax.Array, ctx) -> jax.Array:
  """sigmoid(x @ shared_expert_gate) * glu(x) [B, T, D]."""
  dt = x_BTD.dtype
  with jax.named_scope("shared_expert"):
    h = glu_mlp({"gate": p["shared_gate"], "up": p["shared_up"], "down": p["shared_down"]}, x_BTD, dense=ctx.dense,
                activation=ACTIVATIONS[ctx.model.hidden_activation])
    with jax.named_scope("shared_expert_gate"):
      s = ctx.dense(x_BTD, p["shared_expert_gate"].astype(dt), "btd,do->bto", ("batch", "length", None))  # [B, T, 1]
    return jax.nn.sigmoid(s) * h


def spec_with_shared(m: ModelConfig) -> dict:
  return {**moe.moe_spec(m), **shared_spec(m)}


def moe_ffn(*, norm_topk: bool | None = None, shared: bool = False) -> Part:
  """shared: a gated shared expert beside the routed ones (model.shared_expert_mlp_dim wide)."""
  return Part(name="moe", key="moe", spec=spec_with_shared if shared else moe.moe_spec,
              apply=functools.partial(apply, norm_topk=norm_topk, shared=shared),
              prepare=prepare, remat_save_names=moe.REMAT_SAVE_NAMES, layer_inputs={FORCED_IDS: check_forced},
              side_names=SIDE_NAMES, replays={ROUTED_IDS: FORCED_IDS})
