"""Token embedding and the tied head (an einsum over the table, never a materialized table.T)."""
from __future__ import annotations

import jax

from meshlm.parallel.sharding import ACT, constrain, einsum, is_explicit, take_rows


def embed(table_VD: jax.Array, ids_BT: jax.Array, dtype, scatter: str = "auto") -> jax.Array:
  """[B, T] ids -> [B, T, D] rows of the table. scatter: the scatter_leading key (take_rows)."""
  with jax.named_scope("embed"):
    return take_rows(table_VD.astype(dtype), ids_BT, ACT, scatter)


def lookup_table(table_VD: jax.Array, dtype) -> jax.Array:
  """The table as `embed` reads it: cast to dtype and, under explicit sharding, whole (take_rows gathers a sharded
  table whole for the lookup). For a caller that looks up many times from the same table (the decode loop, once
  per token): computed once, the lookups then move no table."""
  table_VD = table_VD.astype(dtype)
  return constrain(table_VD, (None,) * table_VD.ndim) if is_explicit() else table_VD


def attend(table_VD: jax.Array, x: jax.Array) -> jax.Array:
  """Tied LM head: logits[..., v] = sum_d x[..., d] * table[v, d], as einsum dimension numbers.

  Works for any query rank >= 2 ([..., D]); the last output dim is the vocab.
  """
  with jax.named_scope("attend"):
    lead = "abcefg"[: x.ndim - 1]
    axes = ("batch",) + ("length",) * (x.ndim - 2) + ("vocab",)
    return einsum(f"{lead}d,vd->{lead}v", x, table_VD.astype(x.dtype), axes)
