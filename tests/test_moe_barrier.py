"""The expert-weight-gradient scheduling barrier (issue 11, speedup 6): identity in the forward, one
optimization_barrier over the input rows' cotangent and the expert kernels' cotangents in the backward.

The barrier sat on x itself first: there it kept XLA from folding the router's gradient of x into
the gather's scatter-add, and x's gradient moved by 1 ulp (test_bit_identical_under_a_mesh failed,
max |diff| 1.2e-7); on the gathered rows the fold stays and every value is bit-identical."""
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.nn import moe
from moe_helpers import settings

N, D, F, E, K = 48, 16, 24, 4, 2


def _inputs():
  ks = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(ks[0], (N, D), jnp.float32)
  # Uneven routing: expert 3 gets no token, expert 0 most of them.
  ids = jnp.where(jax.random.uniform(ks[1], (N, K)) < 0.7, 0, jax.random.randint(ks[2], (N, K), 1, 3))
  w = jax.nn.softmax(jax.random.normal(ks[3], (N, K)), axis=-1)
  gate, up = (0.2 * jax.random.normal(k, (E, D, F)) for k in jax.random.split(ks[4]))
  down = 0.2 * jax.random.normal(ks[5], (E, F, D))
  return x, ids.astype(jnp.int32), w, gate, up, down


def _loss(barrier, x, ids, w, gate, up, down):
  y, _ = moe.dispatch(x, ids, w, gate, up, down, *settings(E, K, grad_barrier=barrier, block_rows=16))
  return jnp.sum(jnp.sin(y)), y


@pytest.fixture(scope="module")
def grads():
  args = _inputs()
  out = {}
  for barrier in (True, False):
    fn = jax.jit(jax.value_and_grad(functools.partial(_loss, barrier), argnums=(0, 2, 3, 4, 5), has_aux=True))
    out[barrier] = fn(*args)
  return args, out


def test_bit_identical_forward_and_gradients(grads):
  _, out = grads
  (loss_on, y_on), g_on = out[True]
  (loss_off, y_off), g_off = out[False]
  np.testing.assert_array_equal(np.asarray(y_on), np.asarray(y_off))
  np.testing.assert_array_equal(np.asarray(loss_on), np.asarray(loss_off))
  for a, b in zip(g_on, g_off):
    assert np.any(np.asarray(a) != 0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Expert 3 got no token: its kernel gradients are exactly zero either way.
  assert not np.any(np.asarray(g_on[2])[3]) and not np.any(np.asarray(g_on[4])[3])


def _lowered(barrier, grad: bool) -> str:
  args = _inputs()
  loss = functools.partial(_loss, barrier)
  f = jax.grad(lambda *a: loss(*a)[0], argnums=(0, 3, 4, 5)) if grad else loss
  return jax.jit(f).lower(*args).as_text()


def test_the_barrier_is_in_the_backward_only():
  text = _lowered(True, grad=True)
  lines = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
  assert len(lines) == 1
  sig = lines[0].split(" : ", 1)[1]
  # Over the cotangent of the experts' input rows [N * K, D] and the three kernels' cotangents.
  assert sig.count(f"tensor<{N * K}x{D}xf32>") == 1
  assert sig.count(f"tensor<{E}x{D}x{F}xf32>") == 2 and sig.count(f"tensor<{E}x{F}x{D}xf32>") == 1
  # Controls: none in the forward, none with the barrier off.
  assert "optimization_barrier" not in _lowered(True, grad=False)
  assert "optimization_barrier" not in _lowered(False, grad=True)


def test_the_barrier_function_is_identity_with_the_same_gradient():
  x, _, _, gate, up, down = _inputs()
  f = lambda x, ks: jnp.sum(x ** 2) + sum(jnp.sum(jnp.cos(k)) for k in ks)  # noqa: E731
  with_barrier = jax.grad(lambda x, ks: f(*moe.expert_grad_barrier(x, ks)), argnums=(0, 1))(x, (gate, up, down))
  plain = jax.grad(f, argnums=(0, 1))(x, (gate, up, down))
  for a, b in zip(jax.tree.leaves(with_barrier), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The arms of the mesh test: (grad_barrier, grad_reduce_barrier).
ARMS = ((True, False), (False, False), (True, True))


def _layer_barrier(text: str, x_shape: str) -> list[str]:
  """The operands' sharding constraints of the lowered program's barriers over the layer input's cotangent."""
  lines = text.splitlines()
  out = []
  for line in lines:
    if "stablehlo.optimization_barrier" in line and f"tensor<{x_shape}xf32>" in line.split(" : ", 1)[1]:
      for op in line.split("=", 1)[1].split(" : ")[0].replace("stablehlo.optimization_barrier", "").split(","):
        defs = [d for d in lines if d.strip().startswith(op.strip() + " = ")]
        out.append(re.search(r"<@mesh, (\[.*?\])>", defs[0]).group(1) if "sharding_constraint" in defs[0] else "?")
  return out


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_bit_identical_under_a_mesh(mode):
  """Inside the shard_map dispatch (fsdp=2, both shard modes): the layer's loss and every gradient
  are bit-identical with and without the barrier and with grad_reduce_barrier (reduce_barrier), the expert
  barrier is in the backward, and reduce_barrier's ties the layer input's cotangent to the kernels' cotangents in
  their parameter layout (gate/up embed over fsdp, down its embed)."""
  from jax.sharding import NamedSharding

  from meshlm.config import load_config
  from meshlm.parallel.mesh import make_mesh
  from meshlm.parallel.sharding import logical_spec
  spec = moe.moe_spec(D, E, F, kernel_fsdp="embed")
  x, _, _, gate, up, down = _inputs()
  p = {"router": 0.3 * jax.random.normal(jax.random.key(1), (D, E)), "gate": gate, "up": up, "down": down}
  mesh = make_mesh(load_config("cpu_devices=2", "mesh.fsdp=2", f"shard_mode={mode}"))
  kernel_axes = tuple(spec[n].axes for n in ("gate", "up", "down"))

  def loss(arm, p, x):
    if arm[1]:  # what the moe part does with grad_reduce_barrier
      p, x = moe.reduce_barrier(p, x, kernel_axes)
    y, side = moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True,
                                                      block_rows=16, grad_barrier=arm[0], kernel_axes=kernel_axes))
    return jnp.sum(jnp.sin(y)) + side["moe_load_balance_loss"]
  got, texts = {}, {}
  with jax.set_mesh(mesh):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
    ps = {k: put(v, spec[k].axes) for k, v in p.items()}
    xs = put(x.reshape(4, N // 4, D), ("batch", "length", "act_embed"))
    for arm in ARMS:
      fn = jax.jit(jax.value_and_grad(functools.partial(loss, arm), argnums=(0, 1)))
      texts[arm] = fn.lower(ps, xs).as_text()
      got[arm] = fn(ps, xs)
  assert "optimization_barrier" in texts[True, False] and "optimization_barrier" not in texts[False, False]
  x_shape = f"4x{N // 4}x{D}"
  # The layer input's cotangent [4, N / 4, D] (router's and dispatch's parts summed) and the three kernels' in
  # their parameter layout, pinned. Control: no such barrier without the key.
  assert _layer_barrier(texts[True, True], x_shape)[1:] == ['[{}, {"fsdp"}, {}]'] * 2 + ['[{}, {}, {"fsdp"}]']
  assert _layer_barrier(texts[True, False], x_shape) == []
  ref = jax.tree.leaves(got[True, False])
  assert len(ref) == 6
  for arm in ARMS[1:]:
    for a, b in zip(jax.tree.leaves(got[arm]), ref):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernels_left_in_their_stacks_are_not_barred():
  """reduce_barrier skips a layer whose kernels are StackRow (an unrolled layer's row read in place; the expert
  barrier skips them too): no barrier at all; the same layer with sliced kernels has both."""
  from meshlm.nn.stack_row import StackRow
  x, _, _, gate, up, down = _inputs()
  p = {"router": 0.3 * jax.random.normal(jax.random.key(1), (D, E)), "gate": gate, "up": up, "down": down}
  stacks = {n: jnp.stack([p[n], p[n]]) for n in ("gate", "up", "down")}
  rows = dict(p, **{n: StackRow(a, 1) for n, a in stacks.items()})
  s = settings(E, K, norm_topk_prob=True, grouped_matmul="loop")

  def barriers(params: dict) -> int:
    f = jax.grad(lambda x: jnp.sum(moe.moe_mlp(*moe.reduce_barrier(params, x), None, *s)[0]))
    return jax.jit(f).lower(x.reshape(2, N // 2, D)).as_text().count("stablehlo.optimization_barrier")
  assert barriers(rows) == 0
  assert barriers(p) == 2


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")
def test_tpu_each_layers_kernel_gradients_are_reduced_apart():
  """Two MoE layers compiled for two v5p chips (fsdp=2, kernels' embed on fsdp, gradients out in the parameter
  layout). Without grad_reduce_barrier XLA:TPU waits and reduces both layers' whole float32 gate and up gradients
  in one collective (the later layer's held live over the earlier layer's backward); with it, no gradient
  collective holds more than one layer's kernels."""
  from jax.sharding import NamedSharding

  from meshlm.config import load_config
  from meshlm.parallel import topology as TP
  from meshlm.parallel.mesh import make_mesh
  from meshlm.parallel.sharding import logical_spec
  Lt, Tt, Dt, Ft = 2, 128, 128, 256  # the TPU's (8, 128) tiles
  spec = moe.moe_spec(Dt, E, Ft, kernel_fsdp="embed")
  mesh = make_mesh(load_config("mesh.fsdp=2"), devices=TP.devices(TP.parse("v5p:2x1x1")))
  axes = tuple(spec[n].axes for n in ("gate", "up", "down"))

  def loss(barrier, ps, x):
    for p in ps:
      pb, xb = moe.reduce_barrier(p, x, axes) if barrier else (p, x)
      x = x + moe.moe_mlp(pb, xb, None, *settings(E, K, norm_topk_prob=True,
                                                        grouped_matmul="ragged", kernel_axes=axes))[0]
    return jnp.sum(x.astype(jnp.float32) ** 2)
  most = {}
  with jax.set_mesh(mesh):
    S = lambda shape, axes, dt=jnp.float32: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dt, sharding=NamedSharding(mesh, logical_spec(axes, shape, mesh)))
    ps = [{n: S(spec[n].shape, spec[n].axes) for n in spec} for _ in range(Lt)]
    x = S((2, Tt, Dt), ("batch", "length", "act_embed"), jnp.bfloat16)
    for barrier in (False, True):
      fn = jax.jit(jax.grad(functools.partial(loss, barrier)), out_shardings=[{n: a.sharding for n, a in p.items()}
                                                                           for p in ps])
      hlo = fn.lower(ps, x).compile().as_text()
      ops = [line.split(" = ", 1)[1] for line in hlo.splitlines()
             if re.search(r" (all-reduce|reduce-scatter)(-start)?\(", line)]
      # The most gate/up-shaped float32 gradients ([E, D, F]) one collective reduces.
      most[barrier] = max(op.split(" all-")[0].split(" reduce-")[0].count(f"f32[{E},{Dt},{Ft}]") for op in ops)
  assert most == {False: 2 * Lt, True: 2}


def test_the_key_reaches_the_layer_and_is_off_by_default():
  """model.parts.moe.grad_reduce_barrier is off by default; on, the part's backward holds reduce_barrier's
  optimization barrier beside the expert barrier (control: one barrier without the key); a bad value is refused."""
  import types

  from meshlm.config import load_config
  from meshlm.errors import ConfigError
  from meshlm.models.ffns import moe as part
  from meshlm.models.model import resolve
  from meshlm.nn.dense import dense

  def barriers(*overrides) -> int:
    m = resolve(load_config("model=mixtral-tiny", *overrides)).m
    p = {n: jnp.zeros(s.shape) for n, s in part.moe_spec(m).items()}
    ctx = types.SimpleNamespace(model=m, dense=dense, layer={}, cast=lambda w, dt: w.astype(dt))
    f = jax.grad(lambda x: jnp.sum(part.apply(dict(p, router_full=None), x, ctx)[0]))
    return jax.jit(f).lower(jnp.ones((2, 8, m.embed_dim))).as_text().count("stablehlo.optimization_barrier")
  assert part.knobs(resolve(load_config("model=mixtral-tiny")).m).grad_reduce_barrier is False
  assert barriers() == 1
  assert barriers("model.parts.moe.grad_reduce_barrier=true") == 2
  with pytest.raises(ConfigError, match=r"^model\.parts\.moe\.grad_reduce_barrier: "):
    resolve(load_config("model=mixtral-tiny", "model.parts.moe.grad_reduce_barrier=maybe"))


def test_the_part_bars_the_shared_experts_use_of_x_too():
  """The moe part applies reduce_barrier before the router and the shared expert, so x's gradient sums the
  router's, dispatch's and shared expert's parts in the order it does without the barrier: bit-identical
  (control: the barrier inside moe_mlp, the shared expert's part added after it, moves x's gradient)."""
  import types

  from meshlm.config import load_config
  from meshlm.models.ffns import moe as part
  from meshlm.models.model import resolve
  from meshlm.nn.dense import dense
  models = {on: resolve(load_config("model=qwen3.5-moe-tiny", f"model.parts.moe.grad_reduce_barrier={on}")).m
            for on in ("false", "true")}
  m = models["false"]
  spec = part.spec_with_shared(m)
  keys = jax.random.split(jax.random.key(2), len(spec) + 1)
  p = {n: 0.3 * jax.random.normal(k, s.shape) for k, (n, s) in zip(keys, spec.items())}
  x = jax.random.normal(keys[-1], (2, 16, m.embed_dim))

  def grad_x(on: bool, inside: bool = False):
    ctx = types.SimpleNamespace(model=models["true" if on and not inside else "false"], dense=dense, layer={},
                                cast=lambda w, dt: w.astype(dt))

    def f(x):
      if inside:  # the control: the barrier around the routed experts' layer only, the shared expert outside it
        own, opts = part.knobs(ctx.model), part.options(ctx.model, ctx)
        y = moe.moe_mlp(*moe.reduce_barrier(p, x, opts.kernel_axes), ctx, own, opts, router_full=None)[0] + part.shared_expert(
            p, x, ctx)
      else:
        y = part.apply(dict(p, router_full=None), x, ctx, shared=True)[0]
      return jnp.sum(jnp.sin(y))
    return np.asarray(jax.jit(jax.grad(f))(x))
  off = grad_x(False)
  np.testing.assert_array_equal(grad_x(True), off)
  assert np.any(grad_x(True, inside=True) != off)
