"""train.freeze: frozen parameters get stop_gradient (no weight-gradient work), no optimizer state, and
never change; everything else is bit-identical to differentiating all and zeroing the frozen gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.train import step as ST

from seams import random_batch

BASE = ("model=llama2-tiny", "cpu_devices=2", "mesh.fsdp=2", "train.compute_dtype=float32", "train.seq_len=32",
        "train.per_device_batch_size=2", "train.steps=10")
FREEZE = r"train.freeze=['layers\.dense\.attn\..*', 'embed']"



@pytest.fixture(scope="module")
def runs():
  plain = ST.build_train_step(load_config(*BASE))
  frozen = ST.build_train_step(load_config(*BASE, FREEZE))
  return plain, frozen


def test_frozen_leaves_keep_their_values_and_get_no_optimizer_state(runs):
  _, step = runs
  state = step.init_state(jax.random.key(0))
  before = jax.tree.map(np.asarray, state.params)
  batch = random_batch(step)
  for _ in range(3):
    state, metrics = step(state, batch)
  after = jax.tree.map(np.asarray, state.params)
  paths = ST.param_paths(step.cfg)
  for path, t, b, a in zip(jax.tree.leaves(paths), jax.tree.leaves(step.trainable), jax.tree.leaves(before),
                           jax.tree.leaves(after)):
    if t:
      assert not np.array_equal(a, b), path
    else:
      assert np.array_equal(a, b), path  # bit-unchanged
  # Adam's moments exist only for the trainable leaves.
  n_trainable = sum(jax.tree.leaves(step.trainable))
  moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
  assert len(moments) == 2 * n_trainable < 2 * len(jax.tree.leaves(step.trainable))


def test_equals_differentiating_everything_and_zeroing_the_frozen_gradients(runs):
  plain, step = runs
  state = step.init_state(jax.random.key(0))
  batch = random_batch(step)
  trainable = step.trainable
  full_opt = plain.optimizer

  @jax.jit
  def reference(params, batch):
    loss, grads, _ = ST.grads_and_loss(plain.cfg, params, batch)
    grads = jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), grads, trainable)
    new, _, m = ST.guarded_update(full_opt, params, full_opt.init(params), loss, grads)
    return new, m

  with jax.set_mesh(step.mesh):
    ref_params, ref_m = reference(state.params, batch)
  new_state, m = step(state, batch)
  assert float(m["loss"]) == float(ref_m["loss"]) and float(m["grad_norm"]) == float(ref_m["grad_norm"])
  for t, a, b in zip(jax.tree.leaves(trainable), jax.tree.leaves(new_state.params), jax.tree.leaves(ref_params)):
    if t:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_frozen_weights_emit_no_weight_gradient_dots(runs):
  """Each frozen projection drops its weight-gradient dot: q, k, v and o in 2 layers is 8 fewer dots
  (the embedding is a gather, its gradient a scatter, not a dot)."""
  plain, step = runs
  dots = lambda s: s.lower().as_text().count("stablehlo.dot_general")
  assert dots(plain) - dots(step) == 8


@pytest.mark.parametrize("pattern, msg", [
    ("train.freeze=['.*router.*']", "'.*router.*' matches no parameter"),
    ("train.freeze=['(']", "'(' is not a regular expression"),
])
def test_a_pattern_that_cannot_freeze_anything_is_refused(pattern, msg):
  with pytest.raises(ConfigError) as e:
    ST.build_train_step(load_config(*BASE, pattern))
  assert msg in str(e.value) and str(e.value).startswith("train.freeze: ")
