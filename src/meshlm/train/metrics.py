"""Metrics: one JSON object per logged step in metrics.jsonl, mirrored to TensorBoard."""
from __future__ import annotations

import json
import os
from typing import Any


class MetricsWriter:
  def __init__(self, run_dir: str, tensorboard: bool = True):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._f = open(self.path, "a", buffering=1)
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
      except ImportError:  # TensorBoard is a nicety; metrics.jsonl is the record
        self._tb = None

  def write(self, record: dict[str, Any]) -> None:
    self._f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      step = record["step"]
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()
