"""Expert parallelism: the dispatch with the kernels' experts dim sharded over ep devices (ep_impl "gather" or
"compact").

The kernels stay sharded on their experts dim (on mesh.expert, mesh.fsdp or both: `ep_mesh_axes`), each
device holding E / ep experts. The tokens of the ep devices of an expert group are all-gathered over those
axes; each device sorts the group's (token, slot) pairs with its local experts first (ids outside its range
sort last and get no grouped-matmul rows: `dispatch(expert_offset=)`), computes its experts' part of every
token's weighted sum, and a reduce-scatter over the same axes returns each device its own tokens' sums.
The kernels' gradients stay local to their experts. (Over an axis the batch does not split on, the tokens
are already shared by the group: no gather, and a psum adds the parts.) All-gather in and reduce-scatter
out is ep_impl="gather" (the default, `dispatch_gather`): dropless routing has no static per-peer row count, so an all-to-all
needs worst-case buffers of the same size, plus a second sort.

ep_impl="compact" (`dispatch_compact`) moves only the routed rows: each device sorts its own tokens' (token,
slot) pairs by expert id (so by destination device, id // E_l), sends each peer of the group at most C rows with
`jax.lax.all_to_all` (C = capacity(): ceil(factor x its slots / ep); rows past it are dropped and counted; factor
None is the worst case, nothing drops), the peer runs its experts over the received rows (dropless.py's sort,
expert_rows and unsort_rows), the reverse all_to_all returns them and the sender combines. Over ep axes the batch
is not split on, the group's copies of the tokens are split between them first and the outputs all-gathered.
(`jax.lax.ragged_all_to_all` would send exactly the routed rows, but XLA:CPU does not implement it, and on TPU it
needs more memory at the same receive rows: docs/moe.md, benchmarks/ep_collectives.py.)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshlm.nn.moe import dropless
from meshlm.nn.moe.gmm import default_block_rows, default_grouped_matmul, grouped_matmul, vary_like
from meshlm.parallel.sharding import RULES


def expert_axis(rules: dict[str, tuple[str, ...]]) -> str:
  """The one mesh axis that shards the "experts" logical axis (parallel/sharding.RULES)."""
  (axis,) = rules["experts"]
  return axis


EXPERT_AXIS = expert_axis(RULES)


def ep_mesh_axes(kspec) -> tuple[str, ...]:
  """The mesh axes that shard a kernel's experts dim, in the PartitionSpec's order (major first): kspec
  is the experts dim's one-entry PartitionSpec. () when the experts dim is whole."""
  part = kspec[0] if len(kspec) else None
  return (part,) if isinstance(part, str) else tuple(part or ())


def local_expert_offset(num_local: int, axes: tuple[str, ...] = (EXPERT_AXIS,)) -> jax.Array:
  """The first expert this shard holds: experts are split over the mesh axes `axes` in order, the first
  axis major (axis_index of a tuple is that linear index, the same order as PartitionSpec((axes)))."""
  return jax.lax.axis_index(axes).astype(jnp.int32) * num_local


def dispatch_gather(x_BTD, ids_BTk, w_BTk, gate, up, down, *, knobs, opts, ep_axes: tuple[str, ...],
                    gathered: tuple[str, ...]):
  """Inside shard_map: (y [B, T, D], dropped: an int32 0, dispatch_compact's type) with this device's E_l = E / ep
  experts on all tokens of its expert group (ep_impl="gather").

  ep_axes: the mesh axes that shard the experts dim (expert, fsdp or both, major first). gathered: those of
  them that also shard the batch: all-gather the group's tokens over them in [|gathered| * B, T, D],
  compute the local experts' part of every token's sum over k, reduce-scatter the parts back over them, so
  each device gets its own tokens' full sums. Over the other ep axes the tokens are already the group's,
  and a psum adds the parts. The kernels are never gathered over ep_axes; their gradient stays local.
  knobs, opts: dropless.dispatch's (dispatch_compact takes the same).
  """
  E_l = down.shape[0]
  ep = knobs.num_experts // E_l
  shared = tuple(a for a in ep_axes if a not in gathered)
  if gathered:
    x_BTD, ids_BTk, w_BTk = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x_BTD, ids_BTk, w_BTk))
  if shared:
    # Mark the shared tokens as varying over those axes, so their cotangent is summed over them
    # (left invariant, x's gradient through the gather by the varying perm misses the other shards').
    x_BTD, w_BTk = (jax.lax.pcast(a, shared, to="varying") for a in (x_BTD, w_BTk))
  B, T, k = ids_BTk.shape
  D = x_BTD.shape[-1]
  # About 1 / ep of the group's slots are local: size the blocks from that, not from all slots.
  opts = dataclasses.replace(opts, block_rows=opts.block_rows or default_block_rows(B * T * k // ep, E_l))
  y, dropped = dropless.dispatch(x_BTD.reshape(B * T, D), ids_BTk.reshape(B * T, k), w_BTk.reshape(B * T, k), gate,
                                 up, down, knobs, opts, expert_offset=local_expert_offset(E_l, ep_axes))
  y = y.reshape(B, T, D)
  if shared:
    y = jax.lax.psum(y, shared)
  if gathered:
    y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
  return y, dropped


# --- compact: only the routed rows move, in a buffer of bounded size per peer --------------------------------

EP_IMPLS = ("gather", "compact")


def capacity(slots: int, ep: int, factor: float | None) -> int:
  """Rows a device sends each peer: ceil(factor x slots / ep), at most slots (every slot to one peer, the worst
  case); factor None: slots (nothing can drop)."""
  if factor is None:
    return slots
  return max(1, min(slots, math.ceil(factor * slots / ep)))


def send_layout(ids_A: jax.Array, E_l: int, ep: int, C: int):
  """Where each of a sender's routed slots goes: (perm [A], slot [A], src [ep * C], valid [ep * C], dropped).

  The slots sorted by expert id (stable) are sorted by destination d = id // E_l too (an id of E, the padding's,
  goes nowhere). Slot a takes buffer row d * C + its rank among d's slots when the rank is below C, else
  slot[a] = ep * C (dropped, or padding). Buffer row (d, c) holds the sorted slot src = start_d + c when valid
  (c < d's count). dropped: the slots past C (an int32 count)."""
  A = ids_A.shape[0]
  with jax.named_scope("sort"):
    perm = jax.ad_checkpoint.checkpoint_name(jnp.argsort(ids_A, stable=True).astype(jnp.int32), "moe_perm")
    dest = ids_A // E_l  # [A]
    count = jnp.zeros((ep,), jnp.int32).at[dest].add(1, mode="drop")  # [ep]
    start = jnp.cumsum(count) - count  # [ep]
    rank = dropless.inverse_permutation(perm) - start[jnp.minimum(dest, ep - 1)]  # [A]
    routed = dest < ep
    keep = routed & (rank < C)
    slot = jnp.where(keep, dest * C + rank, ep * C)  # [A]
    d, c = jnp.divmod(jnp.arange(ep * C, dtype=jnp.int32), C)  # [ep * C]
    valid = c < count[d]
    src = jnp.minimum(start[d] + c, A - 1)
    dropped = jnp.sum(routed & ~keep, dtype=jnp.int32)
  return perm, slot, src, valid, dropped


def _split_shared(a, shared: tuple[str, ...], parts: int, fill):
  """This device's 1 / parts of a's rows [M, ...] (the rows equal over the `shared` axes), padded with fill."""
  M = a.shape[0]
  n = -(-M // parts)
  a = jax.lax.pcast(a, shared, to="varying")
  a = jnp.concatenate([a, jnp.full((n * parts - M,) + a.shape[1:], fill, a.dtype)]) if n * parts > M else a
  return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(shared) * n, n)


def dispatch_compact(x_BTD, ids_BTk, w_BTk, gate, up, down, *, knobs, opts, ep_axes: tuple[str, ...],
                     gathered: tuple[str, ...], split_axes: tuple[str, ...] = ()):
  """Inside shard_map: (y [B, T, D], dropped) with only the rows routed to each device's experts moved
  (ep_impl="compact"; the arguments are dispatch_gather's; knobs.ep_buffer_factor sizes the buffers).

  ep_axes: the mesh axes that shard the experts dim (major first); gathered: those of them that also shard the
  batch. Over the others (shared) the devices hold the same tokens: each takes 1 / |shared| of them here and the
  outputs are all-gathered.
  The sender's slots go out in an [ep, C, D] buffer (C = capacity(slots, ep, buffer_factor)) with their local
  expert ids ([ep, C], E_l where empty); the receiver sorts the ep x C rows by local expert, runs expert_rows,
  unsorts; the reverse all_to_all brings them back to their slots, and the sender combines them with its weights.
  dropped: the slots past C of this device's tokens (summed over shared), an int32 scalar.
  split_axes: the kernels come with their embed dim split over these mesh axes (gate/up [E_l, D / n, F], down
  [E_l, F, D / n]) and stay so: the received rows are run by expert_rows_split instead of gathering the kernels.
  """
  B, T, D = x_BTD.shape
  k = ids_BTk.shape[-1]
  E_l = down.shape[0]
  num_experts = knobs.num_experts
  ep = num_experts // E_l
  shared = tuple(a for a in ep_axes if a not in gathered)
  x_MD, ids_Mk, w_Mk = x_BTD.reshape(B * T, D), ids_BTk.reshape(B * T, k), w_BTk.reshape(B * T, k)
  if shared:
    parts = math.prod(jax.lax.axis_size(a) for a in shared)
    # Padding rows route to expert id E (no device) with zero weights.
    x_MD, ids_Mk, w_Mk = (_split_shared(a, shared, parts, f) for a, f in ((x_MD, 0), (ids_Mk, num_experts),
                                                                          (w_Mk, 0)))
  M = x_MD.shape[0]
  C = capacity(M * k, ep, knobs.ep_buffer_factor)
  ids_A = ids_Mk.reshape(-1)
  perm, slot, src, valid, dropped = send_layout(ids_A, E_l, ep, C)
  with jax.named_scope("gather"):
    a = perm[src]  # [ep * C]: the slot each buffer row carries
    x_send = jnp.where(valid[:, None], x_MD[a // k], jnp.zeros((), x_MD.dtype))  # [ep * C, D]
    d = jnp.arange(ep * C, dtype=jnp.int32) // C
    lid_send = jnp.where(valid, ids_A[a] - d * E_l, E_l)  # [ep * C] local expert ids at the destination
  with jax.named_scope("all_to_all"):
    x_recv, lid_recv = (jax.lax.all_to_all(v.reshape(ep, C, *v.shape[1:]), ep_axes, 0, 0, tiled=True)
                        .reshape(ep * C, *v.shape[1:]) for v in (x_send, lid_send))
  # About M * k rows are real when the routing is balanced: size the blocks from that, not from the buffer.
  opts = dataclasses.replace(opts, block_rows=opts.block_rows or default_block_rows(M * k, E_l))
  if split_axes:
    y_recv = expert_rows_split(x_recv, lid_recv, gate, up, down, knobs, opts, split_axes)  # [ep * C, D]
  else:
    # The receiver: its experts over the rows it was sent (those of id E_l, empty buffer rows, get none).
    perm_r, sizes, local = dropless.sort_slots(lid_recv, E_l, jnp.int32(0))
    with jax.named_scope("gather"):
      xs = x_recv[perm_r]  # [ep * C, D]
    ys = dropless.expert_rows(xs, sizes, gate, up, down, knobs, opts, rest=True)  # the empty buffer rows
    y_recv = dropless.unsort_rows(ys, perm_r, opts.unsort_impl, local)  # [ep * C, D]
  with jax.named_scope("all_to_all"):
    y_back = jax.lax.all_to_all(y_recv.reshape(ep, C, D), ep_axes, 0, 0, tiled=True).reshape(ep * C, D)
  with jax.named_scope("unsort"):
    y_flat = jnp.take(y_back, slot, axis=0, mode="fill", fill_value=0)  # [A, D]; dropped slots give zeros
  y_MD = dropless.combine(y_flat, w_Mk)
  if shared:
    y_MD = jax.lax.all_gather(y_MD, shared, axis=0, tiled=True, to="invarying")[:B * T]
    dropped = jax.lax.psum(dropped, shared)
  return y_MD.reshape(B, T, D), dropped


# --- the kernels left split on their embed dim (kernel_fsdp=embed): the rows move, not the kernels ---------------

def split_pays(rows: int, parts: int, local_experts: int, D: int, F: int) -> bool:
  """Whether expert_rows_split moves fewer elements per device than gathering the kernels: it exchanges the rows'
  embed slices in and out (2 rows D) and sums the partial gate|up products of every device's rows (~2 parts rows 2F,
  a reduce and a broadcast), where the gather moves the three kernels, 3 E_l D F (parts - 1) / parts. rows: the
  routed rows one device runs (the compact receive buffer, ep x C); parts: the devices the embed dim is split over.
  A decode step's few rows pay (the 397B rollout: 64 rows, 16 parts: 4.7e6 elements against 3.8e8); a training
  step's many do not (112,640 rows: 8.3e9)."""
  if parts <= 1:
    return False
  return 2 * rows * D + 4 * parts * rows * F < 3 * local_experts * D * F * (parts - 1) // parts


def expert_rows_split(x_AD: jax.Array, lid_A: jax.Array, gate, up, down, knobs, opts,
                      axes: tuple[str, ...]) -> jax.Array:
  """Inside shard_map: ys [A, D], each row x[j] through its local expert lid[j] (E_l: none, a zero row), with the
  kernels split on their embed dim over the mesh axes `axes` (n devices, this one holding slice i of n: gate/up
  [E_l, D / n, F], down [E_l, F, D / n], as stored under kernel_fsdp=embed), which never move:

    every device's rows, this device's embed slice of them   all_to_all over axes     [n A, D / n]
    one sort of the n A rows by local expert                  (their ids all-gathered)
    h = sum over the n devices of x_i gate|up_i               float32 partial products, psum over axes  [n A, 2F]
    y_i = act(h_gate) h_up down_i                             every row's slice i of its output  [n A, D / n]
    each row's slices back to its device                      all_to_all                [A, D]

  What moves per device is 2 A D row elements and the [n A, 2F] sums, where gathering the kernels moves
  3 E_l D F (split_pays). The gate|up sums are float32 (ragged_dot's preferred_element_type, or float32 operands
  elsewhere) rounded once to the rows' dtype: the whole-kernel products up to the order of their float32 sums; down
  contracts F whole on each device, as before. Forward only (decode)."""
  A, D = x_AD.shape
  E_l, Dn = gate.shape[0], gate.shape[1]
  n = D // Dn
  dt = x_AD.dtype
  with jax.named_scope("split_rows"):
    # [A, D] -> [n, A, D / n]: slice j to device j; back, row block i holds device i's rows (this device's slice).
    x_all = jax.lax.all_to_all(x_AD.reshape(A, n, Dn).swapaxes(0, 1), axes, 0, 0, tiled=True).reshape(n * A, Dn)
    lid_all = jax.lax.all_gather(lid_A, axes, axis=0, tiled=True)  # [n A]
  perm, sizes, local = dropless.sort_slots(lid_all, E_l, jnp.int32(0))
  with jax.named_scope("gather"):
    xs = x_all[perm]  # [n A, D / n]
  cast = lambda w: opts.cast_to(w, dt)  # noqa: E731
  with jax.named_scope("experts"):
    with jax.named_scope("gate_up"):
      h = _partial_gmm(xs, (cast(gate), cast(up)), sizes, knobs)  # [n A, 2F] float32
      h = jax.lax.psum(h, axes).astype(dt)
    a = dropless.fused_glu(opts.activation, h)  # [n A, F]
    with jax.named_scope("down"):
      ys = grouped_matmul(vary_like(a, xs), cast(down), sizes, impl=knobs.grouped_matmul,
                          block_rows=opts.block_rows, tiling=knobs.megablox_tiling, rest=True)  # [n A, D / n]
  y_all = dropless.unsort_rows(ys, perm, opts.unsort_impl, local)  # [n A, D / n], device i's rows in block i
  with jax.named_scope("split_rows"):
    y = jax.lax.all_to_all(y_all.reshape(n, A, Dn), axes, 0, 0, tiled=True)  # [n, A, D / n]: slice j from device j
  return y.swapaxes(0, 1).reshape(A, D)


def _partial_gmm(xs: jax.Array, ws: tuple, sizes: jax.Array, knobs) -> jax.Array:
  """xs [R, D'] @ [w_0 | w_1 ...][e] (each [E, D', F_i]) per expert group, in float32 (a partial product over a
  slice of the contracted dim, summed across devices after): one ragged_dot with a float32 result per kernel where
  the grouped matmul is ragged (TPU, GPU; no concatenated copy of the kernels), else the grouped matmul on float32
  operands."""
  impl = default_grouped_matmul() if knobs.grouped_matmul == "auto" else knobs.grouped_matmul
  if impl == "ragged":
    return jnp.concatenate([jax.lax.ragged_dot(xs, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
                            for w in ws], axis=-1)
  f32 = jnp.float32
  x = vary_like(xs.astype(f32), ws[0])
  return grouped_matmul(x, tuple(w.astype(f32) for w in ws), sizes, impl=impl, tiling=knobs.megablox_tiling, rest=True)
