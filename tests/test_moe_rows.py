"""The routed rows' movement (nn/moe/rows.py) and the fused way back (fused.py, glu_rows.py) against their references,
float32: gather_rows, unsort_combine and glu_down_combine, forward and every gradient, against autodiff of the plain
formulas (a wrong inverse in either backward, unweighted rows in down's gradient fail), with zero and -0 cotangent
rows; the GLU-backward kernel in Pallas interpret mode against XLA's form; expert_sizes and the sort's carry against
NumPy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.nn.moe import rows

M, K, D, E = 13, 3, 6, 5  # 39 (token, slot) pairs, three slots per token: sums of three cotangents


def _bits(a):
  return np.asarray(a).view(np.uint32)


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, E, (M, K)).astype(np.int32)
  w = rng.random((M, K)).astype(np.float32)
  perm, sizes, _, w_sorted = rows.sort_by_expert(jnp.asarray(ids.T.reshape(-1)), E, carry=jnp.asarray(w.T.reshape(-1)))
  inv = rows.inverse_permutation(perm)
  x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
  ys = jnp.asarray(rng.standard_normal((M * K, D)), jnp.float32)
  dy = rng.standard_normal((M, D)).astype(np.float32)
  dy[::4], dy[1::5] = 0.0, -0.0  # zero cotangent rows, both signs
  d_rows = rng.standard_normal((M * K, D)).astype(np.float32)
  d_rows[::3], d_rows[1::7] = 0.0, -0.0
  return dict(ids=ids, w=w, perm=perm, sizes=sizes, w_sorted=w_sorted, inv=inv, x=x, ys=ys, dy=jnp.asarray(dy),
              d_rows=jnp.asarray(d_rows))


def test_the_sort_carries_the_weights_and_counts_the_rows(case):
  flat = case["ids"].T.reshape(-1)  # slot-major
  perm = np.asarray(case["perm"])
  assert np.array_equal(perm, np.argsort(flat, kind="stable"))
  assert np.array_equal(np.asarray(case["w_sorted"]), case["w"].T.reshape(-1)[perm])
  assert np.array_equal(np.asarray(case["sizes"]), np.bincount(flat, minlength=E))
  assert np.array_equal(np.asarray(case["inv"])[perm], np.arange(M * K))
  # ids of no local expert (E) are not counted
  assert np.array_equal(np.asarray(rows.expert_sizes(jnp.array([0, E, 2, E, 0]), E)), [2, 0, 1, 0, 0])


def _vjp(fn, *args, ct):
  y, vjp = jax.vjp(fn, *args)
  return (y, *vjp(ct))


def _gather(case, fn):
  return jax.jit(lambda x, d: _vjp(lambda x: fn(M, x, case["perm"] % M, case["inv"]), x, ct=d))(case["x"],
                                                                                               case["d_rows"])


def test_gather_rows_equals_the_plain_gather(case):
  got, want = _gather(case, rows.gather_rows), _gather(case, rows.gather_rows_reference)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)  # three cotangents per token: the sum's order
  assert np.array_equal(_bits(got[1])[np.asarray(want[1]) == 0], _bits(want[1])[np.asarray(want[1]) == 0])  # +0


def _combine(case, fn):
  def f(ys, w_kM):
    return fn(M, ys, w_kM, case["w_sorted"], case["perm"], case["inv"])
  return jax.jit(lambda ys, w, d: _vjp(f, ys, w, ct=d))(case["ys"], jnp.asarray(case["w"].T), case["dy"])


def test_unsort_combine_equals_the_plain_formula(case):
  got, want = _combine(case, rows.unsort_combine), _combine(case, rows.unsort_combine_reference)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))  # each row's cotangent: one product, +0 for 0
  np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-6)  # the weights': D-long dots


def test_a_wrong_inverse_in_either_backward_fails(case, monkeypatch):
  """Negative controls: each backward gathering by perm where it needs inv (and the forward by inv) is caught."""
  wrong = dict(case, inv=case["perm"])
  got, want = _gather(wrong, rows.gather_rows), _gather(case, rows.gather_rows_reference)
  assert np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1]))) > 1e-1
  real = rows._unsort_combine_bwd
  monkeypatch.setattr(rows, "_unsort_combine_bwd",
                      lambda M_, res, dy: real(M_, (res[0], res[1], rows.inverse_permutation(res[2])), dy))
  rows.unsort_combine.defvjp(rows._unsort_combine_fwd, rows._unsort_combine_bwd)
  try:
    got, want = _combine(case, rows.unsort_combine), _combine(case, rows.unsort_combine_reference)
  finally:
    rows.unsort_combine.defvjp(rows._unsort_combine_fwd, real)
  assert np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1]))) > 1e-1


@functools.cache
def _layer_jaxpr() -> str:
  from meshlm.nn import moe

  from moe_helpers import settings
  x = jnp.ones((2, 8, D))
  p = {"router": jnp.ones((D, E)), "gate": jnp.ones((E, D, 4)), "up": jnp.ones((E, D, 4)), "down": jnp.ones((E, 4, D))}
  f = jax.grad(lambda p, x: jnp.sum(moe.moe_mlp(p, x, None, *settings(E, 2, grouped_matmul="ragged"))[0]),
               argnums=(0, 1))
  return str(jax.make_jaxpr(f)(p, x))


def test_the_layer_scatters_no_rows():
  """Forward and backward of the layer: the only scatters are of A indices or scalars (the inverse permutation, the
  weights' gradient), none of [A, D] rows; and no [A, D] row buffer is reshaped token-major ([M, k, D])."""
  text = _layer_jaxpr()
  shapes = [line.split("=")[0] for line in text.splitlines() if "scatter" in line]
  assert shapes and all(",6]" not in s for s in shapes), shapes
  assert "f32[16,2,6]" not in text and "f32[8,2,6]" not in text  # token-major views of the 32 rows


# --- the GLU, the down matmul and the way back as one op (nn/moe/fused.py) -------------------------------------

F = 4


def _fused(case, fn, impl="loop"):
  from meshlm.nn.moe import gmm
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.standard_normal((M * K, 2 * F)), jnp.float32)
  down = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
  mm = functools.partial(gmm.grouped_matmul, impl=impl)

  def f(h, down, w_kM):
    return fn(M, jax.nn.silu, mm, h, down, case["sizes"], w_kM, case["w_sorted"], case["perm"], case["inv"])
  return jax.jit(lambda *a: _vjp(f, *a[:3], ct=a[3]))(h, down, jnp.asarray(case["w"].T), case["dy"])


@pytest.mark.parametrize("impl", ["loop", "ragged"])
def test_glu_down_combine_equals_the_plain_composition(case, impl):
  """The output and the gradients of h, the down kernel and the weights against autodiff of glu, down, combine."""
  from meshlm.nn.moe import fused
  got, want = _fused(case, fused.glu_down_combine, impl), _fused(case, fused.glu_down_combine_reference, impl)
  for name, a, b in zip(("y", "d_h", "d_down", "d_w"), got, want):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * max(1.0, float(np.max(np.abs(b)))), err_msg=name)


def test_glu_down_combine_with_unweighted_rows_in_the_kernel_gradient_fails(case, monkeypatch):
  """Negative control: the down kernel's gradient from the GLU rows unweighted (a^T r instead of (w a)^T r)."""
  from meshlm.nn.moe import fused
  real = fused._bwd

  def unweighted(M_, act, mm, res, dy):
    h, down, sizes, w_sorted, perm = res
    return real(M_, act, mm, (h, down, sizes, jnp.ones_like(w_sorted), perm), dy)
  fused.glu_down_combine.defvjp(fused._fwd, unweighted)
  try:
    got = _fused(case, fused.glu_down_combine)
  finally:
    fused.glu_down_combine.defvjp(fused._fwd, real)
  want = _fused(case, fused.glu_down_combine_reference)
  assert np.max(np.abs(np.asarray(got[2]) - np.asarray(want[2]))) > 1e-1


# --- the GLU's backward over the rows: the Pallas kernel (interpret mode) against XLA's form -------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_glu_rows_kernel_equals_the_xla_backward(dtype):
  from meshlm.nn.moe import glu_rows
  rng = np.random.default_rng(2)
  A, Fk = 48, 128  # three row blocks of 16
  h = jnp.asarray(rng.standard_normal((A, 2 * Fk)), dtype)
  q = rng.standard_normal((A, Fk)).astype(np.float32)
  q[::5] = 0.0  # zero rows: +0 gradients either way
  q = jnp.asarray(q, dtype)
  w = jnp.asarray(rng.random(A), jnp.float32)
  assert glu_rows.block_rows(A, Fk, jnp.dtype(dtype).itemsize) == 16
  got = jax.jit(lambda *a: glu_rows.rows_backward(jax.nn.silu, *a, kernel=True))(h, q, w)
  want = jax.jit(lambda *a: glu_rows.backward(jax.nn.silu, *a))(h, q, w)
  # bfloat16: the kernel rounds its outputs once, XLA's form each op (a, then the dot's terms); float32: the order of
  # the dot's sums.
  tol = 1e-6 if dtype == "float32" else 1e-2
  for name, a, b in zip(("dh", "a_w", "dw"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(b)))), err_msg=name)
  assert not np.signbit(np.asarray(got[0], np.float32)[np.asarray(got[0], np.float32) == 0]).any()  # no -0
  # Control: the kernel with the halves' gradients swapped is caught.
  swapped = jnp.concatenate([got[0][:, Fk:], got[0][:, :Fk]], axis=-1)
  assert np.max(np.abs(np.asarray(swapped, np.float32) - np.asarray(want[0], np.float32))) > 1e-1
