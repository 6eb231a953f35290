"""Token embedding and the tied head (an einsum over the table, never a materialized table.T)."""
from __future__ import annotations

import jax

from meshlm.parallel.sharding import ACT, einsum, take_rows


def embed(table_VD: jax.Array, ids_BT: jax.Array, dtype) -> jax.Array:
  """[B, T] ids -> [B, T, D] rows of the table."""
  with jax.named_scope("embed"):
    return take_rows(table_VD.astype(dtype), ids_BT, ACT)


def attend(table_VD: jax.Array, x: jax.Array) -> jax.Array:
  """Tied LM head: logits[..., v] = sum_d x[..., d] * table[v, d], as einsum dimension numbers.

  Works for any query rank >= 2 ([..., D]); the last output dim is the vocab.
  """
  with jax.named_scope("attend"):
    lead = "abcefg"[: x.ndim - 1]
    axes = ("batch",) + ("length",) * (x.ndim - 2) + ("vocab",)
    return einsum(f"{lead}d,vd->{lead}v", x, table_VD.astype(x.dtype), axes)
