"""The GRPO objective and its variants, over per-token log-probs (no model in this file).

    adv_B = advantages(rewards_B, G, scale)                       # group-normalized, per completion
    w_BT = token_weights(mask_BT, agg, num_tokens, num_rows, max_len, micro_batches)
    loss, stats = policy_loss(logp_BT, old_BT, adv_B, mask_BT, w_BT, rl, is_weight_BT, ref_BT)

Rows are completions, laid out prompt by prompt: rows [g*G, (g+1)*G) are prompt g's group. T indexes
target positions; mask_BT is 1 on completion tokens only (prompt and padding masked out of the loss).

- ratio: exp(logp - old) per token, or per sequence (GSPO) exp of the masked mean of logp - old,
  the same for every token of the row.
- per-token loss (rl.policy_loss=clip): -min(ratio' * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A), where
  ratio' is the ratio capped at rl.delta when it is set (INTELLECT-2's two-sided clip; TRL's `delta`), else the
  ratio. rl.policy_loss=cispo (MiniMax-M1; TRL's loss_type=cispo): -stop_gradient(min(ratio, cispo_cap)) * A * logp,
  a REINFORCE term on every token whose weight is the capped ratio. Then, in this order (TRL's): times the
  entropy mask (rl.top_entropy_quantile), times the sampler importance weight (rl.sampler_is, computed by the
  trainer and held constant), plus beta * the KL to the reference: k3 = exp(ref - logp) - (ref - logp) - 1,
  or k3 times the ratio (rl.kl_estimator=k3_ratio; TRL's use_bias_correction_kl).
- aggregation: sum of w * per-token loss, where w spreads the mean: token_mean 1 / all completion
  tokens of the batch (DAPO), sequence_mean 1 / (rows * the row's tokens) (GRPO), constant
  1 / (rows * max_new_tokens) (Dr. GRPO), bnpo 1 / (micro-batches * the micro-batch's tokens) (TRL's bnpo:
  each micro-batch's token mean, averaged). The weights sum over micro-batches to the whole batch's loss.
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


def advantages_excluding_nan(rewards_B: jax.Array, group: int, scale: str) -> jax.Array:
  """[B] advantages where a NaN reward (an unscorable completion) is left out of its group's mean and std (and of
  the batch's std), and gets advantage 0: TRL's rule (nanmean, an unbiased nanstd that is NaN below 2 values,
  then NaN advantages to 0). Without NaNs it is `advantages` (the trainer calls that one then)."""
  r = jnp.asarray(rewards_B, jnp.float32).reshape(-1, group)  # [P, G]
  ok = ~jnp.isnan(r)

  def nanstd(x, valid, axis):
    n = jnp.sum(valid, axis=axis, keepdims=True)
    m = jnp.sum(jnp.where(valid, x, 0.0), axis=axis, keepdims=True) / jnp.maximum(n, 1)
    v = jnp.sum(jnp.where(valid, (x - m) ** 2, 0.0), axis=axis, keepdims=True) / jnp.maximum(n - 1, 1)
    return jnp.where(n > 1, jnp.sqrt(v), jnp.nan)

  n = jnp.sum(ok, axis=1, keepdims=True)
  mean = jnp.sum(jnp.where(ok, r, 0.0), axis=1, keepdims=True) / jnp.maximum(n, 1)
  a = r - mean
  if scale == "group":
    a = a / (nanstd(r, ok, 1) + STD_EPS)
  elif scale == "batch":
    a = a / (nanstd(r, ok, None) + STD_EPS)
  elif scale != "none":
    raise ValueError(f"rl.scale_rewards={scale!r}: expected group, batch or none")
  return jnp.where(jnp.isnan(a), 0.0, a).reshape(-1)


def token_weights(mask_BT: jax.Array, agg: str, num_tokens: jax.Array, num_rows: int, max_len: int,
                  micro_batches: int = 1) -> jax.Array:
  """[B, T] weights of the per-token losses (0 off the mask). num_tokens and num_rows count the whole
  batch, so that micro-batches' weighted sums add up to the batch's loss; bnpo's count this micro-batch."""
  mask = mask_BT.astype(jnp.float32)
  if agg == "token_mean":
    return mask / jnp.maximum(num_tokens, 1.0)
  if agg == "sequence_mean":
    # An all-masked row (an empty completion) contributes 0, and still counts as a row (TRL's rule).
    return mask / (jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0) * num_rows)
  if agg == "constant":
    return mask / (num_rows * max_len)
  if agg == "bnpo":
    # TRL's bnpo: this micro-batch's own token mean, and the micro-batches' mean of those (TRL divides each
    # micro-batch's loss by the gradient-accumulation steps). One micro-batch: token_mean.
    return mask / (jnp.maximum(jnp.sum(mask), 1.0) * micro_batches)
  raise ValueError(f"rl.loss_agg={agg!r}: expected token_mean, sequence_mean, constant or bnpo")


def log_ratio(logp_BT: jax.Array, old_BT: jax.Array, mask_BT: jax.Array, level: str) -> jax.Array:
  """[B, T] log importance ratio per token, or the row's masked mean broadcast over it (GSPO)."""
  d = (logp_BT - old_BT) * mask_BT
  if level == "token":
    return d
  if level == "sequence":
    return jnp.broadcast_to(jnp.sum(d, axis=1, keepdims=True) / jnp.maximum(jnp.sum(mask_BT, axis=1, keepdims=True),
                                                                           1.0), d.shape)
  raise ValueError(f"rl.ratio_level={level!r}: expected token or sequence")


SAMPLER_IS = {"none": ("none", "truncate"), "token": ("token", "truncate"), "sequence": ("sequence", "truncate"),
              "token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
              "sequence_truncate": ("sequence", "truncate"), "sequence_mask": ("sequence", "mask")}


def sampler_is_ratio(trainer_old_BT: jax.Array, sampler_BT: jax.Array, mask_BT: jax.Array, level: str) -> jax.Array:
  """[B, T] pi_trainer / pi_sampler of the rollout, per token or per sequence (the product over the row's
  tokens, for every token of the row), without gradient."""
  d = jax.lax.stop_gradient((trainer_old_BT - sampler_BT) * mask_BT)
  if level == "token":
    return jnp.exp(d)
  if level == "sequence":
    return jnp.exp(jnp.broadcast_to(jnp.sum(d, axis=1, keepdims=True), d.shape))
  raise ValueError(f"rl.sampler_is level {level!r}: expected token or sequence")


def bound_is(ratio_BT: jax.Array, mode: str, cap: float, floor: float | None = None) -> jax.Array:
  """[B, T] the importance weight from the ratio: truncate clips it to [floor, cap] (no floor when None); mask keeps
  it where floor <= ratio <= cap and sets it to 0 elsewhere (TRL's *_mask modes: the token, or the whole row at
  sequence level, drops out of the loss and still counts in its denominator)."""
  if mode == "truncate":
    return jnp.minimum(ratio_BT, cap) if floor is None else jnp.clip(ratio_BT, floor, cap)
  if mode == "mask":
    keep = ratio_BT <= cap if floor is None else (ratio_BT <= cap) & (ratio_BT >= floor)
    return jnp.where(keep, ratio_BT, 0.0)
  raise ValueError(f"rl.sampler_is mode {mode!r}: expected truncate or mask")


def sampler_is_weight(trainer_old_BT: jax.Array, sampler_BT: jax.Array, mask_BT: jax.Array, level: str,
                      cap: float, *, mode: str = "truncate", floor: float | None = None) -> jax.Array:
  """[B, T] the importance weight of the rollout (bound_is of sampler_is_ratio), held constant (no gradient).
  level none: ones."""
  if level == "none":
    return jnp.ones_like(mask_BT, jnp.float32)
  return bound_is(sampler_is_ratio(trainer_old_BT, sampler_BT, mask_BT, level), mode, cap, floor)


def entropy_mask(entropy_BT: jax.Array, mask_BT: jax.Array, quantile: float) -> jax.Array:
  """[B, T] 1 on the completion tokens whose entropy is at least the (1 - quantile) quantile (linear
  interpolation, as torch.quantile and numpy's default) of the completion tokens' entropies, else 0: the top
  `quantile` of the tokens by entropy (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's top_entropy_quantile).
  0 keeps the highest-entropy token(s) only. No gradient flows through the choice."""
  mask = mask_BT > 0
  h = jax.lax.stop_gradient(entropy_BT).astype(jnp.float32)
  thr = jnp.nanquantile(jnp.where(mask, h, jnp.nan), 1.0 - quantile)  # NaN when no token is masked in: keeps none
  return ((h * mask >= thr) & mask).astype(jnp.float32)


def policy_loss(logp_BT: jax.Array, old_BT: jax.Array, adv_B: jax.Array, mask_BT: jax.Array, w_BT: jax.Array, *,
                epsilon: float, epsilon_high: float | None, ratio_level: str, beta: float = 0.0,
                is_weight_BT: jax.Array | None = None, ref_BT: jax.Array | None = None, objective: str = "clip",
                delta: float | None = None, cispo_cap: float = 5.0, kl_estimator: str = "k3",
                keep_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(loss, stats): the policy term (plus beta * KL) summed with weights w_BT. stats are weighted
  sums too (with w_BT / its total, so mean-like): ratio, clip fraction, KL. keep_BT: the entropy mask (or None)."""
  mask = mask_BT.astype(jnp.float32)
  hi = epsilon if epsilon_high is None else epsilon_high
  lr = log_ratio(logp_BT, old_BT, mask, ratio_level)
  ratio = jnp.exp(lr)
  a = adv_B[:, None]
  if objective == "clip":
    unclipped = (ratio if delta is None else jnp.minimum(ratio, delta)) * a
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + hi) * a
    per_token = -jnp.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).astype(jnp.float32)  # the min took the clipped side
  elif objective == "cispo":
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, cispo_cap))
    per_token = -weight * a * logp_BT
    was_clipped = (ratio > cispo_cap).astype(jnp.float32)  # the weight was capped
  else:
    raise ValueError(f"rl.policy_loss={objective!r}: expected clip or cispo")
  if keep_BT is not None:
    per_token = per_token * keep_BT
  if is_weight_BT is not None:
    per_token = per_token * jax.lax.stop_gradient(is_weight_BT)
  kl = jnp.zeros_like(per_token)
  if beta > 0:
    d = ref_BT - logp_BT
    kl = jnp.exp(d) - d - 1.0
    if kl_estimator == "k3_ratio":
      kl = kl * ratio  # the ratio keeps its gradient, as TRL's per_token_kl * coef_1
    elif kl_estimator != "k3":
      raise ValueError(f"rl.kl_estimator={kl_estimator!r}: expected k3 or k3_ratio")
    per_token = per_token + beta * kl
  loss = jnp.sum(w_BT * per_token * mask)
  outside = ((ratio < 1.0 - epsilon) | (ratio > 1.0 + hi)).astype(jnp.float32)  # the clip window, either side
  stats = {"ratio_sum": jnp.sum(ratio * mask), "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
           "ratio_min": jnp.min(jnp.where(mask > 0, ratio, jnp.inf)), "clipped_sum": jnp.sum(was_clipped * mask),
           "kl_sum": jnp.sum(kl * mask), "outside_sum": jnp.sum(outside * mask)}
  return loss, stats
