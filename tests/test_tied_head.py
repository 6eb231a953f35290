"""The tied head `attend(table, x)` against the untransposed reference x @ table.T, forward and
gradient, for query ranks 2, 3 and 4, with no mesh and under an explicit fsdp mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from meshlm.nn.embed import attend

V, D = 24, 16
SHAPES = {2: (8, D), 3: (4, 6, D), 4: (4, 3, 5, D)}


def _data(rank: int):
  rng = np.random.default_rng(rank)
  x = rng.standard_normal(SHAPES[rank]).astype(np.float32)
  table = rng.standard_normal((V, D)).astype(np.float32)
  w = rng.standard_normal(SHAPES[rank][:-1] + (V,)).astype(np.float32)  # a fixed cotangent
  return x, table, w


def _reference(x, table, w):
  """float64 numpy: logits = x @ table.T; d/dx and d/dtable of sum(w * logits)."""
  x64, t64, w64 = (a.astype(np.float64) for a in (x, table, w))
  logits = x64 @ t64.T
  dx = w64 @ t64
  dtable = w64.reshape(-1, V).T @ x64.reshape(-1, D)
  return logits, dx, dtable


def _check(fn_logits, fn_grads, x, table, w):
  logits, dx, dtable = _reference(x, table, w)
  np.testing.assert_allclose(np.asarray(fn_logits), logits, rtol=1e-5, atol=1e-5)
  gx, gt = fn_grads
  np.testing.assert_allclose(np.asarray(gx), dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gt), dtable, rtol=1e-5, atol=1e-5)


def _loss(table, x, w):
  return jnp.sum(attend(table, x) * w)


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_tied_head_no_mesh(rank):
  x, table, w = _data(rank)
  logits = jax.jit(attend)(table, x)
  gt, gx = jax.jit(jax.grad(_loss, argnums=(0, 1)))(table, x, w)
  assert logits.shape == x.shape[:-1] + (V,)
  _check(logits, (gx, gt), x, table, w)


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_tied_head_explicit_mesh(rank):
  x, table, w = _data(rank)
  mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    # The table is stored fsdp-sharded on embed, the batch on its leading dim (as in the model).
    t = jax.device_put(table, NamedSharding(mesh, P(None, "fsdp")))
    xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    ws = jax.device_put(w, NamedSharding(mesh, P("fsdp")))
    logits = jax.jit(attend)(t, xs)
    gt, gx = jax.jit(jax.grad(_loss, argnums=(0, 1)))(t, xs, ws)
    # No materialized table.T: the lowered head has no transpose of the table.
    text = jax.jit(attend).lower(t, xs).as_text()
  assert "stablehlo.transpose" not in text
  assert gt.sharding.spec == t.sharding.spec  # the gradient comes back in the table's layout
  _check(logits, (gx, gt), x, table, w)
