"""The GLU's backward over the routed rows in one pass (fused.glu_down_combine's): from h = [g | u] [A, 2F] (the fused
gate|up output), q [A, F] (the down matmul's input gradient on the unweighted rows) and the rows' routing weights w [A]:

  a = act(g) * u,   a_w = w a          (the down kernel's gradient reads a_w)
  dw = <q, a> per row                  (the routing weights' gradient, expert order)
  [dg | du] = vjp(act(g) * u)(w q)     (-0 as +0, as autodiff's pad-and-add of the halves makes it)

`backward` is the XLA form (the reference, and the path off TPU); on a TPU a Pallas kernel (`_pallas`) reads each row
block of h and q once and writes [dg | du] whole, where XLA writes dg and du in one fusion and concatenates them in a
second pass over [A, 2F]. Float32 math inside, outputs rounded once (the XLA form computes in the rows' dtype where
XLA's fusion does): equal to `backward` within the rows' dtype's rounding; float32, within 1e-6
(tests/test_moe_rows.py, Pallas interpret mode).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import platform

BLOCK_ROWS = (256, 128, 64, 32, 16, 8)  # row blocks the kernel tries, largest first, under VMEM_BYTES
VMEM_BYTES = 10 << 20  # what a block's buffers and float32 temporaries may take (a v5e's scoped VMEM is 16 MiB)


def _plus_zero(a):
  return jnp.where(a == 0, jnp.zeros_like(a), a)


def backward(act: Callable, h_A2F: jax.Array, q_AF: jax.Array, w_A: jax.Array):
  """(dh [A, 2F], a_w [A, F] in h's dtype, dw [A] float32), by XLA: the reference and the path off TPU."""
  F = h_A2F.shape[-1] // 2
  g, u = h_A2F[:, :F], h_A2F[:, F:]
  w = w_A.astype(jnp.float32)[:, None]
  a, glu_vjp = jax.vjp(lambda g_, u_: act(g_) * u_, g, u)
  q32 = q_AF.astype(jnp.float32)
  dw = jnp.sum(q32 * a.astype(jnp.float32), axis=-1)
  a_w = (w * a.astype(jnp.float32)).astype(h_A2F.dtype)
  dg, du = glu_vjp((w * q32).astype(h_A2F.dtype))
  return jnp.concatenate([_plus_zero(dg), _plus_zero(du)], axis=-1), a_w, dw


def block_rows(A: int, F: int, itemsize: int) -> int | None:
  """The kernel's row block: the largest of BLOCK_ROWS dividing A whose double-buffered blocks (h, q in; dh, a_w out)
  and float32 temporaries fit VMEM_BYTES; None when none does (then `backward` runs)."""
  for bm in BLOCK_ROWS:
    io = 2 * bm * (2 * F + F + 2 * F + F) * itemsize + 4 * bm * 128 * 4  # + w and dw blocks, lane-padded
    if A % bm == 0 and io + 6 * bm * F * 4 <= VMEM_BYTES:
      return bm
  return None


def _kernel(g_ref, u_ref, q_ref, w_ref, dh_ref, aw_ref, dw_ref, *, act, F):
  g, u = g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32)
  q, w = q_ref[...].astype(jnp.float32), w_ref[...]  # w: [bm, 1] float32
  a, glu_vjp = jax.vjp(lambda g_, u_: act(g_) * u_, g, u)
  dg, du = glu_vjp(w * q)
  dt = dh_ref.dtype
  dh_ref[:, :F] = _plus_zero(dg).astype(dt)
  dh_ref[:, F:] = _plus_zero(du).astype(dt)
  aw_ref[...] = (w * a).astype(aw_ref.dtype)
  dw_ref[...] = jnp.sum(q * a, axis=-1, keepdims=True)


def _pallas(act: Callable, h_A2F: jax.Array, q_AF: jax.Array, w_A: jax.Array, bm: int, interpret: bool):
  from jax.experimental import pallas as pl
  A, F = q_AF.shape
  dt = h_A2F.dtype
  rows = lambda i: (i, 0)  # noqa: E731
  call = pl.pallas_call(
      functools.partial(_kernel, act=act, F=F),
      grid=(A // bm,),
      in_specs=[pl.BlockSpec((bm, F), rows), pl.BlockSpec((bm, F), lambda i: (i, 1)), pl.BlockSpec((bm, F), rows),
                pl.BlockSpec((bm, 1), rows)],
      out_specs=[pl.BlockSpec((bm, 2 * F), rows), pl.BlockSpec((bm, F), rows), pl.BlockSpec((bm, 1), rows)],
      out_shape=[_shape((A, 2 * F), dt, h_A2F), _shape((A, F), dt, h_A2F), _shape((A, 1), jnp.float32, h_A2F)],
      interpret=interpret)
  dh, a_w, dw = call(h_A2F, h_A2F, q_AF, w_A.astype(jnp.float32)[:, None])
  return dh, a_w, dw[:, 0]


def _shape(shape, dtype, like):
  """An output's type, varying over the shard_map axes `like` varies over (check_vma asks it of a Pallas output)."""
  mat = getattr(jax.typeof(like), "manual_axis_type", None)
  return jax.ShapeDtypeStruct(shape, dtype) if mat is None else jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def rows_backward(act: Callable, h_A2F: jax.Array, q_AF: jax.Array, w_A: jax.Array, *, kernel: bool | None = None):
  """`backward`'s outputs: by the Pallas kernel on TPU (kernel None: the program's platform decides; True forces it,
  in interpret mode off TPU), where F is whole 128-lane tiles and a row block fits; else by XLA."""
  A, F = q_AF.shape
  tpu = platform() == "tpu"
  use = tpu if kernel is None else kernel
  bm = block_rows(A, F, h_A2F.dtype.itemsize) if use and F % 128 == 0 else None
  if bm is None:
    return backward(act, h_A2F, q_AF, w_A)
  return _pallas(act, h_A2F, q_AF, w_A, bm, interpret=not tpu)
