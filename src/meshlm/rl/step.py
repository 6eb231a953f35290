"""The RL train step: the GRPO loss as the train step's pluggable loss, over rollout batch fields.

    step = build_rl_step(cfg, mesh)       # train.step.TrainStep with rl_loss and RL_FIELDS
    state, metrics = step(state, step.put_batch(batch))

Batch fields (besides the train step's inputs/targets/positions/segment_ids/loss_mask, where loss_mask
is 1 on completion tokens only):
  old_logp [B, T]      log-probs the ratio divides by: the sampler's (or, with rl.sampler_is, the
                       trainer's scoring of the rollout before any update)
  loss_mask [B, T]     0 on a truncated completion's tokens too, with rl.mask_truncated_completions
  sampler_logp [B, T]  the sampler's log-probs of the distribution it drew from
  advantages [B]       group-normalized (rl/loss.py: advantages)
  ref_logp [B, T]      the reference policy's log-probs (only with rl.beta > 0)
  a replay's fields    what the sampler recorded of its layers' choices (Replay.replays; each
                       [B, T, n, k], -1 = none): forced in the forward with rl.router_replay,
                       else compared with the trainer's own choices (the input's `flips` metrics)

The trainer scores a completion under the sampler's truncation (`scores`), so at the first iteration the
ratio is 1 up to the train/sample numerical gap, which the step reports (logp_gap_mean/max).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models.logprobs import target_logprobs
from meshlm.models.params import merge_state, model_shardings
from meshlm.models.model import resolve
from meshlm.models.generate import truncate
from meshlm.parallel.sharding import constrain
from meshlm.rl import loss as L
from meshlm.train import step as ST

def rl_fields(cfg: Config) -> dict[str, ST.BatchField]:
  """The RL step's batch spec for cfg."""
  f32 = functools.partial(ST.BatchField, "float32")
  spec = dict(ST.BATCH_SPEC, old_logp=f32(), sampler_logp=f32(), advantages=f32(per_token=False))
  if cfg.rl.beta > 0:
    spec["ref_logp"] = f32()
  if replays(cfg):
    spec = ST.replay_batch_spec(cfg, spec)
  return spec


def replays(cfg: Config) -> bool:
  """Whether some layer records choices that a replay can force (Replay.replays)."""
  return bool(resolve(cfg).replays)


def flip_metrics(cfg: Config) -> tuple[str, ...]:
  """The metric prefixes of the replayed inputs' flips (LayerInput.flips)."""
  M = resolve(cfg)
  return tuple(f for f in (M.layer_input(n).flips for n in dict.fromkeys(M.replays.values())) if f)


def keep_fn(cfg: Config):
  """The kept set of the sampler's truncation (rl.top_k, rl.top_p) as models/logprobs.target_logprobs takes it, or
  None when the trainer scores without one (no truncation, or rl.score_truncated=false: the temperature's softmax
  only, the comparison that shows the bias)."""
  rl = cfg.rl
  if rl.score_truncated and (rl.top_k is not None or rl.top_p < 1):
    return functools.partial(_kept, rl.top_k, rl.top_p)
  return None


def _kept(top_k, top_p, z):
  return jnp.isfinite(truncate(z, top_k, top_p))


def scores(cfg: Config, params, batch: dict, replay: bool):
  """(log q(target) [B, T], entropy of q [B, T], {replayed input: the trainer's own choices [n, B, T, k]}, {}
  without replays), q the distribution the sampler draws from: softmax of the logits over rl.temperature, truncated
  by rl.top_k and rl.top_p (`keep_fn`). With replay the batch's recorded choices are forced in the forward."""
  M = resolve(cfg)
  layer_inputs = ST.layer_inputs_of(M, batch) if replay else None
  out = target_logprobs(M, params, batch, temperature=cfg.rl.temperature, keep_fn=keep_fn(cfg), entropy=True,
                        layer_inputs=layer_inputs)
  return out.logp, out.entropy, {name: out.side[s] for s, name in M.replays.items()}


def choice_flips(live_LBTk: jax.Array, recorded_BTLk: jax.Array, real_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(per layer, the fraction of the sampler's recorded (token, slot) choices the trainer did not make [L];
  the fraction of tokens with such a flip in at least one layer), over the tokens the sampler recorded (a
  row of -1 is none: padding, the last token)."""
  rec = jnp.moveaxis(recorded_BTLk, 2, 0)  # [L, B, T, k]
  valid = (rec[..., 0] >= 0) & (real_BT[None] > 0)  # [L, B, T]
  missing = ~jnp.any(rec[..., :, None] == live_LBTk[..., None, :], axis=-1)  # [L, B, T, k]: slot not in live set
  missing = missing & valid[..., None]
  k = rec.shape[-1]
  per_layer = jnp.sum(missing, axis=(1, 2, 3)) / jnp.maximum(jnp.sum(valid, axis=(1, 2)) * k, 1)
  tok_valid = valid[0]
  any_flip = jnp.any(missing, axis=(0, 3)) & tok_valid  # [B, T]
  return per_layer.astype(jnp.float32), (jnp.sum(any_flip) / jnp.maximum(jnp.sum(tok_valid), 1)).astype(jnp.float32)


def rl_loss(cfg: Config, params, batch: dict, num_tokens: jax.Array, *, num_rows: int) -> tuple[jax.Array, dict]:
  """The train step's loss_fn: GRPO over one (micro-)batch. Metrics are sums that add up over
  micro-batches to the batch's means, and *_max/*_min ones that the train step reduces by max/min over them
(train/step.py: METRIC_REDUCE), so ratio_min/ratio_max/logp_gap_max are the whole batch's."""
  rl = cfg.rl
  logp, entropy, live = scores(cfg, params, batch, rl.router_replay)
  mask = batch["loss_mask"]
  w = L.token_weights(mask, rl.loss_agg, num_tokens, num_rows, rl.max_new_tokens, cfg.train.micro_batches)
  level, mode = L.SAMPLER_IS[rl.sampler_is]
  isw = None
  if level != "none":
    is_ratio = L.sampler_is_ratio(batch["old_logp"], batch["sampler_logp"], mask, level)
    isw = L.bound_is(is_ratio, mode, rl.sampler_is_cap, rl.sampler_is_min)
  keep = None
  if rl.top_entropy_quantile < 1:
    # The quantile is over this micro-batch's completion tokens on every device: gathered whole ([B, T] floats).
    keep = L.entropy_mask(constrain(entropy, (None, None)), constrain(mask, (None, None)), rl.top_entropy_quantile)
    keep = constrain(keep, ("batch", "length"))
  loss, st = L.policy_loss(logp, batch["old_logp"], batch["advantages"], mask, w, epsilon=rl.epsilon,
                           epsilon_high=rl.epsilon_high, ratio_level=rl.ratio_level, beta=rl.beta,
                           is_weight_BT=isw, ref_BT=batch.get("ref_logp"), objective=rl.policy_loss, delta=rl.delta,
                           cispo_cap=rl.cispo_cap, kl_estimator=rl.kl_estimator, keep_BT=keep)
  sg = jax.lax.stop_gradient
  gap = jnp.abs(sg(logp) - batch["sampler_logp"]) * mask
  mb_tokens = jnp.sum(mask)
  share = mb_tokens / num_tokens
  metrics = {"ratio_mean": sg(st["ratio_sum"]) / num_tokens, "ratio_max": sg(st["ratio_max"]),
             "ratio_min": sg(st["ratio_min"]), "ratio_outside_window": sg(st["outside_sum"]) / num_tokens,
             "clip_frac": st["clipped_sum"] / num_tokens, "kl": sg(st["kl_sum"]) / num_tokens,
             "entropy": sg(jnp.sum(entropy * mask)) / num_tokens,
             "entropy_sampled": -sg(jnp.sum(logp * mask)) / num_tokens,
             "logp_gap_mean": jnp.sum(gap) / num_tokens, "logp_gap_max": jnp.max(gap)}
  if keep is not None:
    metrics["entropy_kept_frac"] = jnp.sum(keep * mask) / num_tokens
  if isw is not None:
    metrics["sampler_is_mean"] = jnp.sum(isw * mask) / num_tokens
    cut = (isw != is_ratio).astype(jnp.float32)  # truncated to a bound, or masked to 0
    metrics[f"sampler_is_{'masked' if mode == 'mask' else 'clipped'}_frac"] = jnp.sum(cut * mask) / num_tokens
  for name, choices in live.items():
    flips = resolve(cfg).layer_input(name).flips
    if flips is None:
      continue
    per_layer, any_layer = choice_flips(choices, batch[name], batch["segment_ids"])
    for i in range(per_layer.shape[0]):
      metrics[f"{flips}_layer{i}"] = share * per_layer[i]
    metrics[f"{flips}_any_layer"] = share * any_layer
  return loss, metrics


def check_rl(cfg: Config) -> None:
  """The RL keys that depend on the model: refused in one line, before anything compiles."""
  if cfg.rl.router_replay and not replays(cfg):
    raise ConfigError(f"rl.router_replay=true: {cfg.model_name} (model family {cfg.model.family!r} here) has no layer "
                      "whose choices a replay forces, so there is nothing to replay; drop rl.router_replay")


def build_rl_step(cfg: Config, mesh=None) -> ST.TrainStep:
  """The train step with the GRPO loss and the RL batch fields; global batch rows = prompts x G."""
  check_rl(cfg)
  rows = cfg.rl.prompts_per_step * cfg.rl.num_generations
  n = cfg.rl.num_iterations
  if n > 1:
    # The learning-rate schedule counts updates: rl.num_iterations per RL step (train.steps counts RL steps).
    t = cfg.train
    cfg = cfg.model_copy(update={"train": t.model_copy(update={"steps": t.steps * n, "warmup_steps": t.warmup_steps * n})})
  return ST.build_train_step(cfg, mesh, loss_fn=functools.partial(rl_loss, num_rows=rows), batch_spec=rl_fields(cfg))


def scorer(cfg: Config, step: ST.TrainStep):
  """jit (params, batch) -> log q [B, T] of the batch's targets, with no gradient: the trainer's scoring of a
  rollout before any update (rl.sampler_is) and the reference policy's (rl.beta). params: the whole model tree,
  the model-state leaves merged in (params.merge_state: DeepSeek-V3's routing bias), as the sampler takes it."""
  batch_sh = {k: step.batch_sharding(k) for k in step.batch_spec}
  param_sh = model_shardings(cfg, step.mesh)

  def f(params, batch):
    return scores(cfg, params, batch, cfg.rl.router_replay)[0]
  return jax.jit(f, in_shardings=(param_sh, batch_sh))
