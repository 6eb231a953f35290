"""train.matmul_precision: every dot of the train step (forward, loss, gradients) carries the key's precision, so a
float32 run on TPU can match a CPU's without JAX_DEFAULT_MATMUL_PRECISION. Lowered only: nothing compiles."""
import re

import pytest

from meshlm import load_config
from meshlm.errors import ConfigError
from meshlm.train.step import build_train_step


def _dots(precision: str) -> list[str]:
  cfg = load_config("model=llama2-tiny", "train.seq_len=16", "train.per_device_batch_size=1", "mesh.fsdp=2",
                    "mesh.data=-1", "train.compute_dtype=float32", f"train.matmul_precision={precision}")
  return re.findall(r"stablehlo\.dot_general.*", build_train_step(cfg).lower().as_text())


def test_highest_reaches_every_dot_and_default_none():
  highest = _dots("highest")
  assert len(highest) > 20 and all("HIGHEST" in d for d in highest)  # forward, the loss and every gradient
  default = _dots("default")  # the control: the same step without the key names no precision
  assert len(default) == len(highest) and not any("HIGHEST" in d or "HIGH" in d for d in default)


def test_a_bad_value_is_refused_naming_the_key():
  with pytest.raises(ConfigError, match="train.matmul_precision"):
    load_config("model=llama2-tiny", "train.matmul_precision=float64")
