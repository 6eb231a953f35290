"""One layer's row of a stacked parameter, left in its stack.

An unrolled layer reads its parameters as rows of the stacks [L, ...]. Slicing a row out is a copy on
XLA:CPU: a slice cannot alias part of its operand's buffer. For a MoE layer's expert kernels that is the
layer's largest tensor, copied in the forward and read again in the backward (the stage profile in docs/performance-log.md:
21 thread-ms, about 12% of the thread time of issue 19's one-device mixtral step). A part that lists a parameter in
`MeshRules.stack_rows` gets it as a `StackRow` instead and reads what it needs straight from the stack: the
expert loop takes each expert's kernel at [index, e] (nn/moe/gmm.py). Its cotangent is the stack's, zero
outside the row: XLA makes it a pad, fused with the other layers' into one pass, as the slice's
transpose is.

`get()` is the plain row: code that does not read rows itself calls `materialize` first.
"""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackRow:
  """Row `index` (static) of `stack` [L, ...] along its leading axis."""
  stack: jax.Array
  index: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.stack.shape[1:])

  @property
  def dtype(self):
    return self.stack.dtype

  @property
  def ndim(self) -> int:
    return self.stack.ndim - 1

  def get(self) -> jax.Array:
    return jax.lax.index_in_dim(self.stack, self.index, axis=0, keepdims=False)

  def at(self, e: jax.Array) -> jax.Array:
    """Entry e of the row's leading axis (row[e]), read from the stack: [L * n, ...] indexed at
    index * n + e (the reshape is a bitcast)."""
    n = self.stack.shape[1]
    flat = self.stack.reshape((self.stack.shape[0] * n,) + self.stack.shape[2:])
    return jax.lax.dynamic_index_in_dim(flat, self.index * n + e, axis=0, keepdims=False)


def materialize(a):
  """a as a plain array (a StackRow's row sliced out); anything else unchanged."""
  return a.get() if isinstance(a, StackRow) else a


def is_row(a) -> bool:
  return isinstance(a, StackRow)


def array_of(a):
  """The array that holds a: a StackRow's whole stack, anything else itself (what shard_map is handed)."""
  return a.stack if isinstance(a, StackRow) else a
