"""Expert parallelism: the dispatch with the kernels' experts dim sharded over ep devices.

The kernels stay sharded on their experts dim (on mesh.expert, mesh.fsdp or both: `ep_mesh_axes`), each
device holding E / ep experts. The tokens of the ep devices of an expert group are all-gathered over those
axes; each device sorts the group's (token, slot) pairs with its local experts first (ids outside its range
sort last and get no grouped-matmul rows: `dispatch(expert_offset=)`), computes its experts' part of every
token's weighted sum, and a reduce-scatter over the same axes returns each device its own tokens' sums.
The kernels' gradients stay local to their experts. (Over an axis the batch does not split on, the tokens
are already shared by the group: no gather, and a psum adds the parts.) All-gather in and reduce-scatter
out was chosen over all-to-all: dropless routing has no static per-peer row count, so an all-to-all would
need worst-case buffers of the same size, plus a second sort.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.nn.moe.gmm import default_block_rows
from meshlm.parallel.sharding import RULES


def expert_axis(rules: dict[str, tuple[str, ...]]) -> str:
  """The one mesh axis that shards the "experts" logical axis (parallel/sharding.RULES)."""
  (axis,) = rules["experts"]
  return axis


EXPERT_AXIS = expert_axis(RULES)


def _axes_of(spec) -> set[str]:
  """The mesh axes a PartitionSpec (or a slice of one) names."""
  out = set()
  for part in spec:
    out.update((part,) if isinstance(part, str) else (part or ()))
  return out


def ep_mesh_axes(kspec) -> tuple[str, ...]:
  """The mesh axes that shard a kernel's experts dim, in the PartitionSpec's order (major first): kspec
  is the experts dim's one-entry PartitionSpec. () when the experts dim is whole."""
  part = kspec[0] if len(kspec) else None
  return (part,) if isinstance(part, str) else tuple(part or ())


def local_expert_offset(num_local: int, axes: tuple[str, ...] = (EXPERT_AXIS,)) -> jax.Array:
  """The first expert this shard holds: experts are split over the mesh axes `axes` in order, the first
  axis major (axis_index of a tuple is that linear index, the same order as PartitionSpec((axes)))."""
  return jax.lax.axis_index(axes).astype(jnp.int32) * num_local


def _dispatch_ep(fn, x_BTD, ids_BTk, w_BTk, gate, up, down, *, ep_axes: tuple[str, ...],
                 gathered: tuple[str, ...], block_rows, num_experts: int):
  """Inside shard_map: this device's E_l = E / ep experts on all tokens of its expert group.

  ep_axes: the mesh axes that shard the experts dim (expert, fsdp or both, major first). gathered: those of
  them that also shard the batch: all-gather the group's tokens over them in [|gathered| * B, T, D],
  compute the local experts' part of every token's sum over k, reduce-scatter the parts back over them, so
  each device gets its own tokens' full sums. Over the other ep axes the tokens are already the group's,
  and a psum adds the parts. The kernels are never gathered over ep_axes; their gradient stays local.
  """
  E_l = down.shape[0]
  ep = num_experts // E_l
  shared = tuple(a for a in ep_axes if a not in gathered)
  if gathered:
    x_BTD, ids_BTk, w_BTk = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x_BTD, ids_BTk, w_BTk))
  if shared:
    # Mark the shared tokens as varying over those axes, so their cotangent is summed over them
    # (left invariant, x's gradient through the gather by the varying perm misses the other shards').
    x_BTD, w_BTk = (jax.lax.pcast(a, shared, to="varying") for a in (x_BTD, w_BTk))
  B, T, k = ids_BTk.shape
  # About 1 / ep of the group's slots are local: size the blocks from that, not from all slots.
  b = block_rows or default_block_rows(B * T * k // ep, E_l)
  y = fn(x_BTD, ids_BTk, w_BTk, gate, up, down, block_rows=b, expert_offset=local_expert_offset(E_l, ep_axes))
  if shared:
    y = jax.lax.psum(y, shared)
  if gathered:
    y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
  return y
