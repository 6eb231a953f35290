"""The targets' log-probs under the model: the one function every loss reads, and the one place that decides how
the LM head runs.

    out = target_logprobs(cfg, params, batch, temperature=..., keep_fn=..., entropy=..., layer_inputs=...)
    out.logp [B, T], out.entropy [B, T] or None, out.side ({name: [n, B, T, ...]}, the parts' side outputs)

The train step's cross-entropy (train/step.next_token_loss, which validation runs forward only), the RL loss and
its scorer (rl/step.scores) call it; `meshlm compile` reports `loss_path`. The head runs

- materialized: decoder.head's [B, T, V] logits, then nn/head_loss.materialized_logprobs (the reference), or
- blockwise: nn/head_loss.blockwise_logprobs, the head and the log-softmax per block of at most loss_block
  positions under a custom VJP; [B, T, V] never exists,

as loss_impl says (auto: by the size of the logits, `loss_path`). Both start from decoder.features (the final-normed
hidden state and the side outputs), so everything before the head is one program either way. Blockwise, the head's
weight gradient is reduced once per micro-batch, with the layers' backward waiting for it or not as loss_grad_reduce
says (`grad_reduce`).
"""
from __future__ import annotations

from typing import Callable, Literal, NamedTuple

import jax

from meshlm.config import Config
from meshlm.models import decoder
from meshlm.models.model import Model, resolve
from meshlm.nn.head_loss import blockwise_logprobs, materialized_logprobs

# loss_impl=auto goes blockwise from this many logits (batch x seq_len x vocab of one micro-batch, all devices
# together): 2^28 float32 logits are 1 GiB, and the materialized path holds them and their log-softmax (and in
# the backward their gradient). Below it the logits are small next to the step, and the materialized path is
# today's numbers: every tiny preset stays on it (at most 16 rows x 128 positions x 512 per device: 2^20, 2^23 on
# 8 devices), on every backend. A trace sees the shapes, not the platform (the mesh it compiles for may be a
# compile-only TPU topology), so the choice reads the size only.
BLOCKWISE_FROM = 2 ** 28


def loss_path(cfg: Config | Model, batch: int, seq_len: int) -> Literal["materialized", "blockwise"]:
  """How the head and the log-softmax of a [batch, seq_len] (micro-)batch run (cfg.loss_impl; auto: by size)."""
  cfg = resolve(cfg).cfg
  if cfg.loss_impl != "auto":
    return cfg.loss_impl
  return "blockwise" if batch * seq_len * cfg.model.vocab_size >= BLOCKWISE_FROM else "materialized"


def grad_reduce(cfg: Config | Model) -> Literal["barrier", "overlap"]:
  """How the blockwise backward reduces the head's weight gradient (cfg.loss_grad_reduce; auto: barrier). The
  barrier frees the float32 accumulator before the layers' backward, which XLA:TPU otherwise holds over them: by
  analysis/layout.py's estimate the peak never rises with it (the accumulator then counts only in the loss's phase)
  and falls wherever a layer's backward needs more than the gathered head, as at every real-scale layout in
  docs/compile.md. Its cost is time only: the exchange no longer overlaps the layers' backward. The numbers are the
  same either way."""
  cfg = resolve(cfg).cfg
  return "barrier" if cfg.loss_grad_reduce == "auto" else cfg.loss_grad_reduce


class LogProbs(NamedTuple):
  logp: jax.Array  # [B, T] float32: log q(target)
  entropy: jax.Array | None  # [B, T] float32, with entropy=True
  side: dict  # the parts' side outputs, as decoder.forward's return_side


def target_logprobs(cfg: Config | Model, params: dict, batch: dict, *, temperature: float = 1.0,
                    keep_fn: Callable | None = None, entropy: bool = False,
                    layer_inputs: dict | None = None) -> LogProbs:
  """log q(batch["targets"]) per position (and the entropy of q, with entropy=True), q the model's next-token
  distribution over the temperature, restricted to keep_fn's kept set (keep_fn(z [B, T, V]) -> bool, z the capped
  logits over the temperature without gradient; the target is always kept). batch: inputs, targets, positions and
  segment_ids [B, T]; layer_inputs: decoder.forward's per-layer inputs (a replay's forced choices)."""
  M = resolve(cfg)
  tokens = batch["inputs"]
  x, side = decoder.features(M, params, tokens, batch["positions"], batch["segment_ids"], layer_inputs=layer_inputs)
  logp, ent = head_logprobs(M, params, x, batch["targets"], loss_path(M, *tokens.shape), temperature=temperature,
                            keep_fn=keep_fn, entropy=entropy)
  return LogProbs(logp, ent, side)


def head_logprobs(cfg: Config | Model, params: dict, x_BTD: jax.Array, targets_BT: jax.Array,
                  impl: Literal["materialized", "blockwise"], **kw) -> tuple[jax.Array, jax.Array | None]:
  """(log q(target) [B, T], entropy [B, T] or None) from the head's input x [B, T, D] (decoder.features), the head
  (tied or untied, soft-capped as decoder.head) run as impl says; kw: temperature, keep_fn, entropy. Blockwise, the
  head's weight gradient comes out in kernel order whatever the flags say (the blockwise VJP computes it so)."""
  M = resolve(cfg)
  if impl == "materialized":
    return materialized_logprobs(decoder.head(M, params, x_BTD), targets_BT, **kw)
  tied = M.cfg.model.tie_embeddings
  kernel = (params["embed"] if tied else params["lm_head"]).astype(x_BTD.dtype)
  with jax.named_scope("lm_head_loss"):
    return blockwise_logprobs(x_BTD, kernel, targets_BT, tied=tied, cap=M.cfg.model.final_logit_softcap,
                              block=M.cfg.loss_block, barrier=grad_reduce(M) == "barrier", **kw)
