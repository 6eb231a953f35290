"""The validation set (eval.path, eval.every, eval.batches): its loss and perplexity under the train step's own loss.

The batches are the first eval.batches global batches of eval.path read in storage order (no shuffle), packed and
masked by the same data.* rules as training (formats, chat template, completion_only / assistant_only): the same
batches at every evaluation and on any number of processes (every process reads the same global stream and keeps
its rows, as training does). They are read once, at start-up, and stay on the devices.

The loss is the train step's loss function, forward only (one jit; no second model path: its log-probs are
models/logprobs.target_logprobs's, materialized or blockwise as the step's): the mean next-token
cross-entropy over every trained token of all the batches (each batch's mean weighted by its token count), without
the parts' auxiliary loss terms, which are training objectives. Perplexity is exp of it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models.model import resolve
from meshlm.models.params import merge_state


def eval_config(cfg: Config) -> Config:
  """cfg with data.path = eval.path and data.source from its ending (every other data.* key as training's)."""
  path = cfg.eval.path
  suffix = next((x for x in type(cfg.data).SUFFIX_SOURCES if path.endswith(x)), None)
  if suffix is None:
    raise ConfigError(f"eval.path={path}: name .jsonl, .parquet, .txt or .md files (the ending says how to read them)")
  data = cfg.data.model_copy(update={"path": path, "source": type(cfg.data).SUFFIX_SOURCES[suffix]})
  return cfg.model_copy(update={"data": data})


def eval_dataset(cfg: Config, *, global_batch: int, seq_len: int, rows=None):
  """The validation stream: eval.path in storage order, repeated; a refusal names eval.path."""
  from meshlm.train.data import make_dataset
  try:
    return make_dataset(eval_config(cfg), global_batch=global_batch, seq_len=seq_len, rows=rows, shuffle=False)
  except ConfigError as e:
    msg = str(e)
    raise ConfigError(msg if msg.startswith("eval.path") else f"eval.path={cfg.eval.path}: {msg}") from None


def eval_due(cfg: Config, step: int) -> bool:
  """Whether the validation loss is measured after step `step` (0-based): every eval.every steps, and the last."""
  e = cfg.eval
  return e.path is not None and ((e.every > 0 and (step + 1) % e.every == 0) or step + 1 == cfg.train.steps)


def _loss_sum(cfg: Config, loss_fn, params, model_state, batch: dict) -> tuple[jax.Array, jax.Array]:
  """(sum of the trained tokens' cross-entropy, their count) of one batch, through the train step's loss_fn."""
  n = jnp.sum(batch["loss_mask"])
  num = jnp.maximum(n, 1.0)
  loss, metrics = loss_fn(cfg, merge_state(params, model_state), batch, num)
  for name, (coef, _) in resolve(cfg).losses.items():
    loss = loss - coef * metrics[name]  # the parts' terms (each weighted by the batch's share, 1 here)
  return loss * num, n


class Validation:
  """Callable on a TrainState: {"val_loss", "val_ppl", "val_tokens"}."""

  def __init__(self, cfg: Config, step_fn, *, data=None):
    from meshlm.train.data import batch_rows
    self.cfg, self.step_fn = cfg, step_fn
    if data is None:
      seq_len, gb = cfg.train.seq_len, step_fn.global_batch
      data = eval_dataset(cfg, global_batch=gb, seq_len=seq_len, rows=batch_rows(step_fn.mesh, gb, seq_len))
    host = [next(data) for _ in range(cfg.eval.batches)]
    if not sum(float(np.sum(b["loss_mask"])) for b in host):
      raise ConfigError(f"eval.path={cfg.eval.path}: its first {cfg.eval.batches} batches (eval.batches) have no "
                        "trained tokens")
    self.batches = [step_fn.put_batch(b) for b in host]
    self._fn = jax.jit(lambda p, s, b: _loss_sum(cfg, step_fn.loss_fn, p, s, b))

  def __call__(self, state) -> dict[str, float]:
    total, tokens = 0.0, 0.0
    with jax.set_mesh(self.step_fn.mesh):
      outs = [self._fn(state.params, state.model_state, b) for b in self.batches]
    for loss_sum, n in jax.device_get(outs):
      total, tokens = total + float(loss_sum), tokens + float(n)
    loss = total / max(tokens, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": tokens}
