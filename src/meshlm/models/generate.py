"""Greedy sampling from a trained model: a short, honest look at what it learned."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm.models import decoder


def greedy(cfg: Config, params, prompt: np.ndarray, num_tokens: int, mesh=None) -> np.ndarray:
  """Extends a 1-D prompt by num_tokens greedy tokens. Recomputes the whole prefix each token
  (no KV cache): fine for the short samples it is used for."""
  length = min(len(prompt) + num_tokens, cfg.model.max_position)
  buf = np.zeros((1, length), np.int32)
  buf[0, :len(prompt)] = prompt

  @jax.jit
  def next_token(params, tokens, i):
    logits = decoder.forward(cfg, params, tokens)
    return jnp.argmax(logits[0, i - 1].astype(jnp.float32))

  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    for i in range(len(prompt), length):
      buf[0, i] = int(next_token(params, jnp.asarray(buf), i))
  return buf[0, len(prompt):]
