"""KV-cache slots: where each position's keys and values live while sampling.

A layer's cache leaf has a batch axis and a slot axis of C slots (GQA's "k" and "v": [B, K, C, H], kv
heads before slots, so the decode attention contracts it as stored). Full-attention layers get C = the
whole sampled length, so slot s holds position s. Sliding-window layers get C = min(window, length) slots used as a ring:
position p lives in slot p % C. Either way, at current position `cur` slot s holds the largest
p <= cur with p % C == s, so which position a slot holds never needs storing: it follows from each
row's current position. Rows advance independently (prompts of different lengths).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import axes, constrain, current_mesh, logical_spec

CACHE_AXES = axes("batch", "kv_heads", None, "head_dim")  # GQA's K and V: [B, K, C, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerRow:
  """A scanned layer's cache leaf left in the stacked cache: row `index` (traced: the layer scan's counter) of
  `stack` [G, ...]. A kernel that indexes the stack itself (nn/decode_attention.py) reads the layer's slots where
  they lie; `get()` slices the row out, which XLA:TPU copies (a dynamic slice it does not fuse into the attention's
  dot). Handed to a part for the leaves whose StateLeaf says `in_place` (models/layers.py)."""
  stack: jax.Array
  index: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.stack.shape[1:])

  def get(self) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False)


def row(leaf) -> jax.Array:
  """A cache leaf as a plain array: a LayerRow's row sliced out; anything else as it is."""
  return leaf.get() if isinstance(leaf, LayerRow) else leaf


def cache_size(length: int, window: int | None) -> int:
  return length if window is None else min(window, length)


@dataclasses.dataclass(frozen=True)
class Slots:
  """Per-row slot bookkeeping for one cache size C (shared by every layer of one context)."""
  size: int
  src: jax.Array | None = None  # prefill: [B, C] the prompt position each slot takes
  valid: jax.Array | None = None  # [B, C] whether the slot holds a position at all
  write: jax.Array | None = None  # decode: [B, C] the slot the new position goes to
  write_slot: jax.Array | None = None  # decode: [B] that slot's index

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
  """One new position cur_B[b] per row: it reads every other valid slot and its own key, and is then
  written to slot cur % C."""
  _, valid = _slot_positions(cur_B.astype(jnp.int32), size)
  slot = cur_B.astype(jnp.int32) % size
  write = jnp.arange(size, dtype=jnp.int32)[None, :] == slot[:, None]
  return Slots(size, valid=valid, write=write, write_slot=slot)


def fill(rows: jax.Array, slots: Slots, axes, slot_axis: int = 1) -> jax.Array:
  """A prefill's rows (keys, values, a latent; batch first, the T prompt positions at slot_axis) -> the
  cache, the same with C slots there, sharded as axes."""
  x = jnp.moveaxis(rows, slot_axis, 1)  # [B, T, ...]
  B, T = x.shape[:2]
  rest = (1,) * (x.ndim - 2)
  if slots.size == T:
    out = x  # slot s holds position s
  elif slots.size > T:
    out = jnp.pad(x, ((0, 0), (0, slots.size - T)) + ((0, 0),) * len(rest))
  else:
    # A ring smaller than the prompt: each row keeps its last C positions, at p % C.
    out = jnp.take_along_axis(x, jnp.reshape(slots.src, slots.src.shape + rest), axis=1)
  out = jnp.where(jnp.reshape(slots.valid, slots.valid.shape + rest), out, jnp.zeros((), out.dtype))
  return constrain(jnp.moveaxis(out, 1, slot_axis), axes)


def write_rows(cache: jax.Array, rows: jax.Array, slots: Slots, axes, slot_axis: int) -> jax.Array:
  """Writes each row's new position into its slot, in place: cache with its batch axis (axes' "batch")
  and its slot axis (slot_axis) among any others (a layer's cache, or a stack of them), rows the same
  with 1 at slot_axis. One scatter of B rows inside shard_map, so the update is local to each shard and
  XLA writes the donated buffer instead of copying it."""
  assert cache.ndim == rows.ndim == len(axes), (cache.shape, rows.shape, axes)
  b_axis = list(axes).index("batch")
  slot_B = slots.write_slot

  def local(c, r, s):
    # Indexed in place, in the stored layout: a moveaxis of the cache would make XLA copy the buffer.
    idx = [slice(None)] * c.ndim
    idx[b_axis], idx[slot_axis] = jnp.arange(c.shape[b_axis]), s
    new = jax.lax.index_in_dim(r, 0, axis=slot_axis, keepdims=False)  # B still at b_axis (or b_axis - 1)
    if abs(slot_axis - b_axis) != 1:
      # Apart, numpy indexing puts the indexed (batch) dimension first.
      new = jnp.moveaxis(new, b_axis if b_axis < slot_axis else b_axis - 1, 0)
    return c.at[tuple(idx)].set(new.astype(c.dtype), unique_indices=True)
  mesh = current_mesh()
  if mesh.empty:
    return local(cache, rows, slot_B)
  spec = logical_spec(axes, cache.shape)
  row_spec = logical_spec(axes, rows.shape)
  s_spec = jax.sharding.PartitionSpec(spec[b_axis])
  cache, rows, slot_B = constrain(cache, axes), constrain(rows, axes), constrain(slot_B, ("batch",))
  return jax.shard_map(local, in_specs=(spec, row_spec, s_spec), out_specs=spec)(cache, rows, slot_B)
