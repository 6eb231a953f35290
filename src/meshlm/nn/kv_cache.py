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
import functools
import math

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import axes, constrain, current_mesh, logical_spec, platform

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


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("size",),
                   data_fields=("src", "valid", "write", "write_slot", "position"))
@dataclasses.dataclass(frozen=True)
class Slots:
  """Per-row slot bookkeeping for one cache size C (shared by every layer of one context)."""
  size: int
  src: jax.Array | None = None  # prefill: [B, C] the prompt position each slot takes
  valid: jax.Array | None = None  # [B, C] whether the slot holds a position at all
  write: jax.Array | None = None  # decode: [B, C] the slot the new position goes to
  write_slot: jax.Array | None = None  # decode: [B] that slot's index
  position: jax.Array | None = None  # decode: [B] the new position (the slots a row reads: s < min(position, size),
  # less write_slot)

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
  return Slots(size, valid=valid, write=write, write_slot=slot, position=cur_B.astype(jnp.int32))


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


def write_rows(cache: jax.Array, rows: jax.Array, slots: Slots, axes, slot_axis: int, tiles: bool = False) -> jax.Array:
  """Writes each row's new position into its slot, in place: cache with its batch axis (axes' "batch")
  and its slot axis (slot_axis) among any others (a layer's cache, or a stack of them), rows the same
  with 1 at slot_axis. Inside shard_map, so the update is local to each shard and XLA writes the donated buffer
  instead of copying it: one scatter of B rows, or with tiles a Pallas kernel that sets each row in the tile of
  device memory holding its slot (write_by_blocks). XLA:TPU lays a scattered cache out with the slot axis outside
  the KV heads ([.., C, K, H] in memory: each row's window contiguous), which the pallas decode attention
  (nn/decode_attention.py) cannot read: a program whose decode attention is that kernel would relayout the whole
  cache every step, so it writes by tiles, which keeps the cache in its own layout. (A loop of B in-place
  dynamic-update-slices keeps it too, at ~5 us a row by XLA:TPU's own estimate at qwen3-0.6b: 0.7 ms a step at
  batch 64.)"""
  assert cache.ndim == rows.ndim == len(axes), (cache.shape, rows.shape, axes)
  b_axis = list(axes).index("batch")
  slot_B = slots.write_slot

  def scatter(c, r, s):
    # Indexed in place, in the stored layout: a moveaxis of the cache would make XLA copy the buffer.
    idx = [slice(None)] * c.ndim
    idx[b_axis], idx[slot_axis] = jnp.arange(c.shape[b_axis]), s
    new = jax.lax.index_in_dim(r, 0, axis=slot_axis, keepdims=False)  # B still at b_axis (or b_axis - 1)
    if abs(slot_axis - b_axis) != 1:
      # Apart, numpy indexing puts the indexed (batch) dimension first.
      new = jnp.moveaxis(new, b_axis if b_axis < slot_axis else b_axis - 1, 0)
    return c.at[tuple(idx)].set(new.astype(c.dtype), unique_indices=True)

  def by_blocks(c, r, s):
    return write_by_blocks(c, r.astype(c.dtype), s, b_axis, slot_axis)
  local = by_blocks if tiles else scatter
  mesh = current_mesh()
  if mesh.empty:
    return local(cache, rows, slot_B)
  spec = logical_spec(axes, cache.shape)
  row_spec = logical_spec(axes, rows.shape)
  s_spec = jax.sharding.PartitionSpec(spec[b_axis])
  cache, rows, slot_B = constrain(cache, axes), constrain(rows, axes), constrain(slot_B, ("batch",))
  # A Pallas kernel's output says nothing of how it varies over the mesh: unchecked (check_vma) for the tiled write.
  return jax.shard_map(local, in_specs=(spec, row_spec, s_spec), out_specs=spec, check_vma=not tiles)(cache, rows,
                                                                                                     slot_B)


def write_by_blocks(cache: jax.Array, rows: jax.Array, slot_B: jax.Array, b_axis: int, slot_axis: int,
                    interpret: bool | None = None) -> jax.Array:
  """cache with row b of rows (1 at slot_axis) at slot slot_B[b] of its batch row b, by a Pallas kernel whose output
  is the cache (aliased: written in place, in its own layout). The slot axis is the second to last (the slots of a
  head, [.., C, H]), which device memory stores in tiles of `rows_per_tile` slots: a row alone cannot be copied in
  or out, so each batch row's tile holding its slot is read, the row set in it, and the tile written back (a grid
  over the batch rows, and over blocks of the leading axis where a tile of every layer would not fit the VMEM
  budget below). interpret: Pallas interpret mode (default: off TPU)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  assert slot_axis == cache.ndim - 2 and b_axis < slot_axis, (cache.shape, b_axis, slot_axis)
  interpret = platform() != "tpu" if interpret is None else interpret
  C = cache.shape[slot_axis]
  tile = rows_per_tile(cache.dtype)
  tile = tile if C % tile == 0 else C  # a cache of fewer (or uneven) slots is one block
  shape = list(cache.shape)
  shape[slot_axis] = tile
  # The leading axis (the layers of a stacked cache) in blocks of at most BLOCK_BYTES of tiles.
  split = 0 if b_axis != 0 else None
  lead = 1
  if split is not None:
    per = math.prod(shape) // shape[0] // cache.shape[b_axis] * cache.dtype.itemsize
    lead = max([1] + [d for d in range(1, shape[0] + 1) if shape[0] % d == 0 and d * per <= BLOCK_BYTES])
    shape[0] = lead

  def block(b, layer, slot):
    idx = [0] * cache.ndim
    idx[b_axis], idx[slot_axis] = b, slot
    if split is not None:
      idx[split] = layer
    return tuple(idx)
  dims = [None if d == b_axis else n for d, n in enumerate(shape)]
  row_dims = [None if d == b_axis else (1 if d == slot_axis else n) for d, n in enumerate(shape)]
  cache_spec = pl.BlockSpec(tuple(dims), lambda b, l, slot_ref: block(b, l, slot_ref[b] // tile))
  row_spec = pl.BlockSpec(tuple(row_dims), lambda b, l, slot_ref: block(b, l, 0))

  def kernel(slot_ref, rows_ref, tile_ref, out_ref):
    at = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, out_ref.ndim - 2) == slot_ref[pl.program_id(0)] % tile
    out_ref[...] = jnp.where(at, rows_ref[...], tile_ref[...])
  steps = cache.shape[0] // lead if split is not None else 1
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(cache.shape[b_axis], steps),
                                           in_specs=[row_spec, cache_spec], out_specs=cache_spec)
  with jax.named_scope("write_rows"):
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                          input_output_aliases={2: 0}, interpret=interpret, name="write_rows",
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")))(
                              slot_B.astype(jnp.int32), rows, cache)


def rows_per_tile(dtype) -> int:
  """The slots one tile of device memory holds: XLA:TPU tiles a [.., C, H] cache (8, 128) in HBM whatever its dtype
  (bfloat16's packed in pairs of rows within the tile)."""
  del dtype
  return 8


# write_by_blocks' tiles of the leading axis per step at most: the block, its write and the next (double-buffered)
# stay well inside the TPU's default scoped VMEM (16 MiB on v5e).
BLOCK_BYTES = 2 << 20
