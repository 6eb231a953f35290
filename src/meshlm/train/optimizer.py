"""AdamW with warmup + cosine decay and global-norm clipping, through optax."""
from __future__ import annotations

import optax

from meshlm.config import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
  warmup = min(t.warmup_steps, max(t.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=warmup,
      decay_steps=max(t.steps, warmup + 1), end_value=t.learning_rate * t.min_lr_ratio)


def make_optimizer(t: TrainConfig, trainable=None) -> optax.GradientTransformation:
  """trainable: a pytree of bools over the parameters (train.freeze); frozen leaves get no state."""
  opt = optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay),
  )
  return opt if trainable is None else optax.masked(opt, trainable)
