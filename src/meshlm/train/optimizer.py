"""AdamW with warmup + cosine decay and global-norm clipping, through optax."""
from __future__ import annotations

import jax
import optax

from meshlm.config import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
  warmup = min(t.warmup_steps, max(t.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=warmup,
      decay_steps=max(t.steps, warmup + 1), end_value=t.learning_rate * t.min_lr_ratio)


def decay_mask(no_decay):
  """AdamW's weight-decay mask from a pytree of bools (True: no decay), or None (decay everything).

  A function of the parameters rather than a tree, so it also fits the subtree optax.masked hands on under
  train.freeze (its frozen leaves are MaskedNodes, with no leaves of their own): each leaf is looked up by path.
  """
  if no_decay is None:
    return None
  skip = {path: bool(flag) for path, flag in jax.tree_util.tree_flatten_with_path(no_decay)[0]}
  return lambda params: jax.tree_util.tree_map_with_path(lambda path, _: not skip[path], params)


def make_optimizer(t: TrainConfig, trainable=None, no_decay=None) -> optax.GradientTransformation:
  """trainable: a pytree of bools over the parameters (train.freeze); frozen leaves get no state.
  no_decay: a pytree of bools, True for leaves weight decay skips (spec.no_decay_mask); None: decay all."""
  opt = optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask(no_decay)),
  )
  return opt if trainable is None else optax.masked(opt, trainable)
