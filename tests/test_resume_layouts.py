"""Resuming a MoE run with another layout or implementation of the same parameters: model.parts.moe.kernel_fsdp,
model.parts.moe.grouped_matmul, scan_layers and stack_rows change how the step computes, not what, so a checkpoint
resumes under other values (run_dir.RESUMABLE, the moe section's COMPUTE knobs) and the run goes on as the
uninterrupted one does, to float32 reassociation. A key that changes the parameters' meaning is still refused
(the control), naming the key.

In process (train/loop.train), a tiny mixtral on fsdp=2: one uninterrupted 4-step run, one that stops after 2
steps, and its resume under the other layout.
"""
import shutil

import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.train.loop import train

RUN = ("model=mixtral-tiny", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
       "model.parts.moe.mlp_dim=32", "model.vocab_size=64", "model.num_layers=2", "cpu_devices=2", "mesh.fsdp=2",
       "train.compute_dtype=float32", "train.seq_len=16", "train.per_device_batch_size=2", "train.steps=4",
       "train.warmup_steps=0", "train.sample_tokens=0", "data.source=synthetic", "checkpoint.every=2",
       "model.parts.moe.kernel_fsdp=experts")
# The same parameters computed another way: kernels FSDP-sharded on mlp (gathered whole per layer) instead of
# on the experts dim (expert parallelism), the block-layout grouped matmul, unrolled layers with sliced rows.
OTHER = ("model.parts.moe.kernel_fsdp=mlp", "model.parts.moe.grouped_matmul=blocks", "scan_layers=false",
         "stack_rows=false")
# Float32 reassociation only (another dispatch and other collectives sum in another order). Measured max |loss
# diff| over the two resumed steps: 4.8e-7, against losses that move by 0.2-0.8 a step.
ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(losses of the uninterrupted run, the stopped run's run_dir)."""
  whole = train(load_config(*RUN, f"run_dir={tmp_path_factory.mktemp('whole')}"), show_progress=False)
  stopped_dir = tmp_path_factory.mktemp("stopped")
  stopped = train(load_config(*RUN, "train.stop_after=2", f"run_dir={stopped_dir}"), show_progress=False)
  assert stopped.stop_reason != "done" and len(stopped.losses) == 2
  np.testing.assert_array_equal(stopped.losses, whole.losses[:2])
  return np.asarray(whole.losses), stopped_dir


def test_a_run_resumes_under_another_layout_of_the_same_parameters(runs, tmp_path):
  whole, stopped_dir = runs
  run_dir = tmp_path / "run"
  shutil.copytree(stopped_dir, run_dir)
  resumed = train(load_config(*RUN, *OTHER, f"run_dir={run_dir}"), show_progress=False)
  assert resumed.start_step == 2 and len(resumed.losses) == 2 and resumed.stop_reason == "done"
  diff = np.max(np.abs(np.asarray(resumed.losses) - whole[2:]))
  print(f"resumed under {' '.join(OTHER)}: max |loss diff| vs uninterrupted {diff:.3g} (losses {whole.tolist()})")
  assert len(set(whole.tolist())) == 4  # the run really trains: equal losses would make the check trivial
  assert diff < ATOL
  text = (run_dir / "config.yaml").read_text()
  assert "    kernel_fsdp: mlp\n" in text and "scan_layers: false" in text


def test_a_key_that_changes_the_parameters_is_still_refused(runs, tmp_path):
  _, stopped_dir = runs
  run_dir = tmp_path / "run"
  shutil.copytree(stopped_dir, run_dir)
  with pytest.raises(ConfigError, match="model.parts.moe.num_experts_per_tok is 1 here but 2 in the checkpoint"):
    train(load_config(*RUN, *OTHER, "model.parts.moe.num_experts_per_tok=1", f"run_dir={run_dir}"),
          show_progress=False)
