"""Decode attention that reads only the filled part of the cache: a Pallas TPU kernel, the
`decode_attention_impl=pallas` path of one new position per row against its layer's K/V cache.
nn/attention.gqa_attention_decode (the `xla` path) is the reference it is tested against, and the path on CPU and
GPU.

What a decode step must read of the cache is the rows written so far; the xla path reads the whole buffer of C slots
every step (its einsums contract every slot and mask the empty ones), and inside the layer scan XLA:TPU copies each
layer's K out of the stacked cache first (a dynamic slice it cannot fuse into the dot): at qwen3-0.6b, batch 64, a
512-slot cache, 7.5 GB of cache traffic per step where the filled rows are 1.9 GB on average (docs/compile.md, "The
decode attention").

The kernel, per batch row b (grid (B, key blocks); the KV heads of a row in one step):
  - the cache slots a row reads are s < min(cur_b, C), less slot cur_b % C: cur_b is the new position, and in a
    ring (a sliding-window layer, C = the window) the slot being written holds a position the new one no longer sees
    (nn/kv_cache.decode_slots' mask, as a count and one slot). A full-attention cache is never wrapped (C exceeds
    every position), so its slots are the prefix [0, cur_b);
  - the key blocks past a row's last filled block are not read: their index map is clamped to that block, which the
    pipeline does not fetch again, and the kernel skips their compute (the lengths are scalar-prefetched);
  - the new position's own key and value, not in the cache yet (the decoder writes them after the layers), seed the
    online softmax: one softmax over the filled slots and the new key, as gqa_attention_decode's;
  - GQA: the G = N / K query heads of a KV head are the rows of one dot against its keys; soft-capping
    (cap * tanh(s / cap)) on the scaled scores; scores, softmax and the accumulator in float32, the probabilities
    cast to the values' dtype for their dot (as the reference does).
  - the cache is read where it lies: `cache` is one layer's [B, K, C, H], or a scanned layer's row left in the stacked
    cache [L, B, K, C, H] (nn/kv_cache.LayerRow) with the traced layer index scalar-prefetched into the index map,
    so no per-layer slice of the stack is copied.

The decoder writes the new K/V rows after the layers with a kernel too (nn/kv_cache.write_by_blocks): XLA:TPU lays
a scattered cache out with its slots outside the KV heads, which this kernel cannot read, and would relayout the
whole cache every step.

When it runs: `decode_attention_impl` (`resolve`): auto is pallas on TPU and xla elsewhere; pallas asks for it
anywhere (off TPU in Pallas interpret mode: slow, for tests). A layer whose cache no block of at most
`decode_attention_block` slots fits (`block_for`: the whole cache, or a divisor of it that is a multiple of 16
slots, bf16's sublane tile) runs xla (`Decode.for_size`). Scores in float32 from the first dot on, where the xla
path rounds them to the compute dtype first: bfloat16 runs differ by that rounding (float32 ones by ~1e-6).
The kernel is a Mosaic custom call, which XLA cannot partition: it runs in a `jax.shard_map` over the current mesh,
rows over the batch's mesh axes and KV heads over tensor where tensor divides them (nn/splash_attention.row_spec).
The gqa and gated_gqa mixers attend through it (`Decode.attend`); MLA's latent cache keeps its own decode.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlm.nn import kv_cache
from meshlm.nn.attention import decode_mask, gqa_attention_decode
from meshlm.nn.kv_cache import LayerRow
from meshlm.parallel.sharding import current_mesh, logical_spec, platform

IMPLS = ("auto", "xla", "pallas")
SUBLANES = 16  # a block of slots is a multiple of this (bf16's sublane tile) unless it is the whole cache


def block_for(size: int, block: int) -> int | None:
  """The kernel's block of slots over a cache of `size` slots: the whole cache when it is at most `block`, else the
  largest divisor of size that is at most block and a multiple of SUBLANES; None where there is none (the xla path
  runs)."""
  if size <= block:
    return size
  for b in range(block - block % SUBLANES, 0, -SUBLANES):
    if size % b == 0:
      return b
  return None


def resolve(impl: str, on: str | None = None) -> str:
  """"pallas" or "xla": the decode attention a program on platform `on` (default: the traced program's) runs. auto:
  pallas on TPU, xla elsewhere. A layer whose cache no block fits runs xla whatever this says (Decode.for_size)."""
  if impl not in IMPLS:
    raise ValueError(f"decode_attention_impl={impl!r}: expected auto, xla or pallas")
  if impl == "auto":
    return "pallas" if (on or platform()) == "tpu" else "xla"
  return impl


@dataclasses.dataclass(frozen=True)
class Decode:
  """The decode attention of one program, resolved where the context is made (models/context.make_context): `name`
  pallas or xla for this platform (resolve; a cache whose slots no block fits still runs xla, `for_size`), the
  kernel's `block` (decode_attention_block) and `interpret` (Pallas interpret mode, off TPU)."""
  name: str = "xla"
  block: int = 128
  interpret: bool = False

  def for_size(self, size: int) -> str:
    """What a layer with a cache of `size` slots runs: name, or xla where block_for finds no block."""
    return self.name if self.name == "xla" or block_for(size, self.block) is not None else "xla"

  def attend(self, q_BN1H, k_BK1H, v_BK1H, k_cache, v_cache, slots: kv_cache.Slots, *, scale: float,
             softcap: float | None = None) -> jax.Array:
    """One new position per row against its layer's cache and its own key and value: [B, N, 1, Hv]. k_cache /
    v_cache: the layer's cache [B, K, C, H] or a LayerRow of the stacked one; slots: the context's decode slots."""
    if self.for_size(slots.size) == "xla":
      mask = decode_mask(slots.read_mask, slots.write)
      return gqa_attention_decode(q_BN1H, k_BK1H, v_BK1H, kv_cache.row(k_cache), kv_cache.row(v_cache), mask,
                                  scale=scale, softcap=softcap)
    return decode_attention(q_BN1H, k_BK1H, v_BK1H, k_cache, v_cache, slots.position, scale=scale, softcap=softcap,
                            block=self.block, interpret=self.interpret)


def decode_attention(q_BN1H: jax.Array, k_BK1H: jax.Array, v_BK1H: jax.Array, k_cache, v_cache, cur_B: jax.Array, *,
                     scale: float, softcap: float | None = None, block: int = 128,
                     interpret: bool | None = None) -> jax.Array:
  """gqa_attention_decode's result, [B, N, 1, Hv], reading only each row's filled slots (module docstring).

  q [B, N, 1, H], the new key and value k [B, K, 1, H], v [B, K, 1, Hv]; k_cache / v_cache one layer's cache
  [B, K, C, H] / [B, K, C, Hv] or a LayerRow of the stacked cache; cur_B [B] each row's new position (the slots it
  reads: s < min(cur, C), less slot cur % C). block: at most this many slots per kernel step (block_for).
  interpret: Pallas interpret mode (default: off TPU)."""
  k_stack, layer = _stacked(k_cache)
  v_stack, _ = _stacked(v_cache)  # the same layer's (one scan counter indexes both leaves)
  C = k_stack.shape[3]
  b = block_for(C, block)
  assert b is not None, f"no block of at most {block} slots divides a cache of {C} (resolve routes this to xla)"
  interpret = platform() != "tpu" if interpret is None else interpret
  cur = cur_B.astype(jnp.int32)
  layer_idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  kw = dict(size=C, block=b, scale=scale, softcap=softcap, interpret=interpret)
  with jax.named_scope("decode_attention"):
    return _sharded(q_BN1H, k_BK1H, v_BK1H, k_stack, v_stack, cur, layer_idx, kw)  # [B, N, 1, Hv]


def _stacked(cache) -> tuple[jax.Array, jax.Array | int]:
  """(the cache as [L, B, K, C, H], the layer's index in it): a LayerRow's stack and index, or one layer's cache
  with a leading axis of 1 (a reshape: no copy)."""
  if isinstance(cache, LayerRow):
    return cache.stack, cache.index
  return cache[None], 0


def _sharded(q, k_new, v_new, k_stack, v_stack, cur, layer, kw: dict):
  """_call in a shard_map over the current mesh (one device's too: inside it the arrays are the device's own, with
  no sharding in their types): rows over the batch's mesh axes, KV heads over tensor where it divides them; with no
  mesh, _call itself."""
  mesh = current_mesh()
  if mesh.empty:
    return _call(q, k_new, v_new, k_stack, v_stack, cur, layer, **kw)
  rows = logical_spec(("batch",), (q.shape[0],), mesh)[0]
  heads = logical_spec(("kv_heads",), (k_stack.shape[2],), mesh)[0]
  row = P(rows, heads, None, None)  # q [B, N, 1, H] too: tensor divides K, so N = K x G
  stack = P(None, rows, heads, None, None)
  fn = jax.shard_map(functools.partial(_call, **kw), mesh=mesh,
                     in_specs=(row, row, row, stack, stack, P(rows), P()), out_specs=row, check_vma=False)
  return fn(q, k_new, v_new, k_stack, v_stack, cur, layer)


def _call(q, k_new, v_new, k_stack, v_stack, cur, layer, *, size: int, block: int, scale: float,
          softcap: float | None, interpret: bool):
  """The pallas_call over this device's rows: q [B, N, 1, H], k_new [B, K, 1, H], v_new [B, K, 1, Hv], the stacks
  [L, B, K, C, H|Hv], cur [B], layer [1] -> [B, N, 1, Hv]."""
  # Imported here: Pallas and Mosaic add about 0.5 s to every meshlm import that never runs the kernel.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  B, N, _, H = q.shape
  K = k_stack.shape[2]
  G = N // K
  q = jnp.reshape(q, (B, K, G, H))  # query head n = k * G + g reads KV head k
  Hv = v_stack.shape[-1]
  n_blocks = size // block

  def last_block(b, cur_ref):
    # The last block holding a slot the row reads (0 when it reads none: that block is fetched, not computed).
    return jnp.maximum(pl.cdiv(jnp.minimum(cur_ref[b], size), block) - 1, 0)

  def cache_map(b, c, cur_ref, layer_ref):
    return layer_ref[0], b, 0, jnp.minimum(c, last_block(b, cur_ref)), 0

  def row_map(b, c, cur_ref, layer_ref):
    return b, 0, 0, 0

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(B, n_blocks),
      in_specs=[pl.BlockSpec((None, K, G, H), row_map), pl.BlockSpec((None, K, 1, H), row_map),
                pl.BlockSpec((None, K, 1, Hv), row_map),
                pl.BlockSpec((None, None, K, block, H), cache_map),
                pl.BlockSpec((None, None, K, block, Hv), cache_map)],
      out_specs=pl.BlockSpec((None, K, G, Hv), row_map),
      scratch_shapes=[pltpu.VMEM((K, G, 1), jnp.float32), pltpu.VMEM((K, G, 1), jnp.float32),
                      pltpu.VMEM((K, G, Hv), jnp.float32)])
  kernel = functools.partial(_kernel, size=size, block=block, scale=scale, softcap=softcap)
  out = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((B, K, G, Hv), q.dtype), interpret=interpret,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      name="decode_attention")(cur, layer, q, k_new, v_new, k_stack, v_stack)
  return jnp.reshape(out, (B, N, 1, Hv))


def _kernel(cur_ref, layer_ref, q_ref, kn_ref, vn_ref, kc_ref, vc_ref, o_ref, m_ref, l_ref, acc_ref, *,
            size: int, block: int, scale: float, softcap: float | None):
  """One row's step over one block of slots: q_ref [K, G, H], kn_ref [K, 1, H], vn_ref [K, 1, Hv], kc_ref [K, block,
  H], vc_ref [K, block, Hv]; the online softmax's max, sum and accumulator in m_ref, l_ref [K, G, 1] and acc_ref
  [K, G, Hv]."""
  from jax.experimental import pallas as pl
  del layer_ref  # read by the index maps
  b, c = pl.program_id(0), pl.program_id(1)
  K = q_ref.shape[0]
  f32 = jnp.float32
  cur = cur_ref[b]
  filled = jnp.minimum(cur, size)  # slots [0, filled) hold positions, but slot cur % size (the one being written)
  skip = cur % size

  def capped(s):
    s = s * scale
    return s if softcap is None else softcap * jnp.tanh(s / softcap)

  @pl.when(c == 0)
  def _seed():
    # The new position's own key: the softmax starts from its score, with its value as the accumulator.
    for k in range(K):
      q = q_ref[k].astype(f32)  # [G, H]
      s = capped(jnp.sum(q * kn_ref[k].astype(f32), axis=-1, keepdims=True))  # [G, 1]
      m_ref[k] = s
      l_ref[k] = jnp.ones_like(s)
      acc_ref[k] = jnp.broadcast_to(vn_ref[k].astype(f32), acc_ref.shape[1:])

  @pl.when(c * block < filled)
  def _block():
    slot = c * block + jax.lax.broadcasted_iota(jnp.int32, (q_ref.shape[1], block), 1)  # [G, block]
    seen = (slot < filled) & (slot != skip)
    for k in range(K):
      s = jax.lax.dot_general(q_ref[k], kc_ref[k], (((1,), (1,)), ((), ())), preferred_element_type=f32)
      s = jnp.where(seen, capped(s), jnp.finfo(f32).min)  # [G, block]
      m_old = m_ref[k]
      m_new = jnp.maximum(m_old, jnp.max(s, axis=-1, keepdims=True))
      alpha = jnp.exp(m_old - m_new)
      p = jnp.exp(s - m_new)
      l_ref[k] = alpha * l_ref[k] + jnp.sum(p, axis=-1, keepdims=True)
      pv = jax.lax.dot_general(p.astype(vc_ref.dtype), vc_ref[k], (((1,), (0,)), ((), ())),
                               preferred_element_type=f32)  # [G, Hv]
      acc_ref[k] = alpha * acc_ref[k] + pv
      m_ref[k] = m_new

  @pl.when(c == pl.num_programs(1) - 1)
  def _out():
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
