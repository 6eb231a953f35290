"""The training loop: data -> step -> metrics -> checkpoint, with resume, preemption and a
non-finite guard, a progress bar and a sample at the end.

Stopping, and what each leaves behind (the same command then continues where it stopped):
  - SIGTERM/SIGINT: the current step finishes, a checkpoint is saved, train() returns with
    stop_reason="preempted" and the signal (`meshlm train` then exits 128 + its number: 143, 130, so
    `train && convert` stops there). A second signal exits at once (also 128 + signal number).
  - train.stop_after=N: the same after N steps of this invocation ("stop_after").
  - non-finite loss or grad norm: the update is skipped (see train_step). With
    train.on_nonfinite=stop, or after train.max_nonfinite_in_a_row in a row, the last good state
    is saved and NonFiniteStop is raised, naming the step.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import signal
import sys
import time
from typing import Callable

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshlm.config import Config, to_yaml
from meshlm.errors import ConfigError
from meshlm.console import make_console
from meshlm.fsutil import write_text
from meshlm.models.params import merge_state, split_state
from meshlm.parallel.mesh import make_mesh
from meshlm.train.metrics import MetricsWriter
from meshlm.train.step import TrainState, build_train_step, global_batch_size


class NonFiniteStop(ConfigError):
  """The run met non-finite losses/gradients and stopped; the message names the step and what to change."""


@dataclasses.dataclass
class TrainResult:
  losses: list[float]  # one per step run in this invocation
  grad_norms: list[float]
  state: object
  sample: str | None
  first_step_s: float  # from train() entry to the first finished step
  start_step: int = 0  # the step this invocation started from (> 0 after a resume)
  stop_reason: str = "done"  # done | preempted | stop_after
  checkpoint: str | None = None  # the last checkpoint saved by this invocation
  signal: int | None = None  # the signal that preempted this process (None: none, or only another process's)
  run_dir: str | None = None  # the run's directory (a fresh one when cfg.run_dir was null)


@dataclasses.dataclass
class _InFlight:
  """A dispatched step whose metrics the loop has not read yet."""
  step: int
  metrics: dict
  data_state: dict  # the data iterator's position right after this step's batch


def prepare_run_dir(cfg: Config) -> None:
  """Fails in one line, before anything compiles, if run_dir or checkpoint.dir cannot be written.
  Creates nothing: it probes the nearest directory that exists (the run creates the rest when it
  starts), and config.yaml waits until the run really starts (write_config)."""
  from meshlm.train.checkpoint import checkpoint_dir, writable_or_error
  for key, path in (("run_dir", cfg.run_dir), ("checkpoint.dir", checkpoint_dir(cfg))):
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    # A regular file on the way (run_dir=FILE/run) is what mkdir would meet first.
    err = writable_or_error(existing) if os.path.isdir(existing) else os.strerror(errno.ENOTDIR)
    if err:
      raise ConfigError(f"{key}={path}: not writable ({err})")


def param_counts(cfg: Config) -> tuple[int, int]:
  """(trainable, frozen) parameter counts, from the parameter specs (nothing is built). A train.freeze
  that leaves nothing to train is refused: the run would spend its steps changing nothing."""
  import math

  from meshlm.models.params import param_specs
  from meshlm import spec as S
  from meshlm.train.step import param_paths, trainable_mask
  sizes = [math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=S.is_spec)]
  mask = trainable_mask(cfg)
  flags = [True] * len(sizes) if mask is None else jax.tree.leaves(mask)
  trainable = sum(n for n, t in zip(sizes, flags) if t)
  if trainable == 0:
    paths = jax.tree.leaves(param_paths(cfg))
    raise ConfigError(f"train.freeze={cfg.train.freeze}: freezes all {sum(sizes):,} parameters ({len(paths)} arrays), "
                      f"so nothing would train; narrow the patterns (paths look like {paths[0]}, "
                      f"{paths[len(paths) // 2]}, {paths[-1]}) or drop train.freeze")
  return trainable, sum(sizes) - trainable


def write_config(cfg: Config) -> None:
  """The run's record of its resolved config: written once the run starts or resumes, never by a
  command that is refused or has nothing to do, so it always describes the checkpoints beside it."""
  if jax.process_index() == 0:
    write_text(os.path.join(cfg.run_dir, "config.yaml"), to_yaml(cfg))


def _trim_metrics(run_dir: str, start_step: int, name: str = "metrics.jsonl", counts_from: int = 1) -> None:
  """Drops the records of steps run after the checkpoint at start_step (they are run again, and each step should
  appear once): metrics.jsonl's, whose `step` counts from 1 (record n: after n updates), from start_step + 1 on;
  another JSONL file's with counts_from=0 (a `step` of updates done before it: RL's completions) from start_step on."""
  path = os.path.join(run_dir, name)
  if jax.process_index() != 0 or not os.path.exists(path):
    return
  with open(path) as f:
    lines = [ln for ln in f if ln.strip()]
  keep = [ln for ln in lines if json.loads(ln).get("step", -1) < start_step + counts_from]
  if len(keep) != len(lines):
    write_text(path, "".join(keep))


class _NullWriter:
  """Metrics on processes other than 0: they hold the same numbers, and one file is the record."""

  def write(self, record: dict) -> None:
    pass

  def close(self) -> None:
    pass


class _StopSignals:
  """SIGTERM/SIGINT: the first asks the loop to stop after the current step; the second exits now."""

  def __init__(self):
    self.received: int | None = None
    self._previous = {}
    if sys.platform != "win32" and _is_main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:
      sys.stderr.write(f"\nmeshlm: second {name}: exiting now, without a checkpoint\n")
      sys.stderr.flush()
      os._exit(128 + signum)
    self.received = signum
    sys.stderr.write(f"\nmeshlm: {name}: finishing this step, then saving a checkpoint "
                     f"(send it again to exit at once)\n")
    sys.stderr.flush()

  def requested(self) -> bool:
    """Whether any process was signalled. Processes must agree, or they would stop at different steps
    and the next collective would hang; so with several processes this is a (tiny) all-gather."""
    flag = self.received is not None
    if jax.process_count() == 1:
      return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _is_main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()


def _scalar_on(sharding, value: int) -> jax.Array:
  # From a callback, so it also works when the sharding spans devices of other processes.
  return jax.make_array_from_callback((), sharding, lambda _: np.asarray(value, np.int32))


@dataclasses.dataclass
class _Finished:
  """A step whose metrics the loop has read."""
  step: int
  metrics: dict  # on the host
  loss: float
  grad_norm: float
  nonfinite: bool
  dt: float  # wall seconds since the step before it finished


@dataclasses.dataclass
class _Running:
  """What one Loop.run carries from step to step."""
  state: object  # the latest dispatched step's output (steps donate their input)
  start: int
  counters: dict  # the caller's dict, updated in place and checkpointed
  i: int = 0  # the next step to dispatch
  batch: dict | None = None  # step i's device batch, once fetched
  last_done: float = 0.0  # perf_counter when the last step finished
  inflight: collections.deque = dataclasses.field(default_factory=collections.deque)  # of _InFlight
  losses: list[float] = dataclasses.field(default_factory=list)
  norms: list[float] = dataclasses.field(default_factory=list)
  first_step_s: float = float("nan")
  preempt: bool = False  # a signal reached some process
  stop_reason: str = "done"
  saved: str | None = None
  nonfinite_msg: str | None = None


@dataclasses.dataclass
class LoopOutcome:
  state: object
  losses: list[float]
  grad_norms: list[float]
  first_step_s: float
  stop_reason: str  # done | preempted | stop_after | nonfinite
  saved: str | None  # the last checkpoint this run saved
  nonfinite_msg: str | None
  signal: int | None = None  # the signal this process received, if any


@dataclasses.dataclass
class Loop:
  """The core every trainer's loop shares: step, read metrics, log (console, metrics.jsonl,
  TensorBoard), the non-finite guard's stop rule, signals, stop_after and checkpoints.

  What a trainer brings: `fetch(i)`, the device batch of step i (the data pipeline's next batch, or
  an RL trainer's rollouts), and `position()`, the data position to checkpoint after the last fetch.
  With queue_ahead, step i + 1 is dispatched before step i's metrics are read (see _may_run_past); a
  trainer whose batches depend on the latest parameters (on-policy rollouts) turns it off.
  """
  cfg: Config
  step_fn: Callable
  ckpt: object
  console: Console
  say: Callable
  writer: object
  tokens_per_step: int
  show_progress: bool = True
  t_start: float = 0.0
  on_step: Callable[[int], None] | None = None
  queue_ahead: bool = True
  progress_extra: Callable[[dict], str] | None = None  # more of a step's metrics on the progress bar (RL: reward)
  evaluate: Callable[[object], dict] | None = None  # the validation metrics of a state (train/validation.py)

  def run(self, state, start: int, rng, counters: dict, *, fetch: Callable[[int], dict],
          position: Callable[[], dict]) -> LoopOutcome:
    t, ckpt = self.cfg.train, self.ckpt
    signals = _StopSignals()
    progress = self._progress_bar()
    # Not a terminal (a log file, a pipe): a plain line per logged step instead of the bar, which rich would only
    # draw once, at the end.
    plain = self.show_progress and jax.process_index() == 0 and not self.console.is_terminal
    r = _Running(state, start, counters)
    try:
      with progress:
        task = progress.add_task("train", total=t.steps, completed=start, loss=float("nan"), tps=0.0, dt=0.0, extra="")
        r.i, r.batch = start, (fetch(start) if start < t.steps else None)
        r.last_done = time.perf_counter()
        while True:
          self._dispatch(r, fetch, position)
          if not r.inflight:
            break
          p = r.inflight.popleft()
          f = self._finish(r, p)
          if self._eval_due(p.step):
            # No later step is dispatched yet (_may_run_past): r.state is the state right after step p.
            f.metrics.update(self.evaluate(r.state))
          self._report(r, f, progress, task, plain)
          if self.on_step is not None:
            self.on_step(p.step)

          done = p.step + 1
          r.preempt = signals.requested()  # every process asks once per step: the answer is collective
          reason = self._stop_reason(r, f)
          if r.inflight:
            # Only a signal can get here (_may_run_past rules out the rest): the state has moved on to
            # the queued step, so finish that one and save after it.
            assert reason in ("done", "preempted"), reason
            continue
          if reason != "done" or ckpt.should_save(done, t.steps):
            ckpt.save(done, r.state, rng, p.data_state, counters)
            r.saved = f"{ckpt.dir}/{done}"
          if reason != "done":
            r.stop_reason = reason
            break
          if r.batch is None and r.i < t.steps:
            r.batch = fetch(r.i)  # without queue_ahead the next batch is made only now, from the new state
    finally:
      signals.restore()
      self.writer.close()
    return LoopOutcome(r.state, r.losses, r.norms, r.first_step_s, r.stop_reason, r.saved, r.nonfinite_msg,
                       signals.received)

  def _progress_bar(self) -> Progress:
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  {task.fields[dt]:.3f} s/step"
                               "{task.fields[extra]}"),
                    TimeRemainingColumn(), console=self.console,
                    disable=not self.show_progress or jax.process_index() != 0 or not self.console.is_terminal,
                    transient=False)

  def _may_run_past(self, r: _Running, i: int) -> bool:
    """Whether step i + 1 may be dispatched before step i's metrics are read. The step donates its
    state, so this is only when nothing at step i can need the state after it: no checkpoint, no
    stop_after, no signal seen, and no non-finite stop even if step i turns out non-finite."""
    t, done = self.cfg.train, i + 1
    return (self.queue_ahead and done < t.steps and not r.preempt and not self.ckpt.should_save(done, t.steps)
            and not self._eval_due(i)
            and not (t.stop_after is not None and done - r.start >= t.stop_after)
            and t.on_nonfinite == "skip" and r.counters["nonfinite_in_a_row"] + 1 < t.max_nonfinite_in_a_row)

  def _eval_due(self, step: int) -> bool:
    from meshlm.train.validation import eval_due
    return self.evaluate is not None and eval_due(self.cfg, step)

  def _dispatch(self, r: _Running, fetch: Callable[[int], dict], position: Callable[[], dict]) -> None:
    # Keep one step queued behind the one being read, so the host's reading, logging and the
    # next batch overlap the device's work instead of adding to it.
    steps = self.cfg.train.steps
    while r.i < steps and (not r.inflight or (len(r.inflight) == 1 and self._may_run_past(r, r.inflight[0].step))):
      r.state, metrics = self.step_fn(r.state, r.batch)
      r.inflight.append(_InFlight(r.i, metrics, position()))  # the data position right after batch i
      r.i += 1
      r.batch = fetch(r.i) if r.i < steps and (self.queue_ahead or not r.inflight) else None

  def _finish(self, r: _Running, p: _InFlight) -> _Finished:
    """Waits for step p.step's metrics and counts them: its time, loss, grad norm and non-finite streak."""
    m = jax.device_get(p.metrics)  # waits for step p.step
    loss, gnorm, nonfinite = float(m["loss"]), float(m["grad_norm"]), bool(m["nonfinite"])
    now = time.perf_counter()
    dt, r.last_done = now - r.last_done, now  # wall time per finished step: the loop's real rate
    if p.step == r.start:
      r.first_step_s = now - self.t_start
    r.losses.append(loss)
    r.norms.append(gnorm)
    r.counters["nonfinite_in_a_row"] = r.counters["nonfinite_in_a_row"] + 1 if nonfinite else 0
    r.counters["nonfinite_total"] += int(nonfinite)
    return _Finished(p.step, m, loss, gnorm, nonfinite, dt)

  def _report(self, r: _Running, f: _Finished, progress: Progress, task, plain: bool) -> None:
    """A finished step to metrics.jsonl (logged steps), the console (warnings, plain lines) and the bar."""
    t, tokens_per_step = self.cfg.train, self.tokens_per_step
    validated = "val_loss" in f.metrics
    if f.step % t.log_every == 0 or f.step == t.steps - 1 or f.nonfinite or validated:
      # The loss's own metrics (aux losses, RL statistics) ride along under their names.
      extra = {k: float(v) for k, v in f.metrics.items() if k not in ("loss", "grad_norm", "nonfinite")}
      # "step" counts the updates done, from 1, as the console's lines and TRL's logs (the step after the update).
      record = {"step": f.step + 1, "loss": f.loss, "grad_norm": f.grad_norm, "step_time_s": f.dt,
                "tokens_per_s": tokens_per_step / f.dt, "nonfinite": f.nonfinite, **extra, **r.counters}
      if f.step == r.start:
        record["time_to_first_step_s"] = r.first_step_s
      self.writer.write(record)
    if f.nonfinite:
      self.say(f"[yellow]warning:[/] step {f.step + 1}: non-finite loss ({f.loss}) or grad norm ({f.grad_norm}); "
               f"update skipped ({r.counters['nonfinite_in_a_row']} in a row)")
    extra_text = "  " + self.progress_extra(f.metrics) if self.progress_extra is not None else ""
    if validated:
      m = f.metrics
      extra_text += (f"  val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f}; {int(m['val_rows'])} rows, "
                     f"{int(m['val_tokens']):,} tokens)")
    progress.update(task, advance=1, loss=f.loss, tps=tokens_per_step / f.dt, dt=f.dt, extra=extra_text)
    if plain and (f.step % t.log_every == 0 or f.step == t.steps - 1 or validated):
      self.console.print(f"step {f.step + 1}/{t.steps}  loss {f.loss:.4f}  {tokens_per_step / f.dt:,.0f} tok/s  "
                         f"{f.dt:.3f} s/step{extra_text}", markup=False, highlight=False)

  def _stop_reason(self, r: _Running, f: _Finished) -> str:
    """Why the loop stops after step f.step ("done": it does not); a non-finite stop sets r.nonfinite_msg."""
    t, done = self.cfg.train, f.step + 1
    if f.nonfinite and (t.on_nonfinite == "stop" or r.counters["nonfinite_in_a_row"] >= t.max_nonfinite_in_a_row):
      why = ("train.on_nonfinite=stop" if t.on_nonfinite == "stop" else
             f"{r.counters['nonfinite_in_a_row']} non-finite steps in a row (train.max_nonfinite_in_a_row)")
      r.nonfinite_msg = (f"stopped at step {done}: non-finite loss or gradient norm, {why}; the last good state is "
                         f"saved as checkpoint {self.ckpt.dir}/{done}. Lower train.learning_rate or check the data")
      return "nonfinite"
    if r.preempt:
      return "preempted"
    if t.stop_after is not None and done - r.start >= t.stop_after and done < t.steps:
      return "stop_after"
    return "done"


def part_metrics_text(cfg: Config) -> Callable[[dict], str] | None:
  """The parts' logged statistics (Part.metrics) for the progress line, or None when the model logs none."""
  from meshlm.models.model import resolve
  names = tuple(resolve(cfg).metrics)
  if not names:
    return None
  return lambda m: "  ".join(f"{n} {float(m[n]):.4g}" for n in names if n in m)


def train(cfg: Config, *, console: Console | None = None, show_progress: bool = True,
          start_time: float | None = None, data=None,
          on_step: Callable[[int], None] | None = None) -> TrainResult:
  """Trains cfg to cfg.train.steps, resuming from the run_dir's latest checkpoint if there is one
(run_dir null: a fresh directory, TrainResult.run_dir). Resuming with settings other than the run's
config.yaml is refused (train/run_dir.py lists the keys that may change). A failure before the run
starts leaves no directory it created behind.

  data: an iterator of host batches to use instead of make_dataset(cfg) (tests); to be checkpointed
  it needs get_state()/set_state().
  on_step: called with each step's index once its metrics are read, on every process, before the
  loop decides whether to stop there (tests: a signal sent from it lands at a known step).
  """
  from meshlm.train.checkpoint import Checkpointer
  from meshlm.train.data import batch_rows, make_dataset
  from meshlm.train.run_dir import leave_as_found
  t_start = time.perf_counter() if start_time is None else start_time
  console = console or make_console()
  say = console.print if jax.process_index() == 0 else (lambda *a, **k: None)
  param_counts(cfg)  # nothing to train fails here, before any directory exists
  with leave_as_found(cfg) as cfg:
    prepare_run_dir(cfg)
    mesh = make_mesh(cfg)
    first = None
    if data is None:
      # Data first: a bad glob or file fails in one line before anything is traced or compiled, and so does a bad
      # row of the first batch (a resume reads its own first batch after restoring the data position).
      global_batch = global_batch_size(cfg, mesh.size)
      data = make_dataset(cfg, global_batch=global_batch, seq_len=cfg.train.seq_len,
                          rows=batch_rows(mesh, global_batch, cfg.train.seq_len))
      first = first_batch(cfg, data, global_batch)
    step_fn = build_train_step(cfg, mesh)
    ckpt = Checkpointer(cfg, warn=lambda m: console.print(f"[yellow]warning:[/] {m}"))
    try:
      return _run(cfg, step_fn, data, ckpt, console, say, show_progress, t_start, on_step, first)
    finally:
      ckpt.close()  # waits for an async save in flight: a returned train() has its checkpoint on disk


def restore_or_init(cfg: Config, step_fn, ckpt, say, ignore: tuple[str, ...] = ()
                    ) -> tuple[TrainState, int, jax.Array, dict, dict | None]:
  """(state, start step, rng, counters, data_state or None) of a run: its latest checkpoint (after
  refusing a resume with other settings; `ignore`: keys the trainer derives from others, which are compared),
  else a fresh state, with checkpoint.load_params_from's parameters when it is set. Every trainer (train, rl)
  starts through here."""
  from meshlm.train.checkpoint import load_params
  from meshlm.train.run_dir import resume_mismatch
  t = cfg.train
  rng = jax.random.key(t.seed)
  counters = {"nonfinite_in_a_row": 0, "nonfinite_total": 0}
  steps = ckpt.manager.all_steps()
  bad = steps and resume_mismatch(cfg, max(steps), ignore)  # before restoring: refusing costs no array read
  if bad:
    raise ConfigError(bad)
  restored = ckpt.restore_latest(step_fn.abstract_state())
  if restored is not None:
    start = restored["step"]
    state = TrainState(_scalar_on(step_fn.state_shardings().step, start), restored["params"], restored["opt_state"],
                       restored["model_state"])
    counters = {k: int(restored["meta"].get(k, 0)) for k in counters}
    say(f"resuming from checkpoint {ckpt.dir}/{start} (step {start} of {t.steps})")
    return state, start, restored["rng"], counters, restored["data_state"]
  state = step_fn.init_state(rng)
  if cfg.checkpoint.load_params_from:
    # The whole model tree, its model-state leaves (e.g. a routing bias) included.
    abstract, sh = step_fn.abstract_state(), step_fn.state_shardings()
    tree = load_params(cfg, cfg.checkpoint.load_params_from, merge_state(abstract.params, abstract.model_state),
                       merge_state(sh.params, sh.model_state), step_fn.mesh)
    params, model_state = split_state(cfg, tree)
    state = state._replace(params=params, model_state=model_state)
    say(f"parameters from {cfg.checkpoint.load_params_from}; optimizer state and data start fresh")
  return state, 0, rng, counters, None


def sample_prompt(cfg: Config, data, tok) -> tuple[list[int], str, tuple[int, ...] | None]:
  """The end-of-run sample's prompt as the run's rows begin: (ids, the text printed before the sample, the stop
  tokens or None for the model's own). A chat fine-tune: the first row's turns before its first assistant turn (its
  prompt, in the prompt-completion form), rendered by the chat template with the generation prompt, stopping at the
  tokenizer's EOS (the end of a turn); prompt-completion rows: the first row's prompt; plain text: "The " ("def "
  for the stdlib corpus). The tokenizer's BOS first wherever the run's rows have it (train/data/formats.py)."""
  from meshlm.train.data import chat_template
  from meshlm.train.data.formats import CONVERSATIONAL
  fmt = getattr(data, "format", "language_modeling")
  doc = data.example() if fmt != "language_modeling" else None
  stops = None
  if doc is not None and fmt in CONVERSATIONAL:
    row = doc.data
    turns = row["prompt"] if fmt != "conversational" else row["messages"]
    turns = turns[:next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))]
    text, _ = chat_template(cfg, fmt).render(turns, add_generation_prompt=True)
    user = next((m["content"] for m in reversed(turns) if m["role"] == "user"), "")
    ids, shown = [int(i) for i in tok.encode_offsets(text)[0]], f"[user] {user}\n[assistant] "
    stops = (tok.eos_id,)
  else:
    shown = doc.data["prompt"] if doc is not None else ("def " if cfg.data.source == "stdlib" else "The ")
    ids = [int(i) for i in tok.bos_ids] + [int(i) for i in tok.encode(shown.encode())]
    stops = None if doc is None else (tok.eos_id,)
  if stops is not None and cfg.model.eos_token_id is not None:
    eos = cfg.model.eos_token_id
    stops = tuple(dict.fromkeys((*stops, *(eos if isinstance(eos, list) else [eos]))))
  return ids, shown, stops


def _count_trained_tokens(step_fn) -> Callable:
  """step_fn, with the batch's trained tokens (its loss-mask count) as the metric trained_tokens: with the SFT
  formats' masks, tokens per step no longer says what trained."""
  import jax.numpy as jnp
  count = jax.jit(jnp.sum)

  def step(state, batch):
    state, metrics = step_fn(state, batch)
    with jax.set_mesh(step_fn.mesh):
      return state, {**metrics, "trained_tokens": count(batch["loss_mask"])}
  return step


def first_batch(cfg: Config, data, global_batch: int) -> dict:
  """data's next batch, read before the run writes anything, so that a bad row in it (or a file of which a whole pass
  leaves nothing to train) stops the run with nothing left behind. When that global batch has no trained token (its
  rows' trained tokens all cut away), a second stream from the same config reads on until a batch has one, or a whole
  pass of the file has none and is refused (make_dataset's _CountRows): a run that would only ever train at loss 0
  fails at the start, not after its steps."""
  batch = next(data)
  if getattr(data, "trained_tokens", None) == 0:
    from meshlm.train.data import make_dataset
    probe = make_dataset(cfg, global_batch=global_batch, seq_len=cfg.train.seq_len, rows=np.arange(1))
    while next(probe) is not None and probe.trained_tokens == 0:
      pass
  return batch


def _run(cfg: Config, step_fn, data, ckpt, console: Console, say, show_progress: bool, t_start: float,
         on_step: Callable[[int], None] | None = None, first: dict | None = None) -> TrainResult:
  from meshlm.train.data import ByteTokenizer
  t = cfg.train
  state, start, rng, counters, data_state = restore_or_init(cfg, step_fn, ckpt, say)
  if data_state is not None:
    data.set_state(data_state)
    first = None  # read from the run's own data position
  evaluate = None
  if start < t.steps:
    # Before the run's records (config.yaml, metrics.jsonl, tensorboard/): an error in the first batch's rows or in
    # the validation set stops the run here, and leave_as_found removes the directories it made.
    if first is None:
      first = first_batch(cfg, data, step_fn.global_batch)
    if cfg.eval.path is not None:
      from meshlm.train.validation import Validation
      evaluate = Validation(cfg, step_fn)
  os.makedirs(cfg.run_dir, exist_ok=True)  # the run starts: a checkpoint.dir elsewhere did not make it
  if start < t.steps:  # "nothing to do" leaves the record as it is
    write_config(cfg)
  _trim_metrics(cfg.run_dir, start)
  writer = MetricsWriter(cfg.run_dir) if jax.process_index() == 0 else _NullWriter()
  if evaluate is not None:
    say(f"validation: {evaluate.describe()}", markup=False, highlight=False)
  step = _count_trained_tokens(step_fn) if getattr(data, "masked", False) else step_fn
  loop = Loop(cfg, step, ckpt, console, say, writer, step_fn.global_batch * t.seq_len, show_progress, t_start, on_step,
              evaluate=evaluate, progress_extra=part_metrics_text(cfg))
  pending = {start: first} if first is not None else {}
  out = loop.run(state, start, rng, counters, fetch=lambda i: step_fn.put_batch(pending.pop(i) if i in pending else
                                                                                next(data)),
                 position=data.get_state)
  state, losses, norms, first_step_s = out.state, out.losses, out.grad_norms, out.first_step_s
  stop_reason, saved, nonfinite_msg = out.stop_reason, out.saved, out.nonfinite_msg
  if nonfinite_msg:
    ckpt.wait()
    raise NonFiniteStop(nonfinite_msg)
  sample = None
  if stop_reason == "done" and t.sample_tokens:  # every process samples (generate gathers the tokens onto each)
    from meshlm.models.generate import generate
    tok = getattr(data, "tokenizer", None) or ByteTokenizer()
    prompt, shown, stops = sample_prompt(cfg, data, tok)
    room = cfg.model.max_position - len(prompt)
    if room > 0:
      gen = generate(cfg, merge_state(state.params, state.model_state), [prompt],
                     max_new_tokens=min(t.sample_tokens, room), temperature=t.sample_temperature, seed=t.seed,
                     stop_tokens=stops, mesh=step_fn.mesh)
      sample = shown + tok.decode(gen.token_lists()[0])
  return TrainResult(losses, norms, state, sample, first_step_s, start, stop_reason, saved, out.signal, cfg.run_dir)
