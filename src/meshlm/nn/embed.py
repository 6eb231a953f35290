"""Token embedding and the tied head (an einsum over the table, never a materialized table.T)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import constrain, is_explicit, out_sharding

ACT = ("batch", "length", "act_embed")


def embed(table_VD: jax.Array, ids_BT: jax.Array, dtype) -> jax.Array:
  """[B, T] ids -> [B, T, D] rows of the table."""
  with jax.named_scope("embed"):
    table = table_VD.astype(dtype)
    if is_explicit():
      # Explicit refuses an ambiguous gather: gather from a whole table into batch-sharded rows.
      table = constrain(table, (None, None))
      return table.at[ids_BT].get(out_sharding=out_sharding(ACT, ids_BT.shape + table.shape[-1:]))
    return constrain(jnp.take(table, ids_BT, axis=0), ACT)


def attend(table_VD: jax.Array, x: jax.Array) -> jax.Array:
  """Tied LM head: logits[..., v] = sum_d x[..., d] * table[v, d], as einsum dimension numbers.

  Works for any query rank >= 2 ([..., D]); the last output dim is the vocab.
  """
  with jax.named_scope("attend"):
    lead = "abcefg"[: x.ndim - 1]
    axes = ("batch",) + ("length",) * (x.ndim - 2) + ("vocab",)
    eqn = f"{lead}d,vd->{lead}v"
    shape = x.shape[:-1] + table_VD.shape[:1]
    if is_explicit():
      return jnp.einsum(eqn, x, table_VD.astype(x.dtype), out_sharding=out_sharding(axes, shape))
    return constrain(jnp.einsum(eqn, x, table_VD.astype(x.dtype)), axes)
