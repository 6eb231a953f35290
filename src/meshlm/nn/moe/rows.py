"""Moving the routed rows into expert order and back, with no scatter of rows, each with its plain reference.

The A = M·k routed (token, slot) pairs are laid out slot-major: pair s = k'·M + n is token n's slot k' (so a buffer
of them viewed as [k, M, D] is a reshape that moves nothing, where the token-major [M, k, D] view pads k up to the
TPU's 8 sublanes and copies). The one stable sort by expert id (sort_by_expert) gives perm: row j of the expert-ordered
buffer holds pair perm[j], of token perm[j] % M; inv = its inverse permutation.

- gather_rows: xs = x[tok] into expert order. Its backward gathers the rows' cotangents back by inv and sums each
  token's k of them (a row gather and a sum over the leading k blocks), where autodiff scatter-adds them into zeros.
- unsort_combine: y[n] = sum_k' w[k', n] * ys[inv[k'·M + n]] (float32 sums). Its backward gathers each expert-ordered
  row's token cotangent times its weight (the weights sorted once, beside the ids, by the same sort), and the
  routing weights' gradient as one dot per row scattered back by perm (A scalars), where autodiff would gather the
  output rows by inv again, transpose the weighted sum through [k, M, D] and gather by perm.
- expert_sizes: the rows per expert by a compare-and-count over the ids, not a scatter-add.
Bit-identical to their references (autodiff of the plain formulas, `*_reference`) in float32 up to the order of the
sums (k > 2 cotangents per token, the D-long dots of the weights' gradient); -0 cotangents become +0 as autodiff's
scatter-add into zeros makes them (tests/test_moe_rows.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The sort's outputs a remat policy saves (dropless.REMAT_SAVE_NAMES) so that the backward replays no sort: the
# permutation and what rides along with it (the weights in expert order).
SORTED = "moe_perm"


def _plus_zero(a: jax.Array) -> jax.Array:
  """-0 as +0 (what a scatter-add into zeros makes of it), every other value unchanged."""
  return jnp.where(a == 0, jnp.zeros_like(a), a)


def expert_sizes(ids_A: jax.Array, E: int) -> jax.Array:
  """Rows per expert [E] int32 of ids in [0, E] (E: rows of no local expert, not counted): a compare-and-count over
  the ids, one fused reduction (a scatter-add of ones into E bins runs its A updates one by one on a TPU)."""
  return jnp.sum(ids_A[:, None] == jnp.arange(E, dtype=ids_A.dtype), axis=0, dtype=jnp.int32)


def sort_by_expert(ids_A: jax.Array, E: int, expert_offset: jax.Array | None = None,
                   carry: jax.Array | None = None):
  """(perm [A] int32, sizes [E] int32, local [A] bool or None, carry in expert order or None): the stable sort of the
  routed rows by expert id (the one sort), each expert's row count and `carry` (the routing weights, no gradient
  through them) sorted alongside, all named SORTED for remat.

  expert_offset: the kernels hold experts [offset, offset + E); ids outside become E, sort last and are counted in
  no group (local marks the others)."""
  with jax.named_scope("sort"):
    flat, local = ids_A, None
    if expert_offset is not None:
      flat = flat - expert_offset
      local = (flat >= 0) & (flat < E)  # [A]
      flat = jnp.where(local, flat, E)
    iota = jnp.arange(flat.shape[0], dtype=jnp.int32)
    extra = () if carry is None else (jax.lax.stop_gradient(carry),)
    out = jax.lax.sort((flat.astype(jnp.int32), iota) + extra, num_keys=1, is_stable=True)
    perm = checkpoint_name(out[1], SORTED)
    sorted_carry = None if carry is None else checkpoint_name(out[2], SORTED)
    sizes = expert_sizes(flat, E)
  return perm, sizes, local, sorted_carry


def inverse_permutation(perm: jax.Array) -> jax.Array:
  """inv with inv[perm[j]] = j, by one scatter of A indices (no sort)."""
  n = perm.shape[0]
  return jnp.zeros((n,), perm.dtype).at[perm].set(jnp.arange(n, dtype=perm.dtype), unique_indices=True)


# --- into expert order -----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_rows(M: int, x_MD: jax.Array, tok_A: jax.Array, inv_A: jax.Array) -> jax.Array:
  """x[tok] [A, D]: token tok[j] = perm[j] % M of each expert-ordered row (slot-major pairs, the module docstring)."""
  del M, inv_A
  return x_MD[tok_A]


def _gather_rows_fwd(M, x_MD, tok_A, inv_A):
  return x_MD[tok_A], inv_A


def _gather_rows_bwd(M, inv_A, d_AD):
  A, D = d_AD.shape
  # Row s = k'·M + n of d[inv] is the cotangent of token n's slot k'; token n's are the k rows n, M + n, ...
  g = d_AD[inv_A].reshape(A // M, M, D).astype(jnp.float32)
  return _plus_zero(jnp.sum(g, axis=0)).astype(d_AD.dtype), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def gather_rows_reference(M: int, x_MD: jax.Array, tok_A: jax.Array, inv_A: jax.Array) -> jax.Array:
  """The plain gather, autodiff's backward (a scatter-add of the rows' cotangents into zeros)."""
  del M, inv_A
  return x_MD[tok_A]


# --- back to the tokens ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def unsort_combine(M: int, ys_AD: jax.Array, w_kM: jax.Array, w_sorted_A: jax.Array, perm_A: jax.Array,
                   inv_A: jax.Array) -> jax.Array:
  """y [M, D] = sum_k' w[k', n] * ys[inv[k'·M + n]], float32 sums, in ys' dtype. w_kM: the routing weights slot-major
  (w_Mk.T); w_sorted_A: the same weights in expert order (w_sorted[j] = w at pair perm[j]; sort_by_expert's carry),
  read only by the backward, no gradient through it."""
  del w_sorted_A, perm_A
  A, D = ys_AD.shape
  g = ys_AD[inv_A].reshape(A // M, M, D).astype(jnp.float32)  # [k, M, D]: a view, no copy
  return jnp.sum(g * w_kM.astype(jnp.float32)[:, :, None], axis=0).astype(ys_AD.dtype)


def _unsort_combine_fwd(M, ys_AD, w_kM, w_sorted_A, perm_A, inv_A):
  y = unsort_combine(M, ys_AD, w_kM, w_sorted_A, perm_A, inv_A)
  return y, (ys_AD, w_sorted_A, perm_A)


def _unsort_combine_bwd(M, res, dy_MD):
  ys_AD, w_sorted_A, perm_A = res
  A = ys_AD.shape[0]
  r = dy_MD[perm_A % M].astype(jnp.float32)  # [A, D]: each expert-ordered row's token cotangent
  # The weighted rows' cotangent, as the float32 weighted sum's transpose rounds it to ys' dtype (-0 as +0: autodiff's
  # gather transposes to a scatter-add into zeros).
  d_ys = _plus_zero((w_sorted_A[:, None] * r).astype(ys_AD.dtype))
  dw_sorted = jnp.sum(r * ys_AD.astype(jnp.float32), axis=-1)  # [A], expert order
  dw = jnp.zeros((A,), jnp.float32).at[perm_A].set(dw_sorted, unique_indices=True)  # slot-major
  return d_ys, dw.reshape(A // M, M).astype(w_sorted_A.dtype), None, None, None


unsort_combine.defvjp(_unsort_combine_fwd, _unsort_combine_bwd)


def unsort_combine_reference(M: int, ys_AD: jax.Array, w_kM: jax.Array, w_sorted_A: jax.Array, perm_A: jax.Array,
                             inv_A: jax.Array) -> jax.Array:
  """The plain formula under autodiff: the output rows gathered back by inv, weighted and summed over the slots."""
  del w_sorted_A, perm_A
  A, D = ys_AD.shape
  g = ys_AD[inv_A].reshape(A // M, M, D).astype(jnp.float32)
  return jnp.sum(g * w_kM.astype(jnp.float32)[:, :, None], axis=0).astype(ys_AD.dtype)
