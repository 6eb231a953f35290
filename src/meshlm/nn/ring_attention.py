"""Ring attention over mesh.context: the `context_attention=ring` core of training with the sequence sharded.

With T sharded over the C devices of mesh axis `context`, each device keeps its queries and passes its K/V (and
their segment ids) around the ring with `ppermute`, C - 1 hops; every incoming block is merged into the running
online softmax of the flash kernel (nn/flash_attention.py: merge_keys, its masks and tiles), so causal, sliding
window, packed segments, the soft-cap, GQA groups and MLA's unequal head dims work as there. No device ever holds
more than two chunks of K/V (its own and the one in flight). The backward is FlashAttention-2's, as a custom
VJP: K/V go around the ring again with their gradients travelling beside them (one more hop brings each dk, dv
home), dq accumulating in place; nothing but the inputs, the output and the row log-sum-exp is saved.

Causal balance (zigzag): the sequence is cut into 2C chunks and device r works on chunks r and 2C - 1 - r
(contiguous sharding gives it 2r and 2r + 1; a collective-permute of half the rows moves them there and the
output back). Then at every ring step after the first, each device has exactly two of its four (query chunk,
key chunk) pairs fully visible and two empty, so the C devices do the same work per step; with contiguous chunks
device C - 1 would do a full step of work at every hop while device 0 idles after the first, and the ring runs as
slow as its busiest device. `chunk_ids` and `ring_perm` are the two seams the tests break (negative controls).

Reference: nn/flash_attention.flash_attention on the whole sequence (and nn/attention.gqa_attention behind it).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.nn import flash_attention as FA
from meshlm.parallel.sharding import context_size

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Ring:
  flash: FA._Static  # its length: the real chunk length c (the chunks are padded to a multiple of the block)
  axis: str
  size: int  # C, the devices on the ring


def chunk_ids(r, C: int):
  """The two chunks (of 2C) that device r of the ring works on: r and 2C - 1 - r (zigzag)."""
  return r, 2 * C - 1 - r


def ring_perm(C: int) -> list[tuple[int, int]]:
  """Where each device sends the K/V it holds at a ring step: to the next device."""
  return [(i, (i + 1) % C) for i in range(C)]


def ring_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array | None = None,
                   *, scale: float, softcap: float | None = None, window: int | None = None, axis: str = "context",
                   block: int = FA.BLOCK) -> jax.Array:
  """flash_attention's contract ([B, T, K, G, Hv] back) with T sharded over mesh axis `axis` (the current mesh's;
  without it, or at size 1, flash_attention itself). T must divide by 2C. A shard_map manual over `axis` only:
  the batch and head axes keep the sharding the caller's region gives them."""
  C = context_size() if axis == "context" else dict(jax.sharding.get_abstract_mesh().shape).get(axis, 1)
  kw = dict(scale=scale, softcap=softcap, window=window, block=block)
  if C == 1:
    return FA.flash_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, **kw)
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  if T % (2 * C):
    raise ValueError(f"ring_attention: T={T} does not divide into 2 x mesh.{axis}={C} chunks")
  c = T // (2 * C)
  b = min(block, c)
  segs = () if segment_ids_BT is None else (segment_ids_BT.astype(jnp.int32),)
  ring = _Ring(FA._Static(float(scale), softcap, window, b, c, bool(segs)), axis, C)
  q = jnp.reshape(q_BTNH, (B, T, K, N // K, H))

  def local(q, k, v, *seg):
    q, k, v, *seg = (_to_zigzag(x, C, axis) for x in (q, k, v, *seg))
    out = _ring_attention(ring, q, k, v, seg[0] if seg else None)
    return _from_zigzag(out, C, axis)

  P = jax.sharding.PartitionSpec
  seq = P(None, axis)
  args = (q, k_BSKH, v_BSKH, *segs)
  if set(jax.sharding.get_abstract_mesh().axis_types) == {jax.sharding.AxisType.Explicit}:
    # Outside an auto-axes region (the mixers call it inside one): T onto `axis`, the other dims as they are.
    args = tuple(jax.sharding.reshard(x, P(*(jax.typeof(x).sharding.spec[:1] + (axis,)))) for x in args)
  with jax.named_scope("ring_attention"):
    return jax.shard_map(local, in_specs=(seq,) * len(args), out_specs=seq, axis_names=frozenset({axis}))(*args)


# ----------------------------------------------------------------------------------------------- the layout


def _where_chunk(x: int, C: int) -> tuple[int, int]:
  """(device, slot) of chunk x of 2C in the zigzag layout."""
  return (x, 0) if x < C else (2 * C - 1 - x, 1)


def _to_zigzag(x, C: int, axis: str):
  """A device's contiguous rows [B, 2c, ...] (chunks 2r, 2r + 1) -> its zigzag rows (chunks r, 2C - 1 - r): the
  even chunks and the odd ones each form one permutation of the devices (chunk r and 2C - 1 - r: one even, one
  odd), so two ppermutes of half the rows do it."""
  c = x.shape[1] // 2
  even = lax.ppermute(x[:, :c], axis, [(r, _where_chunk(2 * r, C)[0]) for r in range(C)])
  odd = lax.ppermute(x[:, c:], axis, [(r, _where_chunk(2 * r + 1, C)[0]) for r in range(C)])
  first_even = lax.axis_index(axis) % 2 == 0  # chunk r is even: it came with the even ones
  return jnp.where(first_even, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))


def _from_zigzag(y, C: int, axis: str):
  """_to_zigzag's inverse: each chunk back to its contiguous device and slot."""
  c = y.shape[1] // 2
  first_even = lax.axis_index(axis) % 2 == 0
  even = jnp.where(first_even, y[:, :c], y[:, c:])
  odd = jnp.where(first_even, y[:, c:], y[:, :c])
  even = lax.ppermute(even, axis, [(_where_chunk(2 * r, C)[0], r) for r in range(C)])
  odd = lax.ppermute(odd, axis, [(_where_chunk(2 * r + 1, C)[0], r) for r in range(C)])
  return jnp.concatenate([even, odd], 1)


# ------------------------------------------------------------------------------------------------ the ring


def _halves(x, cp: int):
  """[B, 2c, ...] -> its two chunks, each padded to cp rows."""
  c = x.shape[1] // 2
  pad = ((0, 0), (0, cp - c)) + ((0, 0),) * (x.ndim - 2)
  return tuple(jnp.pad(h, pad) if cp > c else h for h in (x[:, :c], x[:, c:]))


def _deltas(ring: _Ring, step):
  """{(query half, key half): first query position - first key position} at ring step `step` (the keys then come
  from device r - step)."""
  C, c = ring.size, ring.flash.length
  r = lax.axis_index(ring.axis)
  mine, theirs = chunk_ids(r, C), chunk_ids((r - step) % C, C)
  return {(a, e): (mine[a] - theirs[e]) * c for a in (0, 1) for e in (0, 1)}


def _send(ring: _Ring, *xs):
  return tuple(lax.ppermute(x, ring.axis, ring_perm(ring.size)) for x in xs)


def _forward(ring: _Ring, q, k, v, seg):
  """(out [B, 2c, K, G, Hv], lse halves [B, K, G, cp] x 2) of this device's zigzag rows."""
  st = ring.flash
  b, c = st.block, st.length
  cp = -(-c // b) * b
  n = cp // b
  qh, kh, vh = _halves(q, cp), _halves(k, cp), _halves(v, cp)
  sh = _halves(seg, cp) if st.segments else (None, None)
  B, _, K, G, _ = qh[0].shape
  Hv = v.shape[-1]
  rows = FA.empty_rows(B, K, G, b, Hv)
  # [n, B, K, G, bq(, Hv)] per query half, varying over the ring as the blocks merged into it do.
  state = tuple(tuple(lax.pcast(jnp.broadcast_to(x, (n,) + x.shape), (ring.axis,), to="varying") for x in rows)
                for _ in (0, 1))

  def merge(state, kv, step):
    kh, vh, sk = kv
    deltas = _deltas(ring, step)
    out = []
    for a in (0, 1):
      def query_block(args, a=a):
        i, carry = args
        q_i = lax.dynamic_slice_in_dim(qh[a], i * b, b, axis=1)
        for e in (0, 1):
          d = deltas[a, e]
          carry = FA.merge_keys(st, q_i, i, kh[e], vh[e], sh[a], carry, FA._key_blocks(st, i, d, n), sk[e], d)
        return carry
      out.append(lax.map(query_block, (jnp.arange(n), state[a])))
    return tuple(out)

  def hop(carry, step):
    state, kv = carry
    nxt = _send(ring, *jax.tree.leaves(kv))  # in flight while this step's blocks merge
    return (merge(state, kv, step), jax.tree.unflatten(jax.tree.structure(kv), nxt)), None

  kv = (kh, vh, sh)
  (state, kv), _ = lax.scan(hop, (state, kv), jnp.arange(ring.size - 1))
  state = merge(state, kv, ring.size - 1)
  outs, lses = zip(*(FA.blocks_to_rows(*FA.finish_rows(*s, v.dtype)) for s in state))
  out = jnp.concatenate([o[:, :c] for o in outs], axis=1)
  return out, lses


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, seg):
  return _forward(ring, q, k, v, seg)[0]


def _ring_fwd(ring: _Ring, q, k, v, seg):
  out, lses = _forward(ring, q, k, v, seg)
  return out, (q, k, v, seg, out, lses)


def _ring_bwd(ring: _Ring, res, d_out):
  """K/V go around the ring again, their float32 gradients beside them; per step, each of this device's key
  blocks against the query blocks that see it (flash's key_block_grads); a last hop brings dk, dv home."""
  q, k, v, seg, out, lses = res
  st = ring.flash
  b, c = st.block, st.length
  cp = -(-c // b) * b
  n = cp // b
  qh, doh, oh = _halves(q, cp), _halves(d_out, cp), _halves(out, cp)
  sh = _halves(seg, cp) if st.segments else (None, None)
  d_rows = tuple(FA.row_term(d, o) for d, o in zip(doh, oh))  # [B, K, G, cp] per half
  kv = (_halves(k, cp), _halves(v, cp), sh)
  zeros = lambda x: lax.pcast(jnp.zeros(x.shape, _F32), (ring.axis,), to="varying")  # noqa: E731
  dq = tuple(zeros(x) for x in qh)
  dkv = (tuple(zeros(x) for x in kv[0]), tuple(zeros(x) for x in kv[1]))

  def grads(dq, kv, dkv, step):
    (kh, vh, sk), (dk, dv) = kv, dkv
    deltas = _deltas(ring, step)
    dq, dk, dv = list(dq), list(dk), list(dv)
    for e in (0, 1):
      def key_block(dq, j, e=e):
        k_j = lax.dynamic_slice_in_dim(kh[e], j * b, b, axis=1)
        v_j = lax.dynamic_slice_in_dim(vh[e], j * b, b, axis=1)
        dk_j = lax.dynamic_slice_in_dim(dk[e], j * b, b, axis=1)
        dv_j = lax.dynamic_slice_in_dim(dv[e], j * b, b, axis=1)
        dq = list(dq)
        for a in (0, 1):
          d = deltas[a, e]
          dq[a], dk_j, dv_j = FA.key_block_grads(st, j, k_j, v_j, qh[a], doh[a], lses[a], d_rows[a], sh[a],
                                                 (dq[a], dk_j, dv_j), FA._query_blocks(st, j, n, d), sk[e], d)
        return tuple(dq), (dk_j, dv_j)
      dq, (dk_e, dv_e) = lax.scan(key_block, tuple(dq), jnp.arange(n))  # [n, B, bk, K, H]
      dk[e] = jnp.reshape(jnp.moveaxis(dk_e, 0, 1), kh[e].shape)
      dv[e] = jnp.reshape(jnp.moveaxis(dv_e, 0, 1), vh[e].shape)
    return tuple(dq), (tuple(dk), tuple(dv))

  def hop(carry, step):
    dq, kv, dkv = carry
    dq, dkv = grads(dq, kv, dkv, step)
    leaves = jax.tree.leaves((kv, dkv))
    moved = jax.tree.unflatten(jax.tree.structure((kv, dkv)), _send(ring, *leaves))
    return (dq,) + moved, None

  (dq, kv, dkv), _ = lax.scan(hop, (dq, kv, dkv), jnp.arange(ring.size - 1))
  dq, dkv = grads(dq, kv, dkv, ring.size - 1)
  dk, dv = (tuple(_send(ring, *h)) for h in dkv)  # home: the blocks held now are device r + 1's
  whole = lambda hs, like: jnp.concatenate([h[:, :c] for h in hs], axis=1).astype(like.dtype)  # noqa: E731
  return whole(dq, q), whole(dk, k), whole(dv, v), None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
