"""Model state: non-trainable leaves a layer part declares (Part.model_state) with an after-step rule.

The leaf changes only through its rule, never through the optimizer (it is not in the parameters the
optimizer sees); a checkpoint holds it beside the parameters; 10 + 10 steps equal 20 bit for bit, the
leaf included.
"""
import jax
import numpy as np
import pytest

import statekind
from meshlm.config import load_config
from meshlm.models import decoder, registry
from meshlm.models.params import merge_state, model_state_specs
from meshlm.train import step as ST

from seams import random_batch

# Only the final norm trains: the leaf moves by its rule from the forward's side outputs, and a backward through
# the layers' kernels (the train step's, not the model state's) would triple each step's compile. Frozen by name,
# kernel by kernel: a leaf of the ema's path that the optimizer saw would still train.
FROZEN = (r"train.freeze=['embed', 'lm_head', 'layers\.dense\.attn\..*', 'layers\.dense\.mlp\.(gate|up|down)', "
          r"'layers\.dense\..*_norm']")
BASE = ("model=llama2-tiny", "model.family=statekind", "cpu_devices=2", "mesh.fsdp=2", "train.compute_dtype=float32",
        "train.seq_len=16", "train.per_device_batch_size=1", "train.warmup_steps=0", "train.sample_tokens=0",
        "data.source=synthetic", "train.log_every=1", FROZEN)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
  monkeypatch.setitem(registry.FAMILIES, "statekind", "statekind")


@pytest.fixture(scope="module")
def stepped():
  """(cfg, the step, the state before, after one step, after three) and the side outputs of the first
  step's forward, computed apart from the step."""
  mp = pytest.MonkeyPatch()
  mp.setitem(registry.FAMILIES, "statekind", "statekind")
  try:
    cfg = load_config(*BASE, "train.steps=3")
    step = ST.build_train_step(cfg)
    state = step.init_state(jax.random.key(0))
    batch = random_batch(step)
    before = jax.tree.map(np.asarray, state)
    with jax.set_mesh(step.mesh):
      _, side = jax.jit(lambda p, b: decoder.forward(cfg, p, b["inputs"], b["positions"], b["segment_ids"],
                                                     return_side=True))(
          merge_state(state.params, state.model_state), batch)
    side = np.asarray(side["mean_sq"])
    states = []
    for _ in range(3):
      state, _ = step(state, batch)
      states.append(jax.tree.map(np.asarray, state))
    return cfg, step, before, states, side
  finally:
    mp.undo()


def _ema(state):
  return state.model_state["layers"]["dense"]["mlp"]["ema"]


def test_the_leaf_is_model_state_not_a_parameter(stepped):
  cfg, step, before, _, _ = stepped
  assert model_state_specs(cfg)["layers"]["dense"]["mlp"]["ema"].shape == (cfg.model.num_layers, 1)
  assert "ema" not in before.params["layers"]["dense"]["mlp"]
  assert not any("ema" in p for p in jax.tree.leaves(ST.param_paths(cfg)))  # the optimizer never sees it
  np.testing.assert_array_equal(_ema(before), 0.0)


def test_the_leaf_moves_by_its_rule(stepped):
  _, _, before, states, side = stepped
  want = statekind.RATE * _ema(before) + (1 - statekind.RATE) * side[:, None]
  np.testing.assert_allclose(_ema(states[0]), want, rtol=1e-6)
  assert np.all(_ema(states[0]) > 0) and not np.array_equal(_ema(states[1]), _ema(states[0]))


def test_with_the_identity_rule_the_leaf_never_moves(monkeypatch):
  """Control: the leaf feeds the forward (it has a gradient), yet with the identity rule it stays at
  its start through three steps: nothing but the rule moves it. The trained parameter does move."""
  monkeypatch.setitem(statekind.RULE, "fn", lambda leaves, side, m: leaves)
  step = ST.build_train_step(load_config(*BASE, "train.steps=3"))
  state = step.init_state(jax.random.key(0))
  batch = random_batch(step)
  norm0 = np.asarray(state.params["final_norm"])
  for _ in range(3):
    state, _ = step(state, batch)
  np.testing.assert_array_equal(_ema(state), 0.0)
  assert not np.array_equal(np.asarray(state.params["final_norm"]), norm0)


def test_ten_plus_ten_steps_equal_twenty_bit_for_bit(tmp_path):
  from meshlm.train.loop import train
  whole = train(load_config(*BASE, "train.steps=20", f"run_dir={tmp_path / 'whole'}"), show_progress=False)
  run = tmp_path / "halves"
  halves = load_config(*BASE, "train.steps=20", "train.stop_after=10", f"run_dir={run}")
  first = train(halves, show_progress=False)
  second = train(halves, show_progress=False)  # the identical command continues
  assert second.start_step == 10
  assert first.losses + second.losses == whole.losses
  a, b = jax.tree.map(np.asarray, whole.state), jax.tree.map(np.asarray, second.state)
  np.testing.assert_array_equal(_ema(b), _ema(a))
  assert np.all(_ema(a) > 0)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(x, y)
