"""grouped_matmul="megablox" (nn/moe/gmm.py): JAX's Pallas TPU grouped matmul, in interpret mode on CPU against NumPy
(tests/test_moe.py runs it through the layer against the every-expert reference), rows past the groups zeroed under
`rest` (control: NaN without it), the tiling rule, and with libtpu a v5e compile of moe12's gate|up at the rule's
tiles, its three kernels counted by the roofline (analysis/cost.py), and the control: (1024, 1024, 1024), which ran
out of VMEM on the chip, fails the same compile."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.nn.moe import gmm

V5E_BUDGET = int(gmm.VMEM_SHARE * gmm.scoped_vmem("TPU v5 lite"))


def test_rows_past_the_groups_are_zeros_only_with_rest():
  rng = np.random.default_rng(0)
  sizes = jnp.array([0, 11, 0, 1, 5, 0], jnp.int32)  # 17 rows in groups, 7 past them
  x = jnp.asarray(rng.standard_normal((24, 7)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((6, 7, 9)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((24, 9)), jnp.float32)

  def run(rest):
    y, vjp = jax.vjp(jax.jit(lambda x, w: gmm.grouped_matmul(x, w, sizes, impl="megablox", rest=rest)), x, w)
    return np.asarray(y), np.asarray(vjp(c)[0])
  y, dx = run(True)
  np.testing.assert_array_equal(y[17:], 0.0)
  np.testing.assert_array_equal(dx[17:], 0.0)
  e_of_row = np.repeat(np.arange(6), np.asarray(sizes))
  np.testing.assert_allclose(y[:17], np.einsum("rd,rdf->rf", np.asarray(x)[:17], np.asarray(w)[e_of_row]),
                             rtol=1e-5, atol=1e-5)
  y, dx = run(False)  # control: megablox leaves them unwritten (NaN in interpret mode)
  assert not np.all(np.isfinite(y[17:])) and not np.all(np.isfinite(dx[17:]))


def test_the_tiling_rule():
  """From (512, 1024, 1024), the measured best: kept where it fits a v5e (moe12's gate|up, and its input gradient's
  transposed problem), each dim in the fewest whole tiles of 128 (1536 as two of 768, 2816 as three of 1024), clamped
  to a small problem (rows rounded up to 8), halved to fit a smaller budget; the v5e's refused tiling is over it."""
  rule = lambda *mkn, budget=V5E_BUDGET: gmm.megablox_tiling(*mkn, budget=budget)  # noqa: E731
  assert rule(32768, 1024, 3072) == rule(32768, 3072, 1024) == (512, 1024, 1024)
  assert rule(32768, 1536, 1024) == (512, 768, 1024) and rule(131072, 1024, 2816) == (512, 1024, 1024)
  assert rule(78, 24, 40) == (80, 24, 40)
  assert rule(32768, 1024, 3072, budget=V5E_BUDGET // 2) == (512, 512, 512)
  assert gmm.megablox_vmem((1024, 1024, 1024), 2, 2) > V5E_BUDGET >= gmm.megablox_vmem((1024, 512, 1024), 2, 2)
  assert gmm.scoped_vmem("TPU v6 lite") == 2 * gmm.scoped_vmem("TPU v5 lite")


def _compile_moe12_gate_up(tiling):
  """moe12's gate|up (32,768 rows, 1024 -> 3072, 8 experts, bf16), forward and backward, compiled for one v5e."""
  from meshlm.parallel import topology as TP
  devices = TP.devices(TP.parse("v5e:2x2"))[:1]
  mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  S = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731

  def fwd_bwd(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: gmm.grouped_matmul(x, w, sizes, impl="megablox", tiling=tiling), x, w)
    return y, vjp(dy)
  with jax.set_mesh(mesh):
    return jax.jit(fwd_bwd).lower(S((32768, 1024)), S((8, 1024, 3072)), S((8,), jnp.int32),
                                  S((32768, 3072))).compile().as_text()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")
def test_tpu_the_rule_tiles_compile_for_a_v5e_and_the_refused_ones_do_not():
  """The rule's tiles compile (and the roofline counts the three kernels, the forward, dx and dW, at 2 M K N each);
  (1024, 1024, 1024) runs out of VMEM."""
  from meshlm.analysis import cost as C, hlo as H
  mod = H.parse(_compile_moe12_gate_up(None))
  counted = [f for f in (C.ragged_dot_flops(mod, i) for i in mod.instrs() if i.opcode == "custom-call") if f]
  assert counted == [2.0 * 32768 * 1024 * 3072] * 3, counted
  with pytest.raises(Exception, match="(?i)vmem"):
    _compile_moe12_gate_up((1024, 1024, 1024))
