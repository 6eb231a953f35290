"""Checkpoints, exact resume, preemption, crash safety, the non-finite guard and bad input.

Every run trains one tiny config. The reference is one uninterrupted 20-step run with checkpoint.every=10; every
interrupted variant must reproduce its losses bit for bit. A run that needs a process of its own (a signal, a kill,
the seams of tests/seams.py, jax.distributed) is a real `meshlm train` subprocess; those share one persistent
compilation cache (only the first compiles). Every other command runs in this process (`main()`, as `meshlm train`
calls it: the same exit code and stderr; a process start is about 2 s of CPU, and in this process the step compiles
once for all of them). A resume still crosses a process boundary in each resume test: test_exact_resume's second
run is a subprocess resuming what this process saved, the signal and kill tests resume here what a subprocess saved.
That a refusal is one line and exit 2 from a real process is tests/test_cli.py's.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest


MESHLM = os.path.join(os.path.dirname(sys.executable), "meshlm")
# The real `meshlm train` with test-owned seams (a NaN batch, a signal at a step, a save that hangs).
SEAMS = os.path.join(os.path.dirname(__file__), "seams.py")
STEPS = 20
BASE = ["model.embed_dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32",
        "model.mlp_dim=128", "model.num_layers=1", "train.per_device_batch_size=1", "train.seq_len=32",
        "train.sample_tokens=0", "cpu_devices=2", "mesh.fsdp=2", "data.source=synthetic", "train.compute_dtype=float32",
        f"train.steps={STEPS}", "checkpoint.every=10"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax-cache")
  e = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
           PYTHONUNBUFFERED="1")
  return e


def run(run_dir, *extra, env, check=True, seams=()) -> subprocess.CompletedProcess:
  cmd = [sys.executable, SEAMS, *seams] if seams else [MESHLM, "train"]
  p = subprocess.run([*cmd, *BASE, f"run_dir={run_dir}", *extra], env=env, capture_output=True, text=True,
                     timeout=300)
  if check and p.returncode != 0:
    raise AssertionError(f"meshlm exited {p.returncode}:\n{p.stderr[-3000:]}")
  return p


def run_here(run_dir, *extra, check=False) -> subprocess.CompletedProcess:
  """The same command in this process, through meshlm.cli.main (check=True: it must exit 0, as run's)."""
  from meshlm.cli import main
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(["train", *BASE, f"run_dir={run_dir}", *extra])
  if check and code != 0:
    raise AssertionError(f"meshlm exited {code}:\n{err.getvalue()[-3000:]}")
  return subprocess.CompletedProcess(["meshlm", "train"], code, out.getvalue(), err.getvalue())


def start(run_dir, *extra, env, seams=()) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, SEAMS, *seams, *BASE, f"run_dir={run_dir}", *extra], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metrics(run_dir) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(ln) for ln in f if ln.strip()]


def losses(run_dir) -> list[float]:
  recs = metrics(run_dir)
  assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "each step must appear once, in order"
  return [r["loss"] for r in recs]


def steps_on_disk(run_dir) -> list[int]:
  folder = os.path.join(run_dir, "checkpoints")
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def restore(run_dir, step: int, item: str):
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), item))


def assert_trees_equal(a, b):
  import jax
  la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """20 steps straight, checkpoint.every=10: the losses every other run must match."""
  run_dir = tmp_path_factory.mktemp("ref")
  run_here(run_dir, check=True)
  assert steps_on_disk(run_dir) == [10, 20]
  got = losses(run_dir)
  assert len(got) == STEPS and all(np.isfinite(got))
  return run_dir, got


def test_exact_resume_is_bit_identical(reference, tmp_path, env):
  ref_dir, ref_losses = reference
  first = run_here(tmp_path, "train.stop_after=10", check=True)
  assert "stopped (stop_after) after step 10 of 20" in first.stderr
  assert steps_on_disk(tmp_path) == [10]
  second = run(tmp_path, "train.stop_after=10", env=env)  # the identical command, in a process of its own
  assert f"resuming from checkpoint {tmp_path}/checkpoints/10 (step 10 of 20)" in " ".join(second.stderr.split())
  assert losses(tmp_path) == ref_losses  # exact float equality, every step
  assert_trees_equal(restore(tmp_path, 20, "params"), restore(ref_dir, 20, "params"))
  assert_trees_equal(restore(tmp_path, 20, "opt_state"), restore(ref_dir, 20, "opt_state"))


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(reference, tmp_path, env):
  """SIGTERM lands once step 3's metrics are read (a seam, not a race). Step 4 is queued behind step 3
  by then, so it finishes too, and the checkpoint holds the state after 5 steps."""
  _, ref_losses = reference
  p = run(tmp_path, env=env, seams=["--sigterm-at=3"], check=False)
  err = " ".join(p.stderr.split())
  assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]  # saved, but not done: `&& convert` stops
  assert "SIGTERM: finishing this step, then saving a checkpoint" in err
  assert steps_on_disk(tmp_path) == [5]
  # The whole line, as tests/test_cli.py holds it for SIGINT: where the checkpoint is, the exit code, how to go on.
  assert (f"stopped (preempted) after step 5 of 20; checkpoint {tmp_path}/checkpoints/5; exit code "
          f"{128 + signal.SIGTERM} (SIGTERM); to continue, run the same command with run_dir={tmp_path}") in err, err
  assert len(metrics(tmp_path)) == 5  # the step in flight finished and was logged
  resumed = run_here(tmp_path, check=True)
  assert "(step 5 of 20)" in " ".join(resumed.stderr.split())
  assert losses(tmp_path) == ref_losses


def test_second_signal_exits_at_once(tmp_path, env):
  code = ("import os, signal, time\n"
          "from meshlm.train.loop import _StopSignals\n"
          "s = _StopSignals()\n"
          "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
          "assert s.requested()\n"
          "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
          "print('still running')\n")
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 128 + signal.SIGINT, p.stderr
  assert "still running" not in p.stdout
  assert "second SIGINT: exiting now" in p.stderr


def test_sigkill_mid_write_then_corrupted_checkpoint_is_skipped(reference, tmp_path, env):
  """SIGKILL while Orbax writes a checkpoint leaves a temporary dir that never counts; then the newest
  complete checkpoint is damaged (a truncated file): the resume names it, skips it, and still
  reproduces the reference from the one before."""
  _, ref_losses = reference
  ckpts = tmp_path / "checkpoints"
  # Saving every step; the write of checkpoint 3 stops before its rename (a seam), and is killed there.
  proc = start(tmp_path, "checkpoint.every=1", "checkpoint.keep=20", env=env, seams=["--hang-save-at=3"])
  try:
    line = proc.stdout.readline()  # blocks until the seam reports, or the process ends
    assert line.strip() == "hang-save 3", (line, proc.poll())
  finally:
    proc.kill()
    proc.communicate()
  names = os.listdir(ckpts)
  assert any(n.startswith("3.") and "tmp" in n for n in names), f"the kill should land mid-write: {names}"
  assert steps_on_disk(tmp_path) == [1, 2]
  newest, older = 2, 1
  # Truncate the biggest file of the newest complete checkpoint's parameters.
  files = [os.path.join(d, f) for d, _, fs in os.walk(ckpts / str(newest) / "params") for f in fs]
  biggest = max(files, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 2)

  resumed = run_here(tmp_path, check=True)  # the checkpoint cadence does not change the numbers
  err = " ".join(resumed.stderr.split())
  assert f"checkpoint {ckpts}/{newest} is corrupted or incomplete" in err
  assert f"resuming from checkpoint {ckpts}/{older} (step {older} of 20)" in err
  assert not any("tmp" in n for n in os.listdir(ckpts))  # the dead write was cleaned up
  # The corrupt one is moved aside, whole, under checkpoints-corrupt/<step>-<time>, out of the way.
  aside = os.listdir(f"{ckpts}-corrupt")
  assert len(aside) == 1 and aside[0].startswith(f"{newest}-"), aside
  assert f"moved it to {ckpts}-corrupt/{aside[0]}" in err
  assert os.path.isdir(f"{ckpts}-corrupt/{aside[0]}/params")
  assert losses(tmp_path) == ref_losses


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(reference, tmp_path, env):
  """NaN at steps 10..19 with train.max_nonfinite_in_a_row=10: every one of those updates is skipped,
  so the state saved when the 10th in a row stops the run is the reference's state after step 10."""
  ref_dir, ref_losses = reference
  p = run(tmp_path, "train.max_nonfinite_in_a_row=10", env=env, check=False,
          seams=["--nan-at=" + ",".join(map(str, range(10, 20)))])
  assert p.returncode == 2, p.stderr[-3000:]
  assert "step 11: non-finite loss" in " ".join(p.stderr.split())  # the 11th step: steps count from 1
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("meshlm: error: stopped at step 20: non-finite loss or gradient norm, 10 non-finite "
                         "steps in a row (train.max_nonfinite_in_a_row)"), last
  assert "Traceback" not in p.stderr
  recs = metrics(tmp_path)
  assert [r["step"] for r in recs] == list(range(1, 21))
  assert [r["loss"] for r in recs[:10]] == ref_losses[:10]
  assert all(np.isnan(r["loss"]) for r in recs[10:])
  assert [r["nonfinite"] for r in recs] == [False] * 10 + [True] * 10
  assert [r["nonfinite_in_a_row"] for r in recs] == [0] * 10 + list(range(1, 11))
  assert [r["nonfinite_total"] for r in recs] == [0] * 10 + list(range(1, 11))
  assert steps_on_disk(tmp_path) == [10, 20]  # the last good state, saved for a retry
  assert_trees_equal(restore(tmp_path, 20, "params"), restore(ref_dir, 10, "params"))
  assert_trees_equal(restore(tmp_path, 20, "opt_state"), restore(ref_dir, 10, "opt_state"))

  # train.on_nonfinite=stop: the first one stops the run.
  p = run(tmp_path / "stop", "train.on_nonfinite=stop", env=env, check=False, seams=["--nan-at=2"])
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1].startswith(
      "meshlm: error: stopped at step 3: non-finite loss or gradient norm, train.on_nonfinite=stop")
  assert [r["nonfinite"] for r in metrics(tmp_path / "stop")] == [False, False, True]


def _checkpoint_files(run_dir) -> dict[str, bytes]:
  out = {}
  for d, _, fs in os.walk(os.path.join(run_dir, "checkpoints")):
    for f in fs:
      path = os.path.join(d, f)
      with open(path, "rb") as fh:
        out[os.path.relpath(path, run_dir)] = fh.read()
  return out


def test_bad_input_exits_with_one_line_and_keeps_checkpoints(reference, tmp_path, env):
  import socket
  ref_dir, _ = reference
  run_dir = tmp_path / "run"
  shutil.copytree(ref_dir, run_dir)
  before = _checkpoint_files(run_dir)
  assert before

  # A coordinator that never answers: a port held bound but never listening, for the whole run, so
  # nothing else on the machine can be handed it and start answering.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    p = run(run_dir, f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
            "distributed.process_id=1", "distributed.timeout_s=2", env=env, check=False)
  assert p.returncode == 2, p.stderr[-2000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"meshlm: error: distributed.coordinator=127.0.0.1:{port}: no answer within 2 s"), p.stderr[-2000:]

  # Process 0 on a port someone else serves.
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    p = run(run_dir, f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
            "distributed.process_id=0", env=env, check=False)
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0] == (f"meshlm: error: distributed.coordinator=127.0.0.1:{port}: process 0 "
                                          f"cannot serve on port {port} (Address already in use); pick a free port")

  # distributed.auto=true outside a cluster JAX knows.
  p = run(run_dir, "distributed.auto=true", env=env, check=False)
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("meshlm: error: distributed.auto=true: JAX found no cluster to join")

  # A run_dir that is not writable: a path under a regular file (chmod would not stop root).
  blocker = tmp_path / "a-file"
  blocker.write_text("x")
  p = run_here(blocker / "run")
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0] == f"meshlm: error: run_dir={blocker}/run: not writable (Not a directory)"
  if os.geteuid() != 0:  # a read-only run_dir that holds checkpoints
    os.chmod(run_dir, 0o555)
    try:
      p = run_here(run_dir)
    finally:
      os.chmod(run_dir, 0o755)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(f"meshlm: error: run_dir={run_dir}: not writable")
  assert _checkpoint_files(run_dir) == before


def test_load_params_from_a_meshlm_run(reference, tmp_path):
  """The loader returns the newest checkpoint's parameters on this run's shardings; then a new run starts from
  them at step 0, with fresh optimizer state."""
  import jax
  from meshlm.config import load_config
  from meshlm.errors import ConfigError
  from meshlm.train.checkpoint import load_params
  from meshlm.train.step import build_train_step
  ref_dir, ref_losses = reference
  cfg = load_config(*BASE, f"run_dir={tmp_path}/new")
  step_fn = build_train_step(cfg)
  abstract, shardings = step_fn.abstract_state().params, step_fn.state_shardings().params
  for path in (ref_dir, ref_dir / "checkpoints", ref_dir / "checkpoints" / "20"):
    params = load_params(cfg, str(path), abstract, shardings, step_fn.mesh)
    assert_trees_equal(params, restore(ref_dir, 20, "params"))
    assert jax.tree.leaves(params)[0].sharding == jax.tree.leaves(shardings)[0]
  with pytest.raises(ConfigError, match=r"checkpoint.load_params_from=.*/nowhere: no such directory"):
    load_params(cfg, str(tmp_path / "nowhere"), abstract, shardings, step_fn.mesh)
  other = load_config(*BASE, "model.mlp_dim=96", f"run_dir={tmp_path}/new")
  with pytest.raises(ConfigError, match=r"parameters of another model \(model.mlp_dim is 96 here but 128"):
    load_params(other, str(ref_dir), abstract, shardings, step_fn.mesh)

  p = run_here(tmp_path / "new", f"checkpoint.load_params_from={ref_dir}", "train.stop_after=2", check=True)
  assert f"parameters from {ref_dir}" in " ".join(p.stderr.split())
  new = losses(tmp_path / "new")
  # Trained parameters on the first batch: far below the fresh model's first loss.
  assert new[0] < ref_losses[0] - 0.05, (new[0], ref_losses[0])


def test_load_params_from_a_hugging_face_directory(tmp_path):
  from meshlm import hf
  from meshlm.train.checkpoint import load_params
  from meshlm.train.step import build_train_step
  path = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "llama")
  hf_cfg, hf_params = hf.load(path, "cpu_devices=1")
  cfg = hf_cfg.model_copy(update={"run_dir": str(tmp_path)})
  step_fn = build_train_step(cfg)
  params = load_params(cfg, path, step_fn.abstract_state().params, step_fn.state_shardings().params, step_fn.mesh)
  assert_trees_equal(params, hf_params)


# --- an unwritable checkpoint.dir ----------------------------------------------------------------

# The directory is made unwritable by turning its parent into a regular file (ENOTDIR): that stops
# root too (chmod would not) and needs nothing from the filesystem (chattr +i does), so these run
# as CI runs them, as root in a container.

def test_unwritable_checkpoint_dir_fails_before_compiling(tmp_path):
  """Before the fix the run trained on, Orbax waited 300 s for the step directory, and exited 1 with a
  409-line traceback. Now it is one line and exit 2 before anything compiles (no banner either)."""
  blocker = tmp_path / "a-file"
  blocker.write_text("x")
  ckpts = blocker / "ckpts"
  p = run_here(tmp_path / "run", f"checkpoint.dir={ckpts}")
  assert p.returncode == 2, p.stderr[-3000:]
  assert p.stderr.strip().splitlines() == [f"meshlm: error: checkpoint.dir={ckpts}: not writable (Not a directory)"]
  assert not (tmp_path / "run" / "config.yaml").exists()
  assert blocker.read_text() == "x"


def test_checkpoint_dir_that_becomes_unwritable_stops_the_run(tmp_path, env):
  """checkpoint.dir is blocked once step 0 is read (a seam; it refuses if anything was saved there
  already); the save after step 1 fails: the run stops there with one line naming the directory and
  the cause, exit 2, no traceback and no 300 s wait."""
  ckpts = tmp_path / "holder" / "ckpts"
  p = run(tmp_path / "run", f"checkpoint.dir={ckpts}", "checkpoint.every=2", env=env, check=False,
          seams=["--block-checkpoints-at=0"])
  assert p.returncode == 2, p.stderr[-3000:]
  assert p.stderr.strip().splitlines()[-1] == (
      f"meshlm: error: checkpoint.dir={ckpts}: cannot save checkpoint 2 (Not a directory); the run stopped. "
      "Make it writable (or set checkpoint.dir) and run the same command to continue from the last checkpoint")
  assert "Traceback" not in p.stderr and "ERROR" not in p.stderr
  assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]  # stopped at once, not trained on
  assert (tmp_path / "holder").is_file()  # the seam ran: the block is still there


# --- refused and do-nothing commands leave the run as it was ------------------------------------

def _record(run_dir) -> tuple[dict[str, bytes], bytes]:
  return _checkpoint_files(run_dir), (run_dir / "config.yaml").read_bytes()


def test_refused_or_do_nothing_commands_keep_config_yaml_and_checkpoints(reference, tmp_path):
  """Each of these used to rewrite config.yaml with its own config, which then no longer described the
  checkpoints beside it; each would record something different (mlp_dim 96, source text, steps 10)."""
  ref_dir, _ = reference
  run_dir = tmp_path / "run"
  shutil.copytree(ref_dir, run_dir)
  before = _record(run_dir)

  p = run_here(run_dir, "model.mlp_dim=96")  # resume with another model: refused
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1] == (
      f"meshlm: error: run_dir={run_dir}: its checkpoint {run_dir}/checkpoints/20 is for another model "
      "(model.mlp_dim is 96 here but 128 in the checkpoint); use a new run_dir, or checkpoint.load_params_from "
      "to start from its parameters")
  assert _record(run_dir) == before

  p = run_here(run_dir, "data.source=text", f"data.path={tmp_path}/nowhere/*.txt")
  assert p.returncode == 2 and "data.path" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
  assert _record(run_dir) == before

  p = run_here(run_dir, "train.steps=10")  # already at step 20: nothing to do
  assert p.returncode == 0 and "nothing to do" in p.stderr
  assert _record(run_dir) == before


def _text_files(folder, name: str, seed: int) -> str:
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
  (folder / f"{name}.txt").write_text(" ".join(rng.choice(words, 2000)))
  return str(folder / "*.txt")


def test_resume_on_other_data_is_refused(reference, tmp_path):
  """The saved data position is meaningless on another source or file set: refused, naming the key,
  with the checkpoints and config.yaml untouched. Before the fix both runs went on silently."""
  ref_dir, _ = reference
  run_dir = tmp_path / "run"
  shutil.copytree(ref_dir, run_dir)
  before = _record(run_dir)
  text = _text_files(tmp_path / "a", "a", 0)
  p = run_here(run_dir, "data.source=text", f"data.path={text}", "train.steps=30")
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip().splitlines()[-1] == (
      f"meshlm: error: run_dir={run_dir}: its checkpoint {run_dir}/checkpoints/20 was trained on other data "
      "(data.source is 'text' here but 'synthetic' in the checkpoint), where its data position means nothing; "
      "put the data.* key back, or use a new run_dir with checkpoint.load_params_from to start from its parameters")
  assert _record(run_dir) == before

  # The same source on other files: data.path.
  text_dir = tmp_path / "text-run"
  run_here(text_dir, "data.source=text", f"data.path={text}", "train.stop_after=2", "checkpoint.every=2", check=True)
  before = _record(text_dir)
  other = _text_files(tmp_path / "b", "b", 1)
  p = run_here(text_dir, "data.source=text", f"data.path={other}", "checkpoint.every=2")
  assert p.returncode == 2, p.stderr[-2000:]
  assert (f"(data.path is {other!r} here but {text!r} in the checkpoint)"
          in p.stderr.strip().splitlines()[-1]), p.stderr[-2000:]
  assert _record(text_dir) == before
  # Negative control: the same data resumes.
  p = run_here(text_dir, "data.source=text", f"data.path={text}", "train.stop_after=2", "checkpoint.every=2",
               check=True)
  assert "(step 2 of 20)" in " ".join(p.stderr.split())
