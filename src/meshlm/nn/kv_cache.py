"""KV-cache slots: where each position's keys and values live while sampling.

A layer's cache is {"k", "v"}: [B, C, K, H]. Full-attention layers get C = the whole sampled length,
so slot s holds position s. Sliding-window layers get C = min(window, length) slots used as a ring:
position p lives in slot p % C. Either way, at current position `cur` slot s holds the largest
p <= cur with p % C == s, so which position a slot holds never needs storing: it follows from each
row's current position. Rows advance independently (prompts of different lengths).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import constrain

CACHE_AXES = ("batch", None, "kv_heads", "head_dim")  # [B, C, K, H]


def cache_size(length: int, window: int | None) -> int:
  return length if window is None else min(window, length)


@dataclasses.dataclass(frozen=True)
class Slots:
  """Per-row slot bookkeeping for one cache size C (shared by every layer of one context)."""
  size: int
  src: jax.Array | None = None  # prefill: [B, C] the prompt position each slot takes
  valid: jax.Array | None = None  # [B, C] whether the slot holds a position at all
  write: jax.Array | None = None  # decode: [B, C] the slot the new position goes to

  @property
  def read_mask(self) -> jax.Array:
    """[B, 1, 1, 1, C]: decode attends to every slot that holds a position (all within the window)."""
    return self.valid[:, None, None, None, :]


def _slot_positions(last_B: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """(position held by each slot, valid): the largest p <= last with p % size == slot."""
  s = jnp.arange(size, dtype=jnp.int32)
  d = last_B[:, None] - s[None, :]  # [B, C]
  return s[None, :] + size * (jnp.maximum(d, 0) // size), d >= 0


def prefill_slots(lengths_B: jax.Array, T: int, size: int) -> Slots:
  """The prompt rows hold lengths_B[b] real tokens (right-padded to T)."""
  src, valid = _slot_positions(lengths_B.astype(jnp.int32) - 1, size)
  return Slots(size, src=jnp.minimum(src, T - 1), valid=valid)


def decode_slots(cur_B: jax.Array, size: int) -> Slots:
  """One new position cur_B[b] per row: it is written to slot cur % C, then every slot is read."""
  _, valid = _slot_positions(cur_B.astype(jnp.int32), size)
  write = jnp.arange(size, dtype=jnp.int32)[None, :] == (cur_B.astype(jnp.int32) % size)[:, None]
  return Slots(size, valid=valid, write=write)


def fill(x_BTKH: jax.Array, slots: Slots) -> jax.Array:
  """A prefill's keys or values [B, T, K, H] -> the cache [B, C, K, H]."""
  B, T = x_BTKH.shape[:2]
  if slots.size == T:
    out = x_BTKH  # slot s holds position s
  elif slots.size > T:
    out = jnp.pad(x_BTKH, ((0, 0), (0, slots.size - T), (0, 0), (0, 0)))
  else:
    # A ring smaller than the prompt: each row keeps its last C positions, at p % C.
    out = jnp.take_along_axis(x_BTKH, slots.src[:, :, None, None], axis=1)
  out = jnp.where(slots.valid[:, :, None, None], out, jnp.zeros((), out.dtype))
  return constrain(out, CACHE_AXES)


def write(cache_BCKH: jax.Array, x_B1KH: jax.Array, slots: Slots) -> jax.Array:
  """Puts one new position's keys or values into its slot."""
  out = jnp.where(slots.write[:, :, None, None], x_B1KH.astype(cache_BCKH.dtype), cache_BCKH)
  return constrain(out, CACHE_AXES)
