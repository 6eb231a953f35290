"""Routing: the router's top-k (softmax, or DeepSeek-V3's group-limited sigmoid), the aux-loss-free
bias rule, and the router statistics and losses. All float32."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import out_sharding

ROUTER_LOGITS = ("batch", "length", None)
ROUTER_AXES = ("embed", None)


def route(logits_BTE: jax.Array, k: int, norm_topk: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(probs [B, T, E] float32, top-k weights [B, T, k] float32, top-k expert ids [B, T, k] int32)."""
  probs = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
  weights, ids = jax.lax.top_k(probs, k)
  if norm_topk:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return probs, weights, ids.astype(jnp.int32)


ROUTER_SCORINGS = ("softmax", "sigmoid")
# What an expert of a dropped group scores in group-limited routing's final top-k (the moe part's router_group_mask):
# "zero" (0.0, DeepSeek's published modeling_deepseek.py; a dropped expert then beats a kept one whose
# biased score is negative) or "-inf" (transformers 5's DeepseekV3TopkRouter: only kept groups' experts).
GROUP_MASKS = {"zero": 0.0, "-inf": -math.inf}
NORM_EPS = 1e-20  # sigmoid routing's top-k renormalization: w / (sum + NORM_EPS), as DeepSeek-V3 does


def group_limited_topk(scores_ME: jax.Array, bias_E: jax.Array, k: int, *, n_group: int, topk_group: int,
                       dropped: float = 0.0) -> jax.Array:
  """DeepSeek-V3's selection: top-k expert ids [..., k] int32 of scores + bias (float32), limited to groups.

  The E experts form n_group consecutive groups; each group scores the sum of its top 2 biased scores;
  the topk_group best groups are kept and every expert of the others scores `dropped` (0.0 or -inf);
  then the top k of all E. Ties go to the lower index (jax.lax.top_k), in both top-k's.
  """
  biased = scores_ME.astype(jnp.float32) + bias_E.astype(jnp.float32)  # [..., E]
  if n_group == 1:
    return jax.lax.top_k(biased, k)[1].astype(jnp.int32)
  *lead, E = biased.shape
  grouped = biased.reshape(*lead, n_group, E // n_group)  # [..., G, E / G]
  group_score = jnp.sum(jax.lax.top_k(grouped, min(2, E // n_group))[0], axis=-1)  # [..., G]
  _, kept = jax.lax.top_k(group_score, topk_group)  # [..., topk_group]
  keep = jnp.any(kept[..., :, None] == jnp.arange(n_group), axis=-2)  # [..., G]
  choice = jnp.where(keep[..., None], grouped, jnp.float32(dropped)).reshape(*lead, E)
  return jax.lax.top_k(choice, k)[1].astype(jnp.int32)


def sigmoid_weights(w_Mk: jax.Array, norm_topk: bool, scaling: float) -> jax.Array:
  """The routing weights from the unbiased sigmoid scores at the chosen ids: renormalized by
  (sum + 1e-20) with norm_topk, times routed_scaling_factor."""
  if norm_topk:
    w_Mk = w_Mk / (jnp.sum(w_Mk, axis=-1, keepdims=True) + NORM_EPS)
  return w_Mk * jnp.float32(scaling)


def group_route(logits_BTE: jax.Array, bias_E: jax.Array, k: int, *, n_group: int, topk_group: int,
                norm_topk: bool, scaling: float = 1.0, dropped: float = 0.0
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Group-limited sigmoid routing (DeepSeek-V3): (scores s = sigmoid(logits) [B, T, E] float32, weights
  [B, T, k] float32, ids [B, T, k] int32). The bias (float32) picks experts and never weights them: the
  weights are s at the chosen ids (sigmoid_weights)."""
  s = jax.nn.sigmoid(logits_BTE.astype(jnp.float32))
  ids = group_limited_topk(jax.lax.stop_gradient(s), bias_E, k, n_group=n_group, topk_group=topk_group,
                           dropped=dropped)
  return s, sigmoid_weights(jnp.take_along_axis(s, ids, axis=-1), norm_topk, scaling), ids


def expert_load(ids_BTk: jax.Array, num_experts: int, token_mask_BT: jax.Array | None = None) -> jax.Array:
  """Routed (token, slot) pairs per expert [E] float32, padding (token_mask 0) excluded: the counts
  the aux-loss-free bias update balances."""
  onehot = jax.nn.one_hot(ids_BTk, num_experts, dtype=jnp.float32)  # [B, T, k, E]
  if token_mask_BT is not None:
    onehot = onehot * (token_mask_BT > 0).astype(jnp.float32)[:, :, None, None]
  return jnp.sum(onehot, axis=(0, 1, 2))  # integers, exact in float32 below 2^24 pairs


def bias_update(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
  """The aux-loss-free balancing rule (DeepSeek-V3): bias += rate * sign(mean load - load), per layer
  [L, E]; rate 0 returns the bias itself (bit-unchanged)."""
  if rate == 0:
    return bias_LE
  load = load_LE.astype(jnp.float32)
  step = jnp.float32(rate) * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
  return (bias_LE.astype(jnp.float32) + step).astype(bias_LE.dtype)


def aux_stats(logits_BTE: jax.Array, probs_BTE: jax.Array, ids_BTk: jax.Array, num_experts: int,
              token_mask_BT: jax.Array | None = None) -> dict:
  """Per-layer router statistics and losses, float32.

  moe_expert_fraction [E]: top-k assignments per expert / tokens (sums to k over the experts);
  moe_expert_prob [E]: mean router probability per expert;
  moe_load_balance_loss: E * sum_e fraction_e * prob_e, transformers' `load_balancing_loss_func`
    for this one layer (padding excluded when token_mask is given, as its attention_mask does);
  moe_z_loss: mean over tokens of logsumexp(logits)^2 (ST-MoE's router z-loss).
  Over several layers transformers averages fraction and prob over the layers before the product:
  `load_balancing_loss(side)` does that from the stacked side outputs.
  """
  E = num_experts
  mask = jnp.ones(ids_BTk.shape[:2], jnp.float32) if token_mask_BT is None else token_mask_BT.astype(jnp.float32)
  rows = jnp.maximum(jnp.sum(mask), 1.0)
  onehot = jax.nn.one_hot(ids_BTk, E, dtype=jnp.float32)  # [B, T, k, E]
  # A mask sharded like the tokens makes both einsum operands batch-sharded: under explicit sharding
  # the output's sharding must then be named (replicated [E]).
  out = {} if token_mask_BT is None else {"out_sharding": out_sharding((None,), (E,))}
  fraction = jnp.einsum("btke,bt->e", onehot, mask, **out) / rows
  prob = jnp.einsum("bte,bt->e", probs_BTE.astype(jnp.float32), mask, **out) / rows
  z = jax.nn.logsumexp(logits_BTE.astype(jnp.float32), axis=-1)
  return {
      "moe_load_balance_loss": E * jnp.sum(fraction * prob),
      "moe_z_loss": jnp.sum(z * z * mask) / rows,
      "moe_expert_fraction": fraction,
      "moe_expert_prob": prob,
  }


def load_balancing_loss(side: dict) -> jax.Array:
  """transformers' load_balancing_loss_func over all MoE layers, from side outputs stacked [L, E]:
  E * sum_e mean_L(fraction) * mean_L(prob). (Not the mean of the per-layer losses.)"""
  frac, prob = side["moe_expert_fraction"], side["moe_expert_prob"]
  return frac.shape[-1] * jnp.sum(jnp.mean(frac, axis=0) * jnp.mean(prob, axis=0))
