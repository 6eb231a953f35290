"""The validation set (eval.path, eval.every, eval.batches): its loss and perplexity under the train step's own loss.

The batches are one pass of eval.path in storage order (no shuffle): every row once, packed and masked by the same
data.* rules as training (formats, chat template, completion_only / assistant_only), the last batch padded with empty
rows, which hold no target; eval.batches=N caps it at the first N global batches. The same batches at every
evaluation and on any number of processes (every process reads the same global stream and keeps its rows, as
training does). They are read once, at start-up, and kept on the host; each evaluation places them on the devices
one at a time, so a large validation file costs host memory, not device memory.

The loss is the train step's loss function, forward only (one jit; no second model path: its log-probs are
models/logprobs.target_logprobs's, materialized or blockwise as the step's): the mean next-token cross-entropy over
every trained token of all the batches (each batch's mean weighted by its token count: TRL's evaluate() over the whole
set), without the parts' auxiliary loss terms, which are training objectives. Perplexity is exp of it. `meshlm eval`
(commands/eval.py) runs it alone, on a model's parameters.
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
  """The validation stream: one pass of eval.path in storage order; a refusal names eval.path."""
  from meshlm.train.data import make_dataset
  try:
    return make_dataset(eval_config(cfg), global_batch=global_batch, seq_len=seq_len, rows=rows, shuffle=False,
                        key="eval.path", once=True)
  except ConfigError as e:
    msg = str(e)
    raise ConfigError(msg if msg.startswith("eval.path") else f"eval.path={cfg.eval.path}: {msg}") from None


def eval_due(cfg: Config, step: int) -> bool:
  """Whether the validation loss is measured after step `step` (0-based): every eval.every steps, and the last."""
  e = cfg.eval
  return e.path is not None and ((e.every > 0 and (step + 1) % e.every == 0) or step + 1 == cfg.train.steps)


def _loss_sum(cfg: Config, loss_fn, params, model_state, batch: dict) -> tuple[jax.Array, jax.Array]:
  """(mean of the trained tokens' cross-entropy, their count) of one batch, through the train step's loss_fn; the
  caller weights the means by the counts in float64 (a float32 product would round once more)."""
  n = jnp.sum(batch["loss_mask"])
  num = jnp.maximum(n, 1.0)
  loss, metrics = loss_fn(cfg, merge_state(params, model_state), batch, num)
  for name, (coef, _) in resolve(cfg).losses.items():
    loss = loss - coef * metrics[name]  # the parts' terms (each weighted by the batch's share, 1 here)
  return loss, n


class Validation:
  """Callable on a TrainState (or anything with its params and model_state): {"val_loss", "val_ppl", "val_tokens",
  "val_rows"}. `rows` and `tokens`: the rows (documents) and trained targets it covers; `describe()` says so.
  data (tests): the host batches to use instead of eval.path's pass; a stream that never ends needs eval.batches."""

  def __init__(self, cfg: Config, step_fn, *, data=None):
    from meshlm.train.data import batch_rows
    self.cfg, self.step_fn = cfg, step_fn
    if data is None:
      seq_len, gb = cfg.train.seq_len, step_fn.global_batch
      data = eval_dataset(cfg, global_batch=gb, seq_len=seq_len, rows=batch_rows(step_fn.mesh, gb, seq_len))
    cap = cfg.eval.batches
    self.batches = []  # on the host: placed on the devices one at a time by each evaluation
    for batch in data:  # one pass: the stream ends after the file's last row
      self.batches.append(batch)
      if cap is not None and len(self.batches) == cap:
        break
    self.whole = cap is None or len(self.batches) < cap or _ended(data)
    # Counted on the global batches (each process holds only its rows of them).
    with jax.set_mesh(step_fn.mesh):
      counts = jax.device_get([_counts(step_fn.put_batch(b)) for b in self.batches])
    self.tokens = int(sum(int(t) for t, _ in counts))
    if self.whole:  # every document of the file once
      self.rows = int(getattr(data, "documents_read", 0))
    else:  # the documents in the batches; a text document cut across packed rows counts once per piece
      self.rows = int(sum(int(p) for _, p in counts))
    if not self.tokens:
      which = "the whole file" if self.whole else f"its first {cap} batches (eval.batches)"
      raise ConfigError(f"eval.path={cfg.eval.path}: {which} has no trained tokens")
    self._fn = jax.jit(lambda p, s, b: _loss_sum(cfg, step_fn.loss_fn, p, s, b))

  def describe(self) -> str:
    """What one evaluation covers, for the log: rows, trained tokens and batches of which file."""
    which = ("the whole file" if self.whole else f"the first {len(self.batches)} global batches (eval.batches)")
    return (f"eval.path={self.cfg.eval.path}: {self.rows} rows, {self.tokens:,} trained tokens in {len(self.batches)} "
            f"global batches ({which})")

  def __call__(self, state) -> dict[str, float]:
    total, tokens = 0.0, 0.0
    with jax.set_mesh(self.step_fn.mesh):
      outs = [self._fn(state.params, state.model_state, self.step_fn.put_batch(b)) for b in self.batches]
    for loss, n in jax.device_get(outs):
      total, tokens = total + float(loss) * float(n), tokens + float(n)
    loss = total / max(tokens, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": tokens, "val_rows": self.rows}


@jax.jit
def _counts(batch: dict) -> tuple[jax.Array, jax.Array]:
  """(trained targets, documents or pieces of documents) of a global batch: a piece starts where a row's non-zero
  segment id changes."""
  seg = batch["segment_ids"]  # [B, T]
  starts = (seg != 0) & (seg != jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1])
  return jnp.sum(batch["loss_mask"]).astype(jnp.int32), jnp.sum(starts).astype(jnp.int32)


def _ended(data) -> bool:
  """Whether a stream capped at eval.batches had nothing after them (the cap covered the whole file)."""
  try:
    next(data)
  except StopIteration:
    return True
  return False
