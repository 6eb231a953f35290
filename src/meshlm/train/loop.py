"""The training loop: data -> step -> metrics, with a progress bar and a sample at the end."""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshlm.config import Config, ConfigError, to_yaml
from meshlm.train.metrics import MetricsWriter
from meshlm.train.step import build_train_step


@dataclasses.dataclass
class TrainResult:
  losses: list[float]
  grad_norms: list[float]
  state: object
  sample: str | None
  first_step_s: float  # from train() entry to the first finished step


def prepare_run_dir(cfg: Config) -> None:
  try:
    os.makedirs(cfg.run_dir, exist_ok=True)
    probe = os.path.join(cfg.run_dir, ".write-test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"run_dir={cfg.run_dir}: not writable ({e.strerror})") from None
  with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
    f.write(to_yaml(cfg))


def train(cfg: Config, *, console: Console | None = None, show_progress: bool = True,
          start_time: float | None = None) -> TrainResult:
  from meshlm.train.data import ByteTokenizer, make_dataset
  t_start = time.perf_counter() if start_time is None else start_time
  console = console or Console(stderr=True)
  prepare_run_dir(cfg)
  step_fn = build_train_step(cfg)
  data = make_dataset(cfg, global_batch=step_fn.global_batch, seq_len=cfg.train.seq_len,
                      process_index=jax.process_index(), process_count=jax.process_count())
  state = step_fn.init_state(jax.random.key(cfg.train.seed))
  writer = MetricsWriter(cfg.run_dir)
  tokens_per_step = step_fn.global_batch * cfg.train.seq_len
  losses, norms = [], []
  first_step_s = float("nan")
  progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  {task.fields[dt]:.3f} s/step"),
                      TimeRemainingColumn(), console=console, disable=not show_progress, transient=False)
  with progress:
    task = progress.add_task("train", total=cfg.train.steps, loss=float("nan"), tps=0.0, dt=0.0)
    for i in range(cfg.train.steps):
      t0 = time.perf_counter()
      batch = step_fn.put_batch(next(data))
      state, metrics = step_fn(state, batch)
      loss, gnorm = float(metrics["loss"]), float(metrics["grad_norm"])  # waits for the step
      dt = time.perf_counter() - t0
      if i == 0:
        first_step_s = time.perf_counter() - t_start
      losses.append(loss)
      norms.append(gnorm)
      if i % cfg.train.log_every == 0 or i == cfg.train.steps - 1:
        record = {"step": i, "loss": loss, "grad_norm": gnorm, "step_time_s": dt,
                  "tokens_per_s": tokens_per_step / dt}
        if i == 0:
          record["time_to_first_step_s"] = first_step_s
        writer.write(record)
      progress.update(task, advance=1, loss=loss, tps=tokens_per_step / dt, dt=dt)
  writer.close()
  sample = None
  if cfg.train.sample_tokens and jax.process_count() == 1:
    from meshlm.models.generate import greedy
    tok = ByteTokenizer()
    prompt = tok.encode(b"def ")
    out = greedy(cfg, state.params, prompt, cfg.train.sample_tokens, mesh=step_fn.mesh)
    sample = "def " + tok.decode(out)
  return TrainResult(losses, norms, state, sample, first_step_s)
