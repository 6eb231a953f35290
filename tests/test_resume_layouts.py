"""Resuming a MoE run with another layout or implementation of the same parameters: model.parts.moe.kernel_fsdp,
model.parts.moe.grouped_matmul, scan_layers, stack_rows and loss_impl change how the step computes, not what, so a checkpoint
resumes under other values (config/resume.py RESUMABLE, the moe section's COMPUTE knobs) and the run goes on as the
uninterrupted one does, to float32 reassociation. A key that changes the parameters' meaning is still refused
(the control), naming the key.

In process (train/loop.train), a tiny mixtral on fsdp=2: one uninterrupted 4-step run saving checkpoints 2 and 4,
and a copy of it without checkpoint 4 resumed from step 2 under the other layout. (That a run stopped after 2 steps
saves what this one saved at 2, bit for bit, is tests/test_checkpoint.py's test_exact_resume_is_bit_identical.)
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
# on the experts dim (expert parallelism), the block-layout grouped matmul, unrolled layers with sliced rows, the
# blockwise head and loss (in blocks of 5 positions: the last one padded).
OTHER = ("model.parts.moe.kernel_fsdp=mlp", "model.parts.moe.grouped_matmul=blocks", "scan_layers=false",
         "stack_rows=false", "loss_impl=blockwise", "loss_block=5")
# Float32 reassociation only (another dispatch and other collectives sum in another order). Measured max |loss
# diff| over the two resumed steps: 4.8e-7, against losses that move by 0.2-0.8 a step.
ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(losses of the uninterrupted run, its run_dir)."""
  whole_dir = tmp_path_factory.mktemp("whole")
  whole = train(load_config(*RUN, f"run_dir={whole_dir}"), show_progress=False)
  assert whole.stop_reason == "done" and sorted(p.name for p in (whole_dir / "checkpoints").iterdir()) == ["2", "4"]
  return np.asarray(whole.losses), whole_dir


def at_step_2(whole_dir, run_dir):
  """A copy of the uninterrupted run as it stood after step 2: its checkpoint 4 removed (metrics.jsonl's steps 3
  and 4 are dropped by the resume, as after any stop)."""
  shutil.copytree(whole_dir, run_dir)
  shutil.rmtree(run_dir / "checkpoints" / "4")


def test_a_run_resumes_under_another_layout_of_the_same_parameters(runs, tmp_path):
  whole, whole_dir = runs
  run_dir = tmp_path / "run"
  at_step_2(whole_dir, run_dir)
  resumed = train(load_config(*RUN, *OTHER, f"run_dir={run_dir}"), show_progress=False)
  assert resumed.start_step == 2 and len(resumed.losses) == 2 and resumed.stop_reason == "done"
  diff = np.max(np.abs(np.asarray(resumed.losses) - whole[2:]))
  print(f"resumed under {' '.join(OTHER)}: max |loss diff| vs uninterrupted {diff:.3g} (losses {whole.tolist()})")
  assert len(set(whole.tolist())) == 4  # the run really trains: equal losses would make the check trivial
  assert diff < ATOL
  text = (run_dir / "config.yaml").read_text()
  assert "    kernel_fsdp: mlp\n" in text and "scan_layers: false" in text and "loss_impl: blockwise" in text


def test_a_key_that_changes_the_parameters_is_still_refused(runs, tmp_path):
  _, whole_dir = runs
  run_dir = tmp_path / "run"
  at_step_2(whole_dir, run_dir)
  with pytest.raises(ConfigError, match="model.parts.moe.num_experts_per_tok is 1 here but 2 in the checkpoint"):
    train(load_config(*RUN, *OTHER, "model.parts.moe.num_experts_per_tok=1", f"run_dir={run_dir}"), show_progress=False)
