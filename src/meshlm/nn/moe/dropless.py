"""Dropless dispatch on local tokens: sort the (token, slot) pairs by expert, gather, grouped matmuls, back to tokens.

The row movement is rows.py's (slot-major pairs, gathers only, each with its reference) and the experts' second half
with the way back fused.py's (glu_down_combine: a backward that runs no down matmul again); docs/moe.md "The routed
rows on a TPU". Speedups kept switchable against their plain versions (Options):
- `unsort_impl="perm"`: the inverse permutation is a scatter of the sort's own permutation; the plain version
  ("argsort") argsorts perm again (one sort in the forward, none in the backward: tests/moe_helpers.py count_sorts).
- `fused_gate_up=True`: gate and up are one grouped matmul of width 2F and the rest is glu_down_combine; the plain
  version runs gate and up apart, autodiff through the GLU, and rows.unsort_combine back. `fused_glu` (the GLU
  alone, its backward writing both half-gradients in one concatenate instead of autodiff's pad-and-add) serves
  expert_rows' callers that take the rows themselves (the compact dispatch).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshlm.nn import gather_once
from meshlm.nn.moe import fused, rows
from meshlm.nn.moe.gmm import default_grouped_matmul, grouped_matmul, vary_like
from meshlm.nn.stack_row import is_row, materialize

# Values a remat policy should save so that the backward replays no sort: the sort's permutation and what it carries.
# jax.checkpoint(policy=checkpoint_dots) alone recomputes the sort in the backward; combine it with
# save_only_these_names(*REMAT_SAVE_NAMES) (save_from_both_policies) to keep it at one sort per layer.
REMAT_SAVE_NAMES = (rows.SORTED,)
UNSORTS = ("perm", "argsort")


# --- the speedups: unsort with the sort's permutation, fused GLU -----------------------------------

inverse_permutation = rows.inverse_permutation


@jax.custom_vjp
def unsort(ys_AD: jax.Array, perm: jax.Array, inv: jax.Array) -> jax.Array:
  """ys[inv]: rows back from expert order to (token, slot) order. The backward gathers by perm."""
  return ys_AD[inv]


def _unsort_fwd(ys_AD, perm, inv):
  return ys_AD[inv], perm


def _unsort_bwd(perm, dy_AD):
  # Autodiff of ys[inv] scatter-adds dy into zeros at inv; each row lands once, so that is the gather
  # dy[perm], except that 0 + (-0) = +0: where() keeps that, so the result is bit-identical.
  d = dy_AD[perm]
  return jnp.where(d == 0, jnp.zeros_like(d), d), None, None


unsort.defvjp(_unsort_fwd, _unsort_bwd)


def _glu(act, g, u):
  return act(g) * u


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_glu(act: Callable, h_A2F: jax.Array) -> jax.Array:
  """act(gate) * up for h = [gate | up] (the fused gate|up matmul's output), [A, 2F] -> [A, F]."""
  F = h_A2F.shape[-1] // 2
  g = checkpoint_name(h_A2F[..., :F], "moe_gate")
  u = checkpoint_name(h_A2F[..., F:], "moe_up")
  return _glu(act, g, u)


def _fused_glu_fwd(act, h_A2F):
  F = h_A2F.shape[-1] // 2
  g = checkpoint_name(h_A2F[..., :F], "moe_gate")
  u = checkpoint_name(h_A2F[..., F:], "moe_up")
  return _glu(act, g, u), (g, u)


def _fused_glu_bwd(act, res, d_AF):
  g, u = res
  _, vjp = jax.vjp(functools.partial(_glu, act), g, u)
  dg, du = vjp(d_AF)
  # Autodiff of the split pads each half-gradient with zeros and adds them: -0 becomes +0 there.
  fix = lambda a: jnp.where(a == 0, jnp.zeros_like(a), a)  # noqa: E731
  return (jnp.concatenate([fix(dg), fix(du)], axis=-1),)


fused_glu.defvjp(_fused_glu_fwd, _fused_glu_bwd)


def split_glu(act: Callable, h_A2F: jax.Array) -> jax.Array:
  """The plain version of fused_glu: slice and let autodiff transpose the slices."""
  F = h_A2F.shape[-1] // 2
  return _glu(act, checkpoint_name(h_A2F[..., :F], "moe_gate"), checkpoint_name(h_A2F[..., F:], "moe_up"))


# --- the expert-weight-gradient scheduling barrier ---------------------------------------------------

@jax.custom_vjp
def expert_grad_barrier(xs_AD: jax.Array, kernels: tuple) -> tuple[jax.Array, tuple]:
  """Identity on (the experts' input rows, expert kernels). In the backward, the rows' cotangent
  (what the gather's scatter-add turns into x's gradient) and the kernels' cotangents (the grouped
  matmuls' weight gradients) pass one optimization_barrier together: XLA must have all of them
  before any leaves, so the expert weight gradients are scheduled with the input gradient that the
  previous layer's backward waits on, not deferred and interleaved with it. Numerically a no-op
  (bit-identical values)."""
  return xs_AD, kernels


def _expert_grad_barrier_fwd(xs_AD, kernels):
  return (xs_AD, kernels), None


def _expert_grad_barrier_bwd(_, cts):
  return jax.lax.optimization_barrier(cts)


expert_grad_barrier.defvjp(_expert_grad_barrier_fwd, _expert_grad_barrier_bwd)


# --- the router kernel, gathered once before the layers (issue 11 speedup 5) -------------------------

def gather_router_once(router_stack: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """The stacked router [L, D, E] (logical axes `axes`) gathered once before the layer scan: no
  all-gather in the scan's body; each layer's gradient goes back per layer (nn/gather_once.py)."""
  return gather_once.gather_stack(router_stack, axes, "router_gather_once")


# --- dispatch ----------------------------------------------------------------------------------------

def dispatch(x_MD: jax.Array, ids_Mk: jax.Array, w_Mk: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array,
             down_EFD: jax.Array, knobs, opts, expert_offset: jax.Array | None = None):
  """Dropless expert computation on local tokens: (y [M, D] = sum_k w[n, k] * expert_{ids[n, k]}(x[n]), dropped: an
  int32 0, the expert-parallel dispatches' type; this one drops nothing).

  The row movement (rows.py: the sort, gather_rows into expert order, unsort_combine back, the (token, slot) pairs
  slot-major) around the per-row expert work (expert_rows); the compact expert-parallel dispatch
  (expert_parallel.py) composes sort_slots, expert_rows and unsort_rows around an all-to-all.
  knobs: the moe section (its grouped_matmul, megablox_tiling); opts: nn/moe/layer.Options (activation, the kernels'
  cast, the plain variants: fused_gate_up off runs gate and up as two grouped matmuls and autodiff; grad_barrier
  puts `expert_grad_barrier` on the gathered rows and the kernels; unsort_impl "argsort" finds the inverse
  permutation by a second sort).
  expert_offset (expert parallelism): the kernels hold experts [offset, offset + E) of all experts;
  only the slots routed to those run, the rest sort to the end, get no rows in the grouped matmul
  and give zeros (y is this shard's part of the sum over k).
  """
  if opts.unsort_impl not in UNSORTS:
    raise ValueError(f"unsort_impl={opts.unsort_impl!r}: expected one of {UNSORTS}")
  M, k = ids_Mk.shape
  E = down_EFD.shape[0]
  w_kM = w_Mk.T  # slot-major, as the ids: pair s = k' M + n
  perm, sizes, local, w_sorted = rows.sort_by_expert(ids_Mk.T.reshape(-1), E, expert_offset, w_kM.reshape(-1))
  with jax.named_scope("unsort"):
    inv = rows.inverse_permutation(perm) if opts.unsort_impl == "perm" else jnp.argsort(perm).astype(perm.dtype)
  if local is not None:
    # Pairs routed to no local expert weigh nothing here (their rows sort last, past sum(sizes)).
    w_kM = jnp.where(local.reshape(k, M), w_kM, jnp.zeros_like(w_kM))
    w_sorted = jnp.where(jnp.arange(M * k) < jnp.sum(sizes), w_sorted, jnp.zeros_like(w_sorted))
  with jax.named_scope("gather"):
    xs = rows.gather_rows(M, x_MD, perm % M, inv)  # [A, D]
  rest = expert_offset is not None
  if opts.fused_gate_up:
    # The GLU, the down matmul and the way back as one op (fused.py): its backward runs no down matmul again.
    back = lambda h, down, gmm: fused.glu_down_combine(M, opts.activation, gmm, h, down, sizes, w_kM,  # noqa: E731
                                                       w_sorted, perm, inv)
    return expert_rows(xs, sizes, gate_EDF, up_EDF, down_EFD, knobs, opts, rest=rest, back=back), jnp.zeros(
        (), jnp.int32)
  ys = expert_rows(xs, sizes, gate_EDF, up_EDF, down_EFD, knobs, opts, rest=rest)
  with jax.named_scope("combine"):
    y = rows.unsort_combine(M, ys, w_kM, w_sorted, perm, inv)
  return y, jnp.zeros((), jnp.int32)


def sort_slots(flat_A: jax.Array, E: int, expert_offset: jax.Array | None = None):
  """(perm [A] int32, sizes [E] int32, local [A] bool or None): rows.sort_by_expert without a carry (the compact
  dispatch's receiver)."""
  return rows.sort_by_expert(flat_A, E, expert_offset)[:3]


def expert_rows(xs_AD: jax.Array, sizes_E: jax.Array, gate_EDF, up_EDF, down_EFD, knobs, opts,
                rest: bool = False, back: Callable | None = None) -> jax.Array:
  """The per-row expert work: ys [A, D] = glu_{e_j}(xs[j]) over rows sorted by expert (sizes_E rows each; rows
  past the groups, which exist only with rest (expert parallelism's), are zeros), with the expert grad barrier on the
  rows and the kernels; knobs, opts: dispatch's. back(h, down, gmm): with the fused gate|up, what the rest is instead
  (h [A, 2F], the down kernel cast, gmm(rows, kernel, sizes)): dispatch's fused.glu_down_combine."""
  dt = xs_AD.dtype
  cast = functools.partial(_as, dt=dt, cast=opts.cast_to)
  impl = knobs.grouped_matmul
  gmm = functools.partial(grouped_matmul, impl=impl, block_rows=opts.block_rows, tiling=knobs.megablox_tiling,
                          rest=rest)
  if (default_grouped_matmul() if impl == "auto" else impl) != "loop":
    # Only the expert loop reads a StackRow in place; the others take the row sliced out.
    gate_EDF, up_EDF, down_EFD = (materialize(w) for w in (gate_EDF, up_EDF, down_EFD))
  # Kernels left in their stacks (StackRow, read by the expert loop) skip the barrier: their cotangents are
  # stack-shaped pads that XLA fuses across layers into one pass, which a barrier on each would block.
  if opts.grad_barrier and not any(is_row(w) for w in (gate_EDF, up_EDF, down_EFD)):
    # On the grouped matmuls' input rows and kernels: the rows' cotangent enters the barrier before
    # the gather's scatter-add, so XLA may still fold other gradients of x into that scatter (as
    # without the barrier: on x itself it blocked the fold and moved x's gradient by 1 ulp). Inside
    # shard_map the kernels are made varying first (as the grouped matmul would), so the barrier's
    # cotangents have its inputs' types; the cast's transpose (the cross-shard sum) stays outside.
    kernels = tuple(vary_like(w, xs_AD) for w in (gate_EDF, up_EDF, down_EFD))
    xs_AD, (gate_EDF, up_EDF, down_EFD) = expert_grad_barrier(xs_AD, kernels)
  # Each grouped matmul in its own scope, so the census counts weight-gradient dots per kernel.
  with jax.named_scope("experts"):
    if opts.fused_gate_up:
      with jax.named_scope("gate_up"):
        h = gmm(xs_AD, (cast(gate_EDF), cast(up_EDF)), sizes_E)  # [A, 2F]
      if back is not None:
        with jax.named_scope("down"):
          return back(h, cast(down_EFD), gmm)
      a = fused_glu(opts.activation, h)
    else:
      with jax.named_scope("gate"):
        g = checkpoint_name(gmm(xs_AD, cast(gate_EDF), sizes_E), "moe_gate")
      with jax.named_scope("up"):
        u = checkpoint_name(gmm(xs_AD, cast(up_EDF), sizes_E), "moe_up")
      a = opts.activation(g) * u
    with jax.named_scope("down"):
      return gmm(a, cast(down_EFD), sizes_E)  # [A, D]


def unsort_rows(ys_AD: jax.Array, perm: jax.Array, unsort_impl: str = "perm",
                local: jax.Array | None = None) -> jax.Array:
  """The rows back from expert order to slot order [A, D] ("perm": by the sort's own permutation); rows not
  local (sort_slots) are zeros."""
  with jax.named_scope("unsort"):
    if unsort_impl == "perm":
      y_flat = unsort(ys_AD, perm, inverse_permutation(perm))
    else:
      y_flat = ys_AD[jnp.argsort(perm)]
    if local is not None:
      # The rows past the local groups are not computed (zeros, or a clamped gather in "blocks").
      y_flat = jnp.where(local[:, None], y_flat, jnp.zeros_like(y_flat))
  return y_flat


def combine(y_flat_AD: jax.Array, w_Mk: jax.Array) -> jax.Array:
  """y [M, D] = sum_k w[n, k] * y_flat[n * k + k'] (float32 sums, in y_flat's dtype)."""
  M, k = w_Mk.shape
  D = y_flat_AD.shape[-1]
  with jax.named_scope("combine"):
    y = jnp.einsum("nkd,nk->nd", y_flat_AD.reshape(M, k, D).astype(jnp.float32), w_Mk.astype(jnp.float32))
  return y.astype(y_flat_AD.dtype)


def _as(w, dt, cast):
  """w in dtype dt by cast(w, dt) (the layer's rule, Context.cast in a model); a StackRow of that dtype stays in its
  stack (a cast would copy its row anyway)."""
  if is_row(w) and w.dtype == dt:
    return w
  return cast(materialize(w), dt)
