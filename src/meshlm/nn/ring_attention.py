"""Ring attention over mesh.context: the `context_attention=ring` core of training with the sequence sharded.

With T sharded over the C devices of mesh axis `context`, each device keeps its queries and passes its K/V (and
their segment ids) around the ring with `ppermute`, C - 1 hops; every incoming block is merged into the running
online softmax of the flash kernel (nn/flash_attention.py: merge_keys, its masks and tiles), so causal, sliding
window, packed segments, the soft-cap, GQA groups and MLA's unequal head dims work as there. No device ever holds
more than two of the C shards of K/V (the one it merges and the one in flight), never the whole sequence's. The backward is FlashAttention-2's, as a custom
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
from jax.ad_checkpoint import checkpoint_name

from meshlm.nn import flash_attention as FA
from meshlm.parallel.sharding import logical_spec

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Ring:
  flash: FA._Static  # its length: the real chunk length c (the chunks are padded to a multiple of the block)
  axis: str
  size: int  # C, the devices on the ring
  vary: tuple[str, ...] = ()  # the mesh axes q, K and V are split over (rows, `axis`, kv heads)


def chunk_ids(r, C: int):
  """The two chunks (of 2C) that device r of the ring works on: r and 2C - 1 - r (zigzag)."""
  return r, 2 * C - 1 - r


def ring_perm(C: int) -> list[tuple[int, int]]:
  """Where each device sends the K/V it holds at a ring step: to the next device."""
  return [(i, (i + 1) % C) for i in range(C)]


def ring_attention(q_BNTH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, segment_ids_BT: jax.Array | None = None,
                   *, scale: float, softcap: float | None = None, window: int | None = None, axis: str = "context",
                   block: int = FA.BLOCK) -> jax.Array:
  """flash_attention's contract (heads-first rows: q [B, N, T, H], k/v [B, K, T, H] in, [B, N, T, Hv] back) with
  T sharded over mesh axis `axis` (the current mesh's;
  without it, or at size 1, flash_attention itself). T must divide by 2C. A shard_map manual over every mesh axis:
  the rows split as the batch's logical axis says, the kv heads over what shards them when it divides them (a
  shard_map left partly auto marks every op inside with an open sharding constraint, which the census counts as
  blocking each transpose-of-dot)."""
  mesh = jax.sharding.get_abstract_mesh()
  C = 1 if mesh.empty else dict(mesh.shape).get(axis, 1)
  kw = dict(scale=scale, softcap=softcap, window=window, block=block)
  if C == 1:
    return FA.flash_attention(q_BNTH, k_BKSH, v_BKSH, segment_ids_BT, **kw)
  B, N, T, H = q_BNTH.shape
  K = k_BKSH.shape[1]
  if T % (2 * C):
    raise ValueError(f"ring_attention: T={T} does not divide into 2 x mesh.{axis}={C} chunks")
  c = T // (2 * C)
  b = min(block, c)
  segs = () if segment_ids_BT is None else (segment_ids_BT.astype(jnp.int32),)
  q = jnp.reshape(q_BNTH, (B, K, N // K, T, H))

  def local(q, k, v, *seg):
    q, k, v, *seg = (_to_zigzag(x, C, axis) for x in (q, k, v, *seg))
    out = _ring_attention(ring, q, k, v, seg[0] if seg else None)
    return _from_zigzag(out, C, axis)

  P = jax.sharding.PartitionSpec
  rows = logical_spec(("batch",), (B,))[0]
  heads = logical_spec(("kv_heads",), (K,))[0]
  specs = (P(rows, heads, None, axis), P(rows, heads, axis), P(rows, heads, axis), P(rows, axis))[:3 + len(segs)]
  names = lambda s: () if s is None else (s,) if isinstance(s, str) else tuple(s)  # noqa: E731
  st = FA._Static(float(scale), softcap, window, b, c, bool(segs))
  ring = _Ring(st, axis, C, names(rows) + (axis,) + names(heads))
  args = (q, k_BKSH, v_BKSH, *segs)
  if set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}:  # outside an auto-axes region (the mixers' is one)
    args = tuple(jax.sharding.reshard(x, s) for x, s in zip(args, specs))
  with jax.named_scope("ring_attention"):
    out = jax.shard_map(local, in_specs=specs, out_specs=specs[0])(*args)  # [B, K, G, T, Hv]
  return jnp.reshape(out, (B, N, T, out.shape[-1]))


# ----------------------------------------------------------------------------------------------- the layout


def _time(x) -> int:
  """The sequence axis of a heads-first row array (q [B, K, G, T, H], k/v [B, K, T, H]: the one before the head
  dim) or of segment ids [B, T]."""
  return x.ndim - 2 if x.ndim > 2 else 1


def _take(x, start: int, size: int):
  """x's rows [start, start + size) along its sequence axis (_time)."""
  return lax.slice_in_dim(x, start, start + size, axis=_time(x))


def _where_chunk(x: int, C: int) -> tuple[int, int]:
  """(device, slot) of chunk x of 2C in the zigzag layout."""
  return (x, 0) if x < C else (2 * C - 1 - x, 1)


def _to_zigzag(x, C: int, axis: str):
  """A device's contiguous rows (2c along the sequence axis, _time: chunks 2r, 2r + 1) -> its zigzag rows (chunks
  r, 2C - 1 - r): the even chunks and the odd ones each form one permutation of the devices (chunk r and
  2C - 1 - r: one even, one odd), so two ppermutes of half the rows do it."""
  t = _time(x)
  c = x.shape[t] // 2
  even = lax.ppermute(_take(x, 0, c), axis, [(r, _where_chunk(2 * r, C)[0]) for r in range(C)])
  odd = lax.ppermute(_take(x, c, c), axis, [(r, _where_chunk(2 * r + 1, C)[0]) for r in range(C)])
  first_even = lax.axis_index(axis) % 2 == 0  # chunk r is even: it came with the even ones
  return jnp.where(first_even, jnp.concatenate([even, odd], t), jnp.concatenate([odd, even], t))


def _from_zigzag(y, C: int, axis: str):
  """_to_zigzag's inverse: each chunk back to its contiguous device and slot."""
  t = _time(y)
  c = y.shape[t] // 2
  first_even = lax.axis_index(axis) % 2 == 0
  even = jnp.where(first_even, _take(y, 0, c), _take(y, c, c))
  odd = jnp.where(first_even, _take(y, c, c), _take(y, 0, c))
  even = lax.ppermute(even, axis, [(_where_chunk(2 * r, C)[0], r) for r in range(C)])
  odd = lax.ppermute(odd, axis, [(_where_chunk(2 * r + 1, C)[0], r) for r in range(C)])
  return jnp.concatenate([even, odd], t)


# ------------------------------------------------------------------------------------------------ the ring


def _halves(x, cp: int):
  """Rows 2c long (along _time) -> its two chunks, each padded to cp rows, stacked on a new leading axis:
  [2, ...] (None stays None)."""
  if x is None:
    return None
  t = _time(x)
  c = x.shape[t] // 2
  pad = tuple((0, cp - c if a == t else 0) for a in range(x.ndim))
  return jnp.stack([jnp.pad(h, pad) if cp > c else h for h in (_take(x, 0, c), _take(x, c, c))])


def _rows(x_2B, c: int):
  """_halves' inverse: [2, ...cp...] -> the rows 2c long."""
  return jnp.concatenate([_take(x_2B[0], 0, c), _take(x_2B[1], 0, c)], axis=_time(x_2B[0]))


def _deltas(ring: _Ring, step):
  """[2, 2] int: (query half a, key half e) -> first query position - first key position at ring step `step` (the
  keys then come from device r - step)."""
  C, c = ring.size, ring.flash.length
  r = lax.axis_index(ring.axis)
  mine, theirs = chunk_ids(r, C), chunk_ids((r - step) % C, C)
  return jnp.stack([jnp.stack([(mine[a] - theirs[e]) * c for e in (0, 1)]) for a in (0, 1)])


def _varying(ring: _Ring, x):
  """x (built from constants) varying over the shard_map axes q, K and V vary over, as loop carries must be."""
  return lax.pcast(x, ring.vary, to="varying")


def _send(ring: _Ring, tree):
  """tree's arrays to the next device on the ring (ring_perm)."""
  return jax.tree.map(lambda x: lax.ppermute(x, ring.axis, ring_perm(ring.size)), tree)


def _blocks(ring: _Ring, cp: int) -> tuple[int, int]:
  """(block, blocks per chunk)."""
  return ring.flash.block, cp // ring.flash.block


def _pad_len(ring: _Ring) -> int:
  b, c = ring.flash.block, ring.flash.length
  return -(-c // b) * b


def _forward(ring: _Ring, q, k, v, seg):
  """(out [B, K, G, 2c, Hv], lse [2, B, K, G, cp]) of this device's zigzag rows (two chunks, padded to cp)."""
  st, cp = ring.flash, _pad_len(ring)
  b, n = _blocks(ring, cp)
  qs, sq = _halves(q, cp), _halves(seg, cp)
  _, B, K, G, _, _ = qs.shape
  # [2, n, B, K, G, bq(, Hv)]: each query half's blocks' running softmax, varying over the ring as what merges in.
  state = tuple(_varying(ring, jnp.broadcast_to(x, (2, n) + x.shape)) for x in FA.empty_rows(B, K, G, b, v.shape[-1]))

  def merge(state, kv, step):
    """Every (query half, key half) pair of this step merged into the running softmax (one loop, one trace)."""
    ks, vs, sk = kv
    deltas = _deltas(ring, step)

    def pair(p, state):
      a, e = p // 2, p % 2
      d = deltas[a, e]

      def query_block(args):
        i, carry = args
        q_i = lax.dynamic_slice_in_dim(qs[a], i * b, b, axis=3)  # [B, K, G, bq, H]
        return FA.merge_keys(st, q_i, i, ks[e], vs[e], None if sq is None else sq[a], carry,
                             FA._key_blocks(st, i, d, n), None if sk is None else sk[e], d)
      new = lax.map(query_block, (jnp.arange(n), tuple(x[a] for x in state)))
      return tuple(x.at[a].set(y) for x, y in zip(state, new))
    return lax.fori_loop(0, 4, pair, state)

  def hop(carry, step):
    state, kv = carry
    nxt = _send(ring, kv)  # in flight while this step's blocks merge
    return (merge(state, kv, step), nxt), None

  kv = (_halves(k, cp), _halves(v, cp), _halves(seg, cp))
  (state, kv), _ = lax.scan(hop, (state, kv), jnp.arange(ring.size - 1))
  state = merge(state, kv, ring.size - 1)
  out, lse = jax.vmap(lambda *s: FA.blocks_to_rows(*FA.finish_rows(*s, v.dtype)))(*state)  # [2, B, K, G, cp, Hv]
  return _rows(out, st.length), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, seg):
  return _forward(ring, q, k, v, seg)[0]


def _ring_fwd(ring: _Ring, q, k, v, seg):
  out, lse = (checkpoint_name(x, FA.RESIDUALS) for x in _forward(ring, q, k, v, seg))
  return out, (q, k, v, seg, out, lse)


def _ring_bwd(ring: _Ring, res, d_out):
  """K/V go around the ring again, their float32 gradients beside them; per step, each key half's blocks against
  the query blocks of each query half that see them (flash's key_block_grads); a last hop brings dk, dv home."""
  q, k, v, seg, out, lse = res
  st, cp = ring.flash, _pad_len(ring)
  b, n = _blocks(ring, cp)
  qs, dos, sq = _halves(q, cp), _halves(d_out, cp), _halves(seg, cp)
  d_rows = jax.vmap(FA.row_term)(dos, _halves(out, cp))  # [2, B, K, G, cp]
  zeros = lambda x: _varying(ring, jnp.zeros(x.shape, _F32))  # noqa: E731
  kv = (_halves(k, cp), _halves(v, cp), _halves(seg, cp))
  dq, dkv = zeros(qs), (zeros(kv[0]), zeros(kv[1]))

  def grads(dq, kv, dkv, step):
    ks, vs, sk = kv
    deltas = _deltas(ring, step)

    def pair(p, carry):
      dq, dk, dv = carry
      e, a = p // 2, p % 2
      d = deltas[a, e]

      def key_block(dq_a, j):
        k_j, v_j, dk_j, dv_j = (lax.dynamic_slice_in_dim(x[e], j * b, b, axis=2) for x in (ks, vs, dk, dv))
        dq_a, dk_j, dv_j = FA.key_block_grads(st, j, k_j, v_j, qs[a], dos[a], lse[a], d_rows[a],
                                              None if sq is None else sq[a], (dq_a, dk_j, dv_j),
                                              FA._query_blocks(st, j, n, d), None if sk is None else sk[e], d)
        return dq_a, (dk_j, dv_j)
      dq_a, (dk_e, dv_e) = lax.scan(key_block, dq[a], jnp.arange(n))  # [n, B, K, bk, H]
      whole = lambda x: jnp.reshape(jnp.moveaxis(x, 0, 2), x.shape[1:3] + (cp,) + x.shape[4:])  # noqa: E731
      return dq.at[a].set(dq_a), dk.at[e].set(whole(dk_e)), dv.at[e].set(whole(dv_e))
    dq, dk, dv = lax.fori_loop(0, 4, pair, (dq,) + dkv)
    return dq, (dk, dv)

  def hop(carry, step):
    dq, kv, dkv = carry
    dq, dkv = grads(dq, kv, dkv, step)
    return (dq,) + _send(ring, (kv, dkv)), None

  (dq, kv, dkv), _ = lax.scan(hop, (dq, kv, dkv), jnp.arange(ring.size - 1))
  dq, dkv = grads(dq, kv, dkv, ring.size - 1)
  dk, dv = _send(ring, dkv)  # home: the blocks held now are device r + 1's
  c = st.length
  return _rows(dq, c).astype(q.dtype), _rows(dk, c).astype(k.dtype), _rows(dv, c).astype(v.dtype), None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
