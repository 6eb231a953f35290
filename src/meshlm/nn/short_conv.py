"""A short causal depthwise conv1d (Gated DeltaNet's conv over q|k|v), reset at document boundaries.

Letters (docs/architecture.md): Q taps, C channels. The kernel w [Q, C] has its last tap on the current position:

  y[t, c] = sum_{j < Q} w[j, c] * x[t - (Q - 1) + j, c]

A tap that reads before the row's start (or, with a history, before the history) reads zero, and with
segment ids a tap reads zero wherever its position lies in another segment than t: a packed document never
reads another's tokens, and a left-padded row's first real token never reads its padding (segment id 0).
This is Hugging Face's `Conv1d(groups=C, padding=Q - 1)[..., :T]` with weight[c, 0, j] = w[j, c], no bias.

`history` [B, Q - 1, C] (a decode step's window: the previous Q - 1 inputs) enters before position 0.
`window_at` gathers the Q - 1 inputs ending at each row's last real token: the next decode step's window.
Plain math with no sharding annotations of its own; `causal_conv_reference` is the loop it is tested against.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x_BTC: jax.Array, w_QC: jax.Array, *, segment_ids_BT: jax.Array | None = None,
                history: jax.Array | None = None) -> jax.Array:
  """y [B, T, C] in x's dtype (accumulated in float32). history ([B, Q - 1, C]) and segment ids
  are not combined: a history belongs to the one document a decode row continues."""
  assert history is None or segment_ids_BT is None
  B, T, C = x_BTC.shape
  Q = w_QC.shape[0]
  f32 = jnp.float32
  xf = x_BTC.astype(f32)
  w = w_QC.astype(f32)
  S = Q - 1  # positions before t that the taps read
  if history is None:
    full = jnp.pad(xf, ((0, 0), (S, 0), (0, 0)))  # [B, Q - 1 + T, C]: position t sits at Q - 1 + t
  else:
    full = jnp.concatenate([history.astype(f32), xf], axis=1)
  y = xf * w[S]
  for d in range(1, Q):  # tap Q - 1 - d reads position t - d
    shifted = jax.lax.slice_in_dim(full, S - d, S - d + T, axis=1)  # [B, T, C]
    if segment_ids_BT is not None:
      prev = jnp.concatenate([jnp.full((B, d), -1, segment_ids_BT.dtype), segment_ids_BT[:, :T - d]], axis=1)
      same = (prev == segment_ids_BT)[..., None]  # [B, T, 1]; t - d < 0 never matches (-1)
      shifted = jnp.where(same, shifted, 0.0)
    y = y + shifted * w[S - d]
  return y.astype(x_BTC.dtype)


def window_at(x_BTC: jax.Array, lengths_B: jax.Array, size: int) -> jax.Array:
  """[B, size, C]: row b's inputs at positions lengths[b] - size .. lengths[b] - 1, zero before position 0
  (the window a decode step continues from after a right-padded prefill)."""
  B, T, C = x_BTC.shape
  pos = lengths_B[:, None] - size + jnp.arange(size)[None, :]  # [B, size]
  got = jnp.take_along_axis(x_BTC, jnp.clip(pos, 0, T - 1)[..., None], axis=1)  # [B, size, C]
  return jnp.where((pos >= 0)[..., None], got, jnp.zeros((), x_BTC.dtype))


def causal_conv_reference(x_BTC, w_QC, *, segment_ids_BT=None, history=None):
  """The definition, one output position and one tap at a time (numpy-speed; tests only)."""
  import numpy as np
  x = np.asarray(x_BTC, np.float64)
  w = np.asarray(w_QC, np.float64)
  B, T, C = x.shape
  Q = w.shape[0]
  seg = None if segment_ids_BT is None else np.asarray(segment_ids_BT)
  hist = None if history is None else np.asarray(history, np.float64)
  y = np.zeros((B, T, C))
  for b in range(B):
    for t in range(T):
      for j in range(Q):
        s = t - (Q - 1) + j
        if s >= 0:
          if seg is not None and seg[b, s] != seg[b, t]:
            continue
          y[b, t] += w[j] * x[b, s]
        elif hist is not None:
          y[b, t] += w[j] * hist[b, Q - 1 + s]
  return y


def causal_conv_context_parallel(x_BTC: jax.Array, w_QC: jax.Array, *, segment_ids_BT: jax.Array | None = None,
                                 axis: str = "context", halo: bool = True) -> jax.Array:
  """causal_conv with T sharded over mesh axis `axis` (C shards in order; without the axis, or at size 1, the
  plain conv). Each shard's first Q - 1 outputs read the previous shard's last Q - 1 inputs: a halo of
  [B, Q - 1, C] (and its segment ids) sent one shard forward by ppermute, then the plain conv over the
  shard with the halo in front (the halo's own outputs dropped). The first shard's halo is zeros with
  segment id -1, which no position matches, as before the row's start. A document spanning the edge reads
  across it; one that starts on the new shard does not. halo=False drops it (the tests' negative control).
  The batch and channel axes stay as they are (a shard_map manual over `axis` only)."""
  mesh = jax.sharding.get_abstract_mesh()
  n = 1 if mesh.empty else dict(mesh.shape).get(axis, 1)
  if n == 1:
    return causal_conv(x_BTC, w_QC, segment_ids_BT=segment_ids_BT)
  B, T, C = x_BTC.shape
  S = w_QC.shape[0] - 1
  if T % n or T // n < S:
    raise ValueError(f"causal_conv_context_parallel: T={T} over mesh.{axis}={n} gives shards shorter than the "
                     f"conv's {S}-position halo, or does not divide")
  perm = [(i, i + 1) for i in range(n - 1)]  # shard i's tail enters shard i + 1; shard 0 receives zeros

  def local(x, w, *seg):
    hx = jax.lax.ppermute(x[:, -S:], axis, perm)  # [B, Q - 1, C]
    if not halo:
      hx = jnp.zeros_like(hx)
    ext = jnp.concatenate([hx, x], axis=1)  # [B, Q - 1 + T / n, C]
    ids = None
    if seg:
      first = jax.lax.axis_index(axis) == 0
      hs = jnp.where(first, jnp.asarray(-1, seg[0].dtype), jax.lax.ppermute(seg[0][:, -S:], axis, perm))
      ids = jnp.concatenate([hs, seg[0]], axis=1)
    return causal_conv(ext, w, segment_ids_BT=ids)[:, S:]

  P = jax.sharding.PartitionSpec
  seq = P(None, axis)
  segs = () if segment_ids_BT is None else (segment_ids_BT,)
  mesh_types = set(mesh.axis_types)
  if mesh_types == {jax.sharding.AxisType.Explicit}:  # outside an auto-axes region: T onto `axis`, rows kept
    x_BTC, *segs = [jax.sharding.reshard(a, P(jax.typeof(a).sharding.spec[0], axis)) for a in (x_BTC, *segs)]
  with jax.named_scope("conv_context_parallel"):
    return jax.shard_map(local, in_specs=(seq, P()) + (seq,) * len(segs), out_specs=seq,
                         axis_names=frozenset({axis}))(x_BTC, w_QC, *segs)
