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
