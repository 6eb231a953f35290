"""Two processes x 2 CPU devices (jax.distributed, gloo collectives) train (and validate) like one process x 4.

Every run here is the plain `meshlm train` (or its `train()`), with nothing test-only in the data:
the sequence of global batches depends on the data config and the global batch only, and each process
reads its rows of each batch. So 2 x 2 and 1 x 4 see the same batches, and a checkpoint written by
either resumes on the other at the same data position. Two 2-process runs cover both shard modes: one from
scratch under auto, one from a checkpoint under explicit, each handing over to (or from) one process. `meshlm rl`
on two processes samples, rewards and trains like one.

Ports: the coordinator's port is held by this test from the moment it is picked until the processes
exit (see _held_port), so no other program on the machine can take it in between.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

MESHLM = os.path.join(os.path.dirname(sys.executable), "meshlm")
STEPS = 10
BASE = ["model.embed_dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32",
        "model.mlp_dim=128", "model.num_layers=1", "train.per_device_batch_size=1", "train.seq_len=32",
        "train.sample_tokens=0", "mesh.fsdp=4", "data.source=synthetic", "train.compute_dtype=float32",
        f"train.steps={STEPS}",
        # A validation set (plain text rows, bytes): its loss after every other step, compared like the loss.
        f"eval.path={os.path.join(os.path.dirname(__file__), 'fixtures', 'validation.jsonl')}", "eval.every=2",
        "eval.batches=2"]
# The gloo all-reduce sums the processes' partial gradients in another order than one process does.
ATOL = 1e-5


@contextlib.contextmanager
def _held_port():
  """A free port for the coordinator, reserved until the block ends.

  Binding port 0, closing and passing the number on leaves a window in which any program on the
  machine may be handed the same port (parallel tests do this all the time). Instead the socket stays
  bound, not listening, with SO_REUSEADDR: Linux then lets process 0 bind the port too (its
  free-port check and the coordinator's gRPC listener both set SO_REUSEADDR, and only a listening
  socket blocks them), while the kernel hands the port to no one else, neither as an ephemeral port
  nor to a plain bind. jax.distributed cannot take port 0 itself: every process needs the number
  before it starts.
  """
  s = socket.socket()
  s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  s.bind(("127.0.0.1", 0))
  try:
    yield s.getsockname()[1]
  finally:
    s.close()


def _two_processes(run_dir, tmp_path, *extra: str, command: str = "train", base: tuple = tuple(BASE)) -> None:
  """`meshlm COMMAND` (train or rl) as process 0 and 1 of 2, each with 2 CPU devices; asserts both exit 0."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  name = os.path.basename(run_dir)
  with _held_port() as port:
    procs, logs = [], []
    for i in range(2):
      log = open(tmp_path / f"{name}-process{i}.log", "w+")
      procs.append(subprocess.Popen(
          [MESHLM, command, *base, *extra, "cpu_devices=2", f"run_dir={run_dir}",
           f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
           f"distributed.process_id={i}", "distributed.timeout_s=120"], env=env, stdout=log, stderr=subprocess.STDOUT))
      logs.append(log)
    try:
      for p, log in zip(procs, logs):
        rc = p.wait(timeout=300)
        log.seek(0)
        assert rc == 0, log.read()[-3000:]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()


def _one_process(run_dir, *extra: str, data=None):
  """`train()` on 4 of this process's CPU devices, as `meshlm train cpu_devices=4` runs it (data: only
  for the negative control)."""
  from rich.console import Console
  from meshlm.config import load_config
  from meshlm.train.loop import train
  cfg = load_config(*BASE, *extra, "cpu_devices=4", f"run_dir={run_dir}")
  return train(cfg, console=Console(file=open(os.devnull, "w")), show_progress=False, data=data)


def _metrics(run_dir, key: str = "loss") -> dict[int, float]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    # Keyed by the step's index: a record's `step` counts the updates done, from 1.
    return {r["step"] - 1: r[key] for r in map(json.loads, filter(str.strip, f)) if key in r}


def _data_state(run_dir, step: int) -> dict:
  with open(os.path.join(run_dir, "checkpoints", str(step), "data", "metadata")) as f:
    return json.load(f)["state"]


SAMPLE = "train.sample_tokens=8"  # the end-of-run sample (temperature 0.7, seeded by train.seed)


@pytest.fixture(scope="module")
def explicit_reference(tmp_path_factory):
  """(run_dir, losses, end-of-run sample) of the 1 x 4 explicit run: the reference of every train test here."""
  run_dir = tmp_path_factory.mktemp("ref") / "one"
  result = _one_process(run_dir, "shard_mode=explicit", SAMPLE)
  return run_dir, result.losses, result.sample


def test_two_processes_train_and_resume_like_one_process(explicit_reference, tmp_path):
  """2 -> 1 and 1 -> 2 processes, each stopped after K steps, against the uninterrupted 1 x 4 explicit run: its
  losses at every step, and its data position at the end.

  - 2 processes from scratch under shard_mode=auto for K steps, both joining one checkpoint, which 1 process
    resumes under explicit (checkpoints restore onto any mesh and mode). One process gives the same losses under
    both modes (tests/test_train.py's test_explicit_equals_auto[fsdp4]), so a bug in auto alone fails here.
  - 1 process (explicit) for K steps, then 2 processes under explicit to the end, joining the last checkpoint
    and drawing the end-of-run sample, which every process draws (generate gathers its tokens onto each): the
    1 x 4 run's, in both processes' logs.
  So two processes train steps 0..K-1 from scratch under auto and K..end from a checkpoint under explicit, each
  step checked against one process."""
  ref_dir, ref, sample = explicit_reference
  k = 4
  # 2 processes (auto) stop after k steps; 1 process (explicit) continues.
  two_one = tmp_path / "two-then-one"
  _two_processes(two_one, tmp_path, "shard_mode=auto", f"train.stop_after={k}")
  assert sorted(os.listdir(two_one / "checkpoints")) == [str(k)]  # both processes joined one checkpoint
  resumed = _one_process(two_one, "shard_mode=explicit")
  assert resumed.start_step == k
  # 1 process stops after k steps; 2 processes continue to the end and sample.
  one_two = tmp_path / "one-then-two"
  first = _one_process(one_two, "shard_mode=explicit", f"train.stop_after={k}")
  assert first.stop_reason == "stop_after" and first.losses == ref[:k]
  late = tmp_path / "late"  # for the negative control below
  shutil.copytree(one_two, late)
  _two_processes(one_two, tmp_path, "shard_mode=explicit", SAMPLE)
  for run_dir in (two_one, one_two):
    got = _metrics(run_dir)
    assert sorted(got) == list(range(STEPS)), run_dir  # process 0 alone writes the metrics
    np.testing.assert_allclose([got[s] for s in range(STEPS)], ref, rtol=0, atol=ATOL, err_msg=str(run_dir))
    assert _data_state(run_dir, STEPS) == _data_state(ref_dir, STEPS), run_dir
    # The validation loss, measured by 2 processes x 2 devices at some steps and by 1 x 4 at the others.
    val, ref_val = _metrics(run_dir, "val_loss"), _metrics(ref_dir, "val_loss")
    assert sorted(val) == sorted(ref_val) == [1, 3, 5, 7, 9], (val, ref_val)
    np.testing.assert_allclose([val[s] for s in ref_val], list(ref_val.values()), rtol=0, atol=ATOL)
    print(f"{run_dir.name}: max |loss difference| to 1x4 {max(abs(got[s] - ref[s]) for s in range(STEPS)):.3g}, "
          f"bit-identical: {[got[s] for s in range(STEPS)] == ref}")
  from meshlm.console import printable
  for i in range(2):
    log = (tmp_path / f"one-then-two-process{i}.log").read_text()
    assert "sample (" in log and printable(sample) in log, log[-2000:]
  # Negative control: the losses tell data positions apart. The 1-process checkpoint at step k,
  # resumed one batch late, is off by far more than ATOL at its first step.
  from meshlm.config import load_config
  from meshlm.train.data import make_dataset
  cfg = load_config(*BASE, "cpu_devices=4")
  it = _OneBatchLate(make_dataset(cfg, global_batch=4, seq_len=cfg.train.seq_len))
  off = _one_process(late, "shard_mode=explicit", "train.stop_after=1", data=it).losses
  assert abs(off[0] - ref[k]) > 100 * ATOL, (off, ref[k])


class _OneBatchLate:
  """A data iterator that resumes one batch after the checkpoint's position."""

  def __init__(self, it):
    self.it = it

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.it)

  def get_state(self):
    return self.it.get_state()

  def set_state(self, state):
    self.it.set_state(state)
    next(self.it)


# --- RL: `meshlm rl` as two processes samples, rewards and trains like one process -------------------------

# The property is generate's cross-process gather and one batch on every process, not a part: the dense model of
# the train tests above (one layer, embed 64) with the byte vocabulary, whose programs cost a third of a small MoE's
# in each of the two processes; a reward that the untrained model's random completions sometimes earn (the toy
# task's reward is 0 for all of them), so the advantages are not all zero. Router replay across processes is the
# replayed ids' gather: tests/test_rollout.py samples them with the rows sharded over one process's 2 devices
# (explicit and auto), and tests/test_rl.py feeds them to the RL step on 4.
RL_BASE = ("model=llama2-tiny", "model.num_layers=1", "model.embed_dim=64", "model.num_heads=2", "model.num_kv_heads=1",
           "model.head_dim=32", "model.mlp_dim=128", "model.vocab_size=257", "model.max_position=64",
           "train.compute_dtype=float32", "train.seq_len=32", "mesh.fsdp=4", "train.steps=3",
           "rl.prompts_per_step=2", "rl.num_generations=4", "rl.max_new_tokens=6", "rl.temperature=0.7",
           "rl.reward=[regex]", "rl.reward_regex=a|e|i|o|u|x", "train.learning_rate=1e-2", "train.warmup_steps=0")


def _rl_records(run_dir) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_rl_two_processes_match_one_process(tmp_path):
  """Rollouts are sampled on the global mesh and fetched whole on every process (generate gathers its outputs
  across processes); each process then builds the same batch. 2 x 2 and 1 x 4 draw the same completions (the
  same rewards) and take the same steps (gradient norms within float32 reassociation). Control: another seed
  on one process draws other completions."""
  from rich.console import Console
  from meshlm.commands.resolve import load_config
  from meshlm.rl import toy
  from meshlm.rl import trainer as TR
  prompts, _ = toy.write(str(tmp_path / "toy"), 16, 0, 3, 6)
  base = (*RL_BASE, f"rl.prompts={prompts}")
  _two_processes(tmp_path / "two", tmp_path, command="rl", base=base)
  two = _rl_records(tmp_path / "two")
  quiet = Console(file=open(os.devnull, "w"))
  one = TR.run(load_config(*base, "cpu_devices=4", f"run_dir={tmp_path / 'one'}"), console=quiet,
               show_progress=False).records
  other = TR.run(load_config(*base, "cpu_devices=4", "train.seed=1", f"run_dir={tmp_path / 'seed1'}"),
                 console=quiet, show_progress=False).records
  assert len(two) == len(one) == 3
  rewards = lambda rs: [r["reward_mean"] for r in rs]  # noqa: E731
  norms = lambda rs: np.array([r["grad_norm"] for r in rs])  # noqa: E731
  print(f"rl 1x4 vs 2x2: rewards {rewards(one)} / {rewards(two)}; max |grad norm difference| "
        f"{np.max(np.abs(norms(one) - norms(two))):.3g} of {norms(one).tolist()}")
  assert rewards(two) == rewards(one)
  assert [r["reward_std"] for r in two] == [r["reward_std"] for r in one]
  assert min(r["groups_degenerate"] for r in one) < 2  # some group's rewards differ: its advantages are not 0
  np.testing.assert_allclose(norms(two), norms(one), rtol=1e-5)
  assert rewards(other) != rewards(one) or np.max(np.abs(norms(other) - norms(one))) > 1e-3
