"""Two processes x 2 CPU devices (jax.distributed, gloo collectives) train like one process x 4.

Both runs see the same global batches: each of the two processes reads its own half of the data,
and the one-process reference is fed the two halves stacked in device order (process 0's rows
land on devices 0-1, process 1's on devices 2-3), so the comparison isolates the runtime.
"""
from __future__ import annotations

import json
import os
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
        f"train.steps={STEPS}"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _TwoProcessData:
  """The global batches two processes would see, as one process's iterator."""

  def __init__(self, cfg, global_batch: int):
    from meshlm.train.data import make_dataset
    self.parts = [make_dataset(cfg, global_batch=global_batch, seq_len=cfg.train.seq_len, process_index=i,
                               process_count=2) for i in range(2)]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    halves = [next(p) for p in self.parts]
    return {k: np.concatenate([h[k] for h in halves]) for k in halves[0]}

  def get_state(self) -> dict:
    return {"parts": [p.get_state() for p in self.parts]}

  def set_state(self, state: dict) -> None:
    for p, s in zip(self.parts, state["parts"]):
      p.set_state(s)


def _one_process_losses(mode: str, run_dir) -> list[float]:
  from rich.console import Console
  from meshlm.config import load_config
  from meshlm.train.loop import train
  from meshlm.train.step import global_batch_size
  cfg = load_config(*BASE, f"shard_mode={mode}", "cpu_devices=4", f"run_dir={run_dir}")
  data = _TwoProcessData(cfg, global_batch_size(cfg, 4))
  result = train(cfg, console=Console(file=open(os.devnull, "w")), show_progress=False, data=data)
  return result.losses


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_two_processes_match_one_process(mode, tmp_path):
  run_dir = tmp_path / "two"
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  procs, logs = [], []
  for i in range(2):
    log = open(tmp_path / f"process{i}.log", "w+")
    procs.append(subprocess.Popen(
        [MESHLM, "train", *BASE, f"shard_mode={mode}", "cpu_devices=2", f"run_dir={run_dir}",
         f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2", f"distributed.process_id={i}",
         "distributed.timeout_s=120"], env=env, stdout=log, stderr=subprocess.STDOUT))
    logs.append(log)
  # The reference runs in this process meanwhile; the pair mostly waits on each other.
  ref = _one_process_losses(mode, tmp_path / "one")
  for p, log in zip(procs, logs):
    try:
      rc = p.wait(timeout=300)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    log.seek(0)
    assert rc == 0, log.read()[-3000:]
  with open(run_dir / "metrics.jsonl") as f:
    recs = [json.loads(ln) for ln in f if ln.strip()]
  assert [r["step"] for r in recs] == list(range(STEPS))  # process 0 alone writes the metrics
  two = [r["loss"] for r in recs]
  np.testing.assert_allclose(two, ref, rtol=0, atol=1e-5)
  # Both processes joined one checkpoint of the 4-device state.
  assert sorted(os.listdir(run_dir / "checkpoints")) == [str(STEPS)]
  print(f"{mode}: max |loss difference| {np.max(np.abs(np.subtract(two, ref))):.3g}; "
        f"bit-identical: {two == ref}")
