"""The dense primitive's kernel-order weight gradient against the plain gradient.

Every projection shape the llama decoder uses goes through `dense` on an explicit mesh: with
impl="auto_axes" forward, dX and dW must be bit-identical to kernel_order=False; with
impl="custom_vjp" they may differ only by float32 reassociation of the dW / dX sums.
"""
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm.config import load_config
from meshlm.nn.dense import dense
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import logical_spec

B, T, D, V, F, N, H = 8, 16, 32, 64, 48, 4, 8
BTD = ("batch", "length", "act_embed")
BTF = ("batch", "length", "mlp")
BTNH = ("batch", "length", "heads", "head_dim")
BNTH = ("batch", "heads", "length", "head_dim")

# name: (eqn, x shape, x axes, kernel shape, kernel axes, out axes)
CASES = {
    "lm_head": ("btd,dv->btv", (B, T, D), BTD, (D, V), ("embed", "vocab"), ("batch", "length", "vocab")),
    "mlp_up": ("btd,df->btf", (B, T, D), BTD, (D, F), ("embed", "mlp"), BTF),
    "mlp_down": ("btf,fd->btd", (B, T, F), BTF, (F, D), ("mlp", "embed"), BTD),
    "attn_q": ("btd,dnh->btnh", (B, T, D), BTD, (D, N, H), ("embed", "heads", "head_dim"), BTNH),
    "attn_o": ("btnh,nhd->btd", (B, T, N, H), BTNH, (N, H, D), ("heads", "head_dim", "embed"), BTD),
    # gqa's heads-first rows for the splash core: the output in another order than the dot's (dense.dot_order).
    "attn_q_heads_first": ("btd,dnh->bnth", (B, T, D), BTD, (D, N, H), ("embed", "heads", "head_dim"), BNTH),
}
MESHES = {"fsdp4": ("mesh.fsdp=4",), "fsdp2_tensor2": ("mesh.fsdp=2", "mesh.tensor=2")}
# float32 reassociation bounds for custom_vjp vs the plain gradient. A reordered sum of n O(1) terms
# may move a result that cancels to near zero by a few ulps of the terms, not of the result, so the
# absolute part scales with the largest value: 1e-6 of it is about 8 float32 ulps.
RTOL, ATOL_SCALE = 1e-6, 1e-6


def _inputs(name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """x, kernel (scaled by 1/sqrt(fan_in) so outputs are O(1)) and a random output cotangent."""
  eqn, x_shape, _, k_shape, _, _ = CASES[name]
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  x = rng.standard_normal(x_shape, np.float32)
  fan_in = N * H if name == "attn_o" else k_shape[0]  # the contracted dims
  kernel = (rng.standard_normal(k_shape, np.float32) / np.sqrt(fan_in)).astype(np.float32)
  y_shape = np.einsum(eqn, x, kernel).shape
  return x, kernel, rng.standard_normal(y_shape, np.float32)


def _explicit_mesh(mesh_name: str):
  return make_mesh(load_config("cpu_devices=4", *MESHES[mesh_name]))


def _put(mesh, a: np.ndarray, axes) -> jax.Array:
  return jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))


def _forward_and_vjp(kernel_order: bool, impl: str):
  """One jitted program for every case: per case (y, dX, dW) for the given cotangent."""
  def run(args):
    out = {}
    for name, (x, k, w) in args.items():
      eqn, _, _, _, _, out_axes = CASES[name]
      y, vjp = jax.vjp(lambda x, k: dense(x, k, eqn, out_axes, kernel_order=kernel_order, impl=impl), x, k)
      out[name] = (y,) + vjp(w)
    return out
  return jax.jit(run)


@pytest.fixture(scope="module", params=list(MESHES))
def arms(request):
  """(mesh, sharded inputs, outputs of the plain / auto_axes / custom_vjp arms)."""
  mesh = _explicit_mesh(request.param)
  with jax.set_mesh(mesh):
    args = {}
    for name, (_, _, x_axes, _, k_axes, out_axes) in CASES.items():
      x, k, w = _inputs(name)
      args[name] = (_put(mesh, x, x_axes), _put(mesh, k, k_axes), _put(mesh, w, out_axes))
    out = {arm: _forward_and_vjp(ko, impl)(args)
           for arm, ko, impl in [("plain", False, "custom_vjp"), ("auto_axes", True, "auto_axes"),
                                 ("custom_vjp", True, "custom_vjp")]}
  return mesh, args, out


def test_mesh_is_explicit_and_shards_both_operands(arms):
  mesh, args, _ = arms
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  x, k, _ = args["lm_head"]
  assert "fsdp" in str(jax.typeof(x)) and "fsdp" in str(jax.typeof(k))


@pytest.mark.parametrize("name", list(CASES))
def test_auto_axes_is_bit_identical_to_plain(arms, name):
  _, _, out = arms
  for part, a, b in zip(("y", "dx", "dw"), out["plain"][name], out["auto_axes"][name]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {part}")


@pytest.mark.parametrize("name", list(CASES))
def test_custom_vjp_matches_plain_up_to_reassociation(arms, name):
  _, _, out = arms
  y0, dx0, dw0 = (np.asarray(a) for a in out["plain"][name])
  y1, dx1, dw1 = (np.asarray(a) for a in out["custom_vjp"][name])
  # The forward is the same einsum with the same out_sharding: bit-identical.
  np.testing.assert_array_equal(y0, y1)
  for part, a, b in (("dx", dx0, dx1), ("dw", dw0, dw1)):
    diff = float(np.max(np.abs(a - b)))
    print(f"custom_vjp vs plain {name} {part}: max |diff| = {diff:.3g} (max |value| {np.max(np.abs(a)):.3g})")
    np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL_SCALE * np.max(np.abs(a)), err_msg=f"{name} {part}")


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_numpy_reference(arms, name):
  """All arms against float64 numpy: dW = x^T dy contracted into the kernel's stored order."""
  _, _, out = arms
  eqn = CASES[name][0]
  x_sub, k_sub, y_sub = eqn.replace("->", ",").split(",")
  x, k, w = (a.astype(np.float64) for a in _inputs(name))
  refs = (np.einsum(eqn, x, k), np.einsum(f"{y_sub},{k_sub}->{x_sub}", w, k),
          np.einsum(f"{x_sub},{y_sub}->{k_sub}", x, w))
  for arm in ("plain", "auto_axes", "custom_vjp"):
    for part, got, ref in zip(("y", "dx", "dw"), out[arm][name], refs):
      np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5, err_msg=f"{arm} {name} {part}")


@pytest.mark.parametrize("name", list(CASES))
def test_weight_gradient_keeps_the_kernel_layout(arms, name):
  """dW has the kernel's shape, dtype and sharding in every arm: the stored kernel never changes."""
  _, args, out = arms
  _, k, _ = args[name]
  for arm in ("plain", "auto_axes", "custom_vjp"):
    dw = out[arm][name][2]
    assert dw.shape == k.shape and dw.dtype == k.dtype
    assert jax.typeof(dw).sharding.spec == jax.typeof(k).sharding.spec, (arm, jax.typeof(dw), jax.typeof(k))


def _transposes(mesh, name: str, kernel_order: bool, impl: str) -> int:
  """Count of stablehlo.transpose in the lowered gradient of sum(dense(x, k) * w)."""
  _, _, x_axes, _, k_axes, out_axes = CASES[name]
  x, k, w = _inputs(name)
  eqn = CASES[name][0]
  with jax.set_mesh(mesh):
    x, k, w = _put(mesh, x, x_axes), _put(mesh, k, k_axes), _put(mesh, w, out_axes)
    loss = lambda x, k: jnp.sum(dense(x, k, eqn, out_axes, kernel_order=kernel_order, impl=impl) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, k).as_text().count("stablehlo.transpose")


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", list(CASES))
def test_custom_vjp_lowers_without_transposes(mesh_name, name):
  """The plain dW comes out of its dot in (free dims of dy, free dims of x) order and needs a
  transpose into the kernel's order; the custom VJP contracts straight into that order."""
  mesh = _explicit_mesh(mesh_name)
  plain = _transposes(mesh, name, False, "custom_vjp")
  assert plain >= 1
  assert _transposes(mesh, name, True, "custom_vjp") == 0
  # auto_axes changes the placement of the barrier, not the StableHLO: XLA folds the transpose later.
  assert _transposes(mesh, name, True, "auto_axes") == plain


def _transpose_of_dot(mesh, name: str) -> dict:
  """The census' transpose-of-dot counts of the lowered custom-VJP value and gradient of sum(dense(x, k) * w)."""
  from meshlm.analysis.census import stablehlo_counts
  _, _, x_axes, _, k_axes, out_axes = CASES[name]
  x, k, w = _inputs(name)
  with jax.set_mesh(mesh):
    x, k, w = _put(mesh, x, x_axes), _put(mesh, k, k_axes), _put(mesh, w, out_axes)
    loss = lambda x, k: jnp.sum(dense(x, k, CASES[name][0], out_axes, kernel_order=True) * w)  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, k).as_text()
  return stablehlo_counts(text, ())[0]["transpose_of_dot"]


def test_an_output_in_another_order_keeps_its_transpose_beside_the_dot(monkeypatch):
  """"btd,dnh->bnth" is the dot (emitting b, t, n, h) and a transpose. The custom VJP's forward transposes inside
  auto_axes, so no sharding op sits between the two (adjacent: XLA folds it), and the backward's dots emit dX and
  dW in their own order. Control: the forward as the plain einsum with out_sharding puts the sharding between the
  dot and its transpose (blocked)."""
  DN = sys.modules["meshlm.nn.dense"]  # the module (meshlm.nn.dense is also the function's name)
  assert DN.dot_order("btd,dnh->bnth") == "btnh" and DN.dot_order("btd,dnh->btnh") == "btnh"
  assert DN.dot_order("ced,edf->ecf") == "ecf"  # a batch dim shared with the kernel comes first
  mesh = _explicit_mesh("fsdp4")
  counts = _transpose_of_dot(mesh, "attn_q_heads_first")
  assert (counts["adjacent"], counts["blocked"]) == (1, 0), counts
  monkeypatch.setattr(DN, "_forward", lambda eqn, spec, x, k: jnp.einsum(eqn, x, k, out_sharding=spec))
  counts = _transpose_of_dot(mesh, "attn_q_heads_first")
  assert (counts["adjacent"], counts["blocked"]) == (0, 1), counts


def _jaxpr(name: str, kernel_order: bool, impl: str) -> str:
  eqn, _, _, _, _, out_axes = CASES[name]
  x, k, w = _inputs(name)
  loss = lambda x, k: jnp.sum(dense(x, k, eqn, out_axes, kernel_order=kernel_order, impl=impl) * w)
  return str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, k))


@pytest.mark.parametrize("name", ["lm_head", "attn_o"])
def test_flag_is_inert_without_a_mesh(name):
  plain = _jaxpr(name, False, "custom_vjp")
  assert "custom_vjp" not in plain
  for impl in ("auto_axes", "custom_vjp"):
    assert _jaxpr(name, True, impl) == plain, impl
  eqn, *_ = CASES[name]
  x, k, _ = _inputs(name)
  out_axes = CASES[name][5]
  np.testing.assert_array_equal(np.asarray(dense(x, k, eqn, out_axes, kernel_order=True)),
                                np.asarray(jnp.einsum(eqn, x, k)))


@pytest.mark.parametrize("name", ["lm_head", "attn_o"])
def test_flag_is_inert_under_an_auto_mesh(name):
  """Under auto XLA folds the transpose itself, so dense traces the same program either way."""
  mesh = make_mesh(load_config("cpu_devices=4", "mesh.fsdp=2", "mesh.tensor=2", "shard_mode=auto"))
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with jax.set_mesh(mesh):
    plain = _jaxpr(name, False, "custom_vjp")
    assert "sharding_constraint" in plain  # constrain() is active under auto
    for impl in ("auto_axes", "custom_vjp"):
      assert _jaxpr(name, True, impl) == plain, impl


def test_unknown_impl_is_refused_under_explicit():
  mesh = _explicit_mesh("fsdp4")
  x, k, _ = _inputs("lm_head")
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="weight_grad_impl='nope'"):
    dense(_put(mesh, x, BTD), _put(mesh, k, ("embed", "vocab")), "btd,dv->btv", ("batch", "length", "vocab"),
          kernel_order=True, impl="nope")
