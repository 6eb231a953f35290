"""Training: explicit equals auto, layer-stack variants, micro-batches, loss, schedule, run directory.

Short runs of the real loop (`meshlm.train.loop.train`) in float32. Each distinct config compiles
one train step, so runs are shared between tests through a module-level cache.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.train.loop import train
from meshlm.train.optimizer import schedule
from meshlm.nn.head_loss import materialized_logprobs
from meshlm.train.step import build_train_step, grads_and_loss

STEPS = 5
# llama2-tiny, float32, 4 devices, a short sequence and full learning rate from the first step.
BASE = ("model=llama2-tiny", "cpu_devices=4", "train.compute_dtype=float32", "train.seq_len=32",
        "train.per_device_batch_size=1", f"train.steps={STEPS}", "train.warmup_steps=0",
        "train.sample_tokens=0", "data.source=synthetic")
MESHES = {
    "fsdp4": ("mesh.fsdp=4",),
    "data2_fsdp2": ("mesh.data=2", "mesh.fsdp=2"),
    "fsdp2_tensor2": ("mesh.fsdp=2", "mesh.tensor=2"),
}
# Float32 reassociation only; a sharding bug moves the loss by 1e-3 or more.
PARITY_ATOL = 1e-5
# Micro-batched vs whole-batch gradient, relative to its norm per leaf (measured about 1e-6).
UPDATE_RTOL = 2e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """run(*overrides) -> (TrainResult, run_dir), trained once per distinct override list."""
  cache = {}
  def get(*overrides: str):
    if overrides not in cache:
      run_dir = str(tmp_path_factory.mktemp("run"))
      cfg = load_config(*BASE, *overrides, f"run_dir={run_dir}")
      cache[overrides] = (train(cfg, show_progress=False), run_dir)
    return cache[overrides]
  return get


def _max_diff(a, b) -> float:
  return max(abs(x - y) for x, y in zip(a, b))


# --- explicit equals auto ----------------------------------------------------------------------

# fsdp=4 is tests/test_conformance.py's llama2-tiny row (3 float32 steps of packed documents under a ragged loss
# mask); here the meshes with a data or a tensor axis.
@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "fsdp4"])
def test_explicit_equals_auto(run, mesh):
  explicit, _ = run("shard_mode=explicit", *MESHES[mesh])
  auto, _ = run("shard_mode=auto", *MESHES[mesh])
  assert len(explicit.losses) == len(auto.losses) == STEPS
  print(f"explicit vs auto, {mesh}, float32: max |loss diff| = {_max_diff(explicit.losses, auto.losses):.3g}")
  np.testing.assert_allclose(explicit.losses, auto.losses, rtol=0, atol=PARITY_ATOL)
  np.testing.assert_allclose(explicit.grad_norms, auto.grad_norms, rtol=1e-4)


REF_MESH = "fsdp4"


@pytest.mark.parametrize("mesh", [m for m in MESHES if m != REF_MESH])
def test_meshes_agree_with_each_other(run, mesh):
  """Every other mesh trains the same model on the same data as fsdp=4: the losses agree across meshes."""
  ref, ref_dir = run("shard_mode=explicit", *MESHES[REF_MESH])
  other, other_dir = run("shard_mode=explicit", *MESHES[mesh])
  # Two different runs on two different meshes (comparing a run with itself would prove nothing).
  meshes = [yaml.safe_load(open(os.path.join(d, "config.yaml")))["mesh"] for d in (ref_dir, other_dir)]
  assert ref_dir != other_dir and meshes[0] != meshes[1], meshes
  print(f"{mesh} vs {REF_MESH}, explicit, float32: max |loss diff| = {_max_diff(other.losses, ref.losses):.3g}")
  np.testing.assert_allclose(other.losses, ref.losses, rtol=0, atol=PARITY_ATOL)


def test_short_run_learns(run):
  result, _ = run("shard_mode=explicit", *MESHES["fsdp4"])
  assert all(np.isfinite(result.losses))
  # Untrained byte-level loss is about ln(512) = 6.24; synthetic sequences are quick to pick up.
  assert result.losses[0] == pytest.approx(np.log(512), abs=0.5)
  assert result.losses[-1] < result.losses[0] - 0.5, result.losses


# The auto run is test_explicit_equals_auto's on data=2 x fsdp=2 (an auto run on fsdp=4 would compile a step for
# this test alone, now that fsdp=4's explicit == auto is test_conformance's).
@pytest.mark.parametrize("mode, mesh, expected", [("explicit", "fsdp4", True), ("auto", "data2_fsdp2", False)])
def test_run_dir_holds_the_resolved_config(run, mode, mesh, expected):
  _, run_dir = run(f"shard_mode={mode}", *MESHES[mesh])
  saved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
  assert saved["shard_mode"] == mode
  assert saved["lm_head_weight_grad_in_kernel_order"] is expected
  assert saved["dense_weight_grad_in_kernel_order"] is expected
  want = {k.split("=")[0].removeprefix("mesh."): int(k.split("=")[1]) for k in MESHES[mesh]}
  assert saved["train"]["steps"] == STEPS and {k: saved["mesh"][k] for k in want} == want


def test_metrics_jsonl(run):
  result, run_dir = run("shard_mode=explicit", *MESHES["fsdp4"])
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the updates done, as the console counts
  for r, loss, norm in zip(records, result.losses, result.grad_norms):
    assert {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm"} <= set(r)
    assert r["loss"] == loss and r["grad_norm"] == norm and r["grad_norm"] > 0
    assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
  assert records[0]["time_to_first_step_s"] == pytest.approx(result.first_step_s)


# --- layer-stack variants ----------------------------------------------------------------------

# Each run compiles a train step (~10 s of CPU), so the choices are paired: between them the two
# runs cover scan vs unrolled, the layer axis at 1 through both code paths (scan's moveaxis and the
# unrolled per-layer index), and remat full and dots, each against llama2-tiny as shipped (unrolled,
# axis 0, no remat). The preset sets scan_layers: false, so the scanned variant says scan_layers=true
# (without it both variants ran unrolled, and scan's path was not compared here).
STACK_VARIANTS = {
    "unrolled_axis1_remat_dots": ("scan_layers=false", "param_scan_axis=1", "remat=dots"),
    "scan_axis1_remat_full": ("scan_layers=true", "param_scan_axis=1", "remat=full"),
}


@pytest.mark.parametrize("variant", list(STACK_VARIANTS))
def test_stack_variants_train_to_the_same_loss(run, variant):
  """scan vs unrolled, layer axis 0 vs 1, remat none/full/dots: the same function and gradient."""
  ref, _ = run("shard_mode=explicit", *MESHES["fsdp4"])
  got, _ = run("shard_mode=explicit", *MESHES["fsdp4"], *STACK_VARIANTS[variant])
  print(f"{variant} vs unrolled/axis 0/no remat: max |loss diff| = {_max_diff(got.losses, ref.losses):.3g}")
  np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-6, atol=0)
  np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-5)


# --- micro-batches -----------------------------------------------------------------------------

MICRO_ROWS, MICRO_LEN = 8, 16


def _micro_batch() -> dict:
  """8 rows with a ragged loss mask, so micro-batches hold different numbers of counted tokens:
  the accumulated sum must be normalized by the whole batch's count, not each micro-batch's."""
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 256, (MICRO_ROWS, MICRO_LEN + 1)).astype(np.int32)
  mask = (rng.random((MICRO_ROWS, MICRO_LEN)) < np.linspace(0.2, 1.0, MICRO_ROWS)[:, None]).astype(np.float32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones(mask.shape, np.int32),
          "positions": np.tile(np.arange(MICRO_LEN, dtype=np.int32), (MICRO_ROWS, 1)), "loss_mask": mask}


def _gradients(micro_batches: int):
  """(loss, gradients) of the real train step's grads_and_loss on fsdp=2, 8 rows in all (one layer of
  llama2-tiny's two: the accumulation and its normalization do not depend on the depth)."""
  cfg = load_config("model.num_layers=1", "cpu_devices=2", "mesh.fsdp=2", "train.per_device_batch_size=4", "train.compute_dtype=float32",
                    f"train.seq_len={MICRO_LEN}", f"train.micro_batches={micro_batches}")
  step = build_train_step(cfg)
  assert step.global_batch == MICRO_ROWS
  state = step.init_state(jax.random.key(0))
  with jax.set_mesh(step.mesh):
    loss, grads, _ = jax.jit(lambda p, b: grads_and_loss(cfg, p, b))(state.params, step.put_batch(_micro_batch()))
  return float(loss), jax.tree.map(lambda g: np.asarray(g, np.float64), grads)


def test_micro_batches_give_the_same_update():
  """4 micro-batches of 2 rows vs 1 batch of 8: the same loss and accumulated gradient.

  The gradient is compared rather than AdamW's parameters: Adam's first step is g / (|g| + eps),
  which divides out the gradient's scale (hiding a wrong normalization) and turns float32 noise in
  gradients near eps into parameter changes of up to the learning rate. Under SGD the update is
  the gradient, which is what micro-batching must preserve.
  """
  l1, g1 = _gradients(1)
  l4, g4 = _gradients(4)
  assert l4 == pytest.approx(l1, rel=1e-6)
  worst = 0.0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g4)):
    name = jax.tree_util.keystr(path)
    # A float32 matmul over 2 rows instead of 8 blocks its sums differently, so about 1e-6 of the
    # gradient's norm is reassociation; a normalization or row-selection bug would be O(1).
    rel = float(np.linalg.norm(b - a) / np.linalg.norm(a))
    worst = max(worst, rel)
    assert rel < UPDATE_RTOL, (name, rel)
    np.testing.assert_allclose(b, a, rtol=0, atol=UPDATE_RTOL * np.max(np.abs(a)), err_msg=name)
  print(f"micro-batches 4x2 vs 1x8: loss diff {abs(l4 - l1):.3g}, "
        f"max per-leaf |grad diff| / |grad| {worst:.3g}")


def test_micro_batches_must_divide_the_batch():
  cfg = load_config("cpu_devices=2", "mesh.fsdp=2", "train.per_device_batch_size=3", "train.micro_batches=4")
  with pytest.raises(ConfigError, match=r"^train.micro_batches=4 must divide the global batch of 6 rows"):
    build_train_step(cfg)


# --- loss and schedule -------------------------------------------------------------------------

def test_materialized_logprobs_match_numpy():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((2, 5, 11)).astype(np.float32) * 3
  targets = rng.integers(0, 11, (2, 5)).astype(np.int32)
  got, ent = materialized_logprobs(jnp.asarray(logits), jnp.asarray(targets), entropy=True)
  x = logits.astype(np.float64)
  logp = x - x.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  ref = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ent), -(np.exp(logp) * logp).sum(-1), rtol=1e-5)
  # Control: the neighbouring token's log-prob is another number.
  assert not np.allclose(np.asarray(got), np.take_along_axis(logp, (targets[..., None] + 1) % 11, -1)[..., 0])


def test_warmup_then_cosine_to_the_floor():
  t = load_config("train.steps=100", "train.warmup_steps=10", "train.learning_rate=1e-3",
                  "train.min_lr_ratio=0.1").train
  lr = schedule(t)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(5e-4)
  assert float(lr(10)) == pytest.approx(1e-3)
  assert float(lr(55)) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-5)  # cosine midpoint
  assert float(lr(100)) == pytest.approx(1e-4)
  # No warmup: the first step already runs at the peak rate.
  no_warmup = schedule(load_config("train.warmup_steps=0", "train.learning_rate=1e-3").train)
  assert float(no_warmup(0)) == pytest.approx(1e-3)


def _loop_events(tmp_path, monkeypatch, *overrides):
  """Runs the loop and returns its order of events: ("D", n) for the n-th dispatched step, ("R", step)
  for a step whose metrics were read (log_every=1 writes one record per read)."""
  from meshlm.train import loop as L
  from meshlm.train.step import TrainStep
  events = []
  call, write = TrainStep.__call__, L.MetricsWriter.write
  def dispatch(self, state, batch):
    events.append(("D", sum(e[0] == "D" for e in events)))
    return call(self, state, batch)
  def read(self, record):
    events.append(("R", record["step"] - 1))  # the step's index (records count the updates done, from 1)
    return write(self, record)
  monkeypatch.setattr(TrainStep, "__call__", dispatch)
  monkeypatch.setattr(L.MetricsWriter, "write", read)
  cfg = load_config(*BASE, "mesh.fsdp=4", "train.steps=8", "train.log_every=1", "checkpoint.every=4",
                    f"run_dir={tmp_path}", *overrides)
  try:
    train(cfg, show_progress=False)
  except ConfigError as e:  # NonFiniteStop
    events.append(("stop", str(e)))
  return events


def test_loop_queues_the_next_step_except_where_the_state_is_needed(tmp_path, monkeypatch):
  """Step i + 1 is dispatched before step i's metrics are read, so the host overlaps the device;
  but never past a step whose state is saved (step 3 here, checkpoint 4) or the last one."""
  events = _loop_events(tmp_path, monkeypatch)
  D, R = (lambda n: ("D", n)), (lambda n: ("R", n))
  assert events == [D(0), D(1), R(0), D(2), R(1), D(3), R(2), R(3),  # checkpoint 4: wait for step 3
                    D(4), D(5), R(4), D(6), R(5), D(7), R(6), R(7)]


def test_loop_does_not_run_past_a_step_that_may_stop_the_run(tmp_path, monkeypatch):
  """With NaN at steps 2 and 3 and max_nonfinite_in_a_row=2, step 3 may stop the run once step 2 is
  non-finite, so nothing is queued behind it and the saved state is the one after step 3."""
  import meshlm.train.data as data_mod
  from seams import Poisoned  # a NaN loss mask on the batches of steps 2 and 3
  make_dataset = data_mod.make_dataset
  monkeypatch.setattr(data_mod, "make_dataset", lambda *a, **k: Poisoned(make_dataset(*a, **k), (2, 3)))
  events = _loop_events(tmp_path, monkeypatch, "train.max_nonfinite_in_a_row=2")
  D, R = (lambda n: ("D", n)), (lambda n: ("R", n))
  assert events[:-1] == [D(0), D(1), R(0), D(2), R(1), D(3), R(2), R(3)]
  assert events[-1][0] == "stop" and "stopped at step 4" in events[-1][1]  # the 4th step, index 3
  assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [4]
