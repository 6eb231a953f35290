"""The GRPO objective and its variants, over per-token log-probs (no model in this file).

    adv_B = advantages(rewards_B, G, scale)                       # group-normalized, per completion
    w_BT = token_weights(mask_BT, agg, num_tokens, num_rows, max_len)
    loss, stats = policy_loss(logp_BT, old_BT, adv_B, mask_BT, w_BT, rl, is_weight_BT, ref_BT)

Rows are completions, laid out prompt by prompt: rows [g*G, (g+1)*G) are prompt g's group. T indexes
target positions; mask_BT is 1 on completion tokens only (prompt and padding masked out of the loss).

- ratio: exp(logp - old) per token, or per sequence (GSPO) exp of the masked mean of logp - old,
  the same for every token of the row.
- per-token loss: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A), times the sampler
  importance weight (rl.sampler_is, computed by the trainer and held constant), plus beta * k3 KL to
  the reference: exp(ref - logp) - (ref - logp) - 1.
- aggregation: sum of w * per-token loss, where w spreads the mean: token_mean 1 / all completion
  tokens of the batch (DAPO), sequence_mean 1 / (rows * the row's tokens) (GRPO), constant
  1 / (rows * max_new_tokens) (Dr. GRPO). The weights sum over micro-batches to the whole batch's loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

STD_EPS = 1e-4  # added to the std that divides the advantages (TRL's value)


def advantages(rewards_B: jax.Array, group: int, scale: str) -> jax.Array:
  """[B] reward minus its group's mean, divided by the group's std (group), the batch's std (batch) or
  nothing (none: Dr. GRPO). Stds are unbiased (ddof 1), as TRL's. A group of equal rewards gets 0."""
  r = jnp.asarray(rewards_B, jnp.float32).reshape(-1, group)  # [P, G]
  a = r - jnp.mean(r, axis=1, keepdims=True)
  if scale == "group":
    a = a / (jnp.std(r, axis=1, ddof=1, keepdims=True) + STD_EPS)
  elif scale == "batch":
    a = a / (jnp.std(r, ddof=1) + STD_EPS)
  elif scale != "none":
    raise ValueError(f"rl.scale_rewards={scale!r}: expected group, batch or none")
  return a.reshape(-1)


def token_weights(mask_BT: jax.Array, agg: str, num_tokens: jax.Array, num_rows: int, max_len: int) -> jax.Array:
  """[B, T] weights of the per-token losses (0 off the mask). num_tokens and num_rows count the whole
  batch, so that micro-batches' weighted sums add up to the batch's loss."""
  mask = mask_BT.astype(jnp.float32)
  if agg == "token_mean":
    return mask / jnp.maximum(num_tokens, 1.0)
  if agg == "sequence_mean":
    # An all-masked row (an empty completion) contributes 0, and still counts as a row (TRL's rule).
    return mask / (jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0) * num_rows)
  if agg == "constant":
    return mask / (num_rows * max_len)
  raise ValueError(f"rl.loss_agg={agg!r}: expected token_mean, sequence_mean or constant")


def log_ratio(logp_BT: jax.Array, old_BT: jax.Array, mask_BT: jax.Array, level: str) -> jax.Array:
  """[B, T] log importance ratio per token, or the row's masked mean broadcast over it (GSPO)."""
  d = (logp_BT - old_BT) * mask_BT
  if level == "token":
    return d
  if level == "sequence":
    return jnp.broadcast_to(jnp.sum(d, axis=1, keepdims=True) / jnp.maximum(jnp.sum(mask_BT, axis=1, keepdims=True),
                                                                           1.0), d.shape)
  raise ValueError(f"rl.ratio_level={level!r}: expected token or sequence")


def sampler_is_weight(trainer_old_BT: jax.Array, sampler_BT: jax.Array, mask_BT: jax.Array, level: str,
                      cap: float) -> jax.Array:
  """[B, T] truncated importance weight min(pi_trainer / pi_sampler, cap) of the rollout, per token or per
  sequence (the product over the row's tokens), held constant (no gradient). level none: ones."""
  if level == "none":
    return jnp.ones_like(mask_BT, jnp.float32)
  d = jax.lax.stop_gradient((trainer_old_BT - sampler_BT) * mask_BT)
  if level == "token":
    lw = d
  elif level == "sequence":
    lw = jnp.broadcast_to(jnp.sum(d, axis=1, keepdims=True), d.shape)
  else:
    raise ValueError(f"rl.sampler_is={level!r}: expected none, token or sequence")
  return jnp.minimum(jnp.exp(lw), cap)


def policy_loss(logp_BT: jax.Array, old_BT: jax.Array, adv_B: jax.Array, mask_BT: jax.Array, w_BT: jax.Array, *,
                epsilon: float, epsilon_high: float | None, ratio_level: str, beta: float = 0.0,
                is_weight_BT: jax.Array | None = None, ref_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(loss, stats): the clipped surrogate (plus beta * KL) summed with weights w_BT. stats are weighted
  sums too (with w_BT / its total, so mean-like): ratio, clip fraction, KL."""
  mask = mask_BT.astype(jnp.float32)
  hi = epsilon if epsilon_high is None else epsilon_high
  lr = log_ratio(logp_BT, old_BT, mask, ratio_level)
  ratio = jnp.exp(lr)
  a = adv_B[:, None]
  unclipped = ratio * a
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + hi) * a
  per_token = -jnp.minimum(unclipped, clipped)
  if is_weight_BT is not None:
    per_token = per_token * jax.lax.stop_gradient(is_weight_BT)
  kl = jnp.zeros_like(per_token)
  if beta > 0:
    d = ref_BT - logp_BT
    kl = jnp.exp(d) - d - 1.0
    per_token = per_token + beta * kl
  loss = jnp.sum(w_BT * per_token * mask)
  was_clipped = (clipped < unclipped).astype(jnp.float32)  # the min took the clipped side
  stats = {"ratio_sum": jnp.sum(ratio * mask), "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
           "ratio_min": jnp.min(jnp.where(mask > 0, ratio, jnp.inf)), "clipped_sum": jnp.sum(was_clipped * mask),
           "kl_sum": jnp.sum(kl * mask)}
  return loss, stats
