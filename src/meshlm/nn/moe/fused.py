"""The experts' second half and the way back to the tokens as one op: y = combine(down(glu(h))), with a backward that
needs neither the down projection's output nor the GLU's (glu_down_combine; its reference: autodiff of the plain
composition, glu_down_combine_reference).

Autodiff of the composition needs ys = down(a) for the routing weights' gradient (dw_j = <dy[tok_j], ys_j>), so under
remat the backward runs the down grouped matmul again, and it weighs the rows' cotangents (w_j dy[tok_j]) before the
down matmul's backward. Here, with r_j = dy[tok_j] (the token cotangent gathered into expert order) and q = r @ down^T
(the down matmul's input gradient on the unweighted rows):
  dw_j = <r_j, a_j @ down> = <q_j, a_j>,   da_j = w_j q_j,   d_down = sum_j (w_j a_j)^T r_j,
so the backward is the down matmul's backward in its two halves (q from r; d_down from a_w and r), between them the
GLU's backward on da with the weights' gradient and a_w in one pass over the rows (glu_rows.py: a Pallas kernel on
TPU; its input h is the residual, a recomputed from it). Under remat=full the recomputed forward then stops at the
gate|up matmul: no GLU, no down matmul, no gather back.
Float32: the reference's values and gradients up to the order of the sums (tests/test_moe_rows.py).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from meshlm.nn.moe import glu_rows, rows


def _halves(h_A2F):
  F = h_A2F.shape[-1] // 2
  return h_A2F[..., :F], h_A2F[..., F:]


def _glu(act, g, u):
  return act(g) * u


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def glu_down_combine(M: int, act: Callable, gmm: Callable, h_A2F: jax.Array, down_EFD: jax.Array, sizes_E: jax.Array,
                     w_kM: jax.Array, w_sorted_A: jax.Array, perm_A: jax.Array, inv_A: jax.Array) -> jax.Array:
  """y [M, D] = sum_k' w[k', n] * (act(g) * u @ down[e])[inv[k'·M + n]] for h = [g | u] [A, 2F] in expert order
  (the fused gate|up matmul's output). gmm(rows, kernel, sizes): the grouped matmul; the rest: rows.unsort_combine's
  arguments (w_sorted_A: the weights in expert order, read by the backward, no gradient through it)."""
  ys = gmm(_glu(act, *_halves(h_A2F)), down_EFD, sizes_E)  # [A, D]
  return rows.unsort_combine(M, ys, w_kM, w_sorted_A, perm_A, inv_A)


def _fwd(M, act, gmm, h_A2F, down_EFD, sizes_E, w_kM, w_sorted_A, perm_A, inv_A):
  y = glu_down_combine(M, act, gmm, h_A2F, down_EFD, sizes_E, w_kM, w_sorted_A, perm_A, inv_A)
  return y, (h_A2F, down_EFD, sizes_E, w_sorted_A, perm_A)


def _bwd(M, act, gmm, res, dy_MD):
  h_A2F, down_EFD, sizes_E, w_sorted_A, perm_A = res
  A, F2 = h_A2F.shape
  r = dy_MD[perm_A % M].astype(h_A2F.dtype)  # [A, D]: each expert-ordered row's token cotangent, unweighted
  # The grouped matmul's backward in its two halves (each vjp's forward, and the other half, are dead code):
  # q = r @ down^T first; then, from the GLU's backward's a_w, d_down = (w a)^T r.
  # (The placeholder rows: zeros typed as h, varying over the same shard_map axes.)
  q = jax.vjp(lambda rows_: gmm(rows_, down_EFD, sizes_E), jnp.zeros_like(h_A2F[:, :F2 // 2]))[1](r)[0]
  dh, a_w, dw_sorted = glu_rows.rows_backward(act, h_A2F, q, w_sorted_A)  # dw_j = <q_j, a_j> = <dy[tok_j], ys_j>
  d_down = jax.vjp(lambda kernel: gmm(a_w, kernel, sizes_E), down_EFD)[1](r)[0]
  dw = jnp.zeros((A,), jnp.float32).at[perm_A].set(dw_sorted, unique_indices=True)  # slot-major
  return dh, d_down, None, dw.reshape(A // M, M).astype(w_sorted_A.dtype), None, None, None


glu_down_combine.defvjp(_fwd, _bwd)


def glu_down_combine_reference(M: int, act: Callable, gmm: Callable, h_A2F, down_EFD, sizes_E, w_kM, w_sorted_A,
                               perm_A, inv_A):
  """The plain composition under autodiff: the GLU, the down matmul and the weighted sum back, each differentiated
  as written (the down matmul's output kept for the weights' gradient)."""
  ys = gmm(_glu(act, *_halves(h_A2F)), down_EFD, sizes_E)
  return rows.unsort_combine_reference(M, ys, w_kM, w_sorted_A, perm_A, inv_A)
