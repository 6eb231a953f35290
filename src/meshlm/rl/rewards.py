"""Rewards: built in, `module:function` or `path/to/file.py:function`, several with weights.

Built in (row is the prompt's JSONL object):
  exact_match     1 if the completion, stripped of surrounding whitespace, equals row["answer"], else 0
  numeric_match   1 if the first number in the completion equals float(row["answer"]), else 0
  regex           1 if rl.reward_regex is found in the completion, else 0
  length_penalty  -len(completion tokens) / rl.max_new_tokens (weights scale it)

A user's function is called one of two ways, read from its signature:
  per completion  f(prompt, completion, row) -> float          (row: the JSONL object)
  per step (TRL)  f(prompts, completions, completion_ids, **columns) -> list of float | None, one per completion,
                  when it has a parameter named `completions`; columns are the JSONL fields but `prompt`, each a
                  list over the completions (a function without **kwargs gets only the ones it names).
The per-step form gets TRL's shapes: with plain-text prompts, prompts and completions are strings; with conversational
prompts (lists of messages), each prompt is its messages and each completion [{"role": "assistant", "content": text}],
so a reward written for TRL's GRPOTrainer (`completion[0]["content"]`) runs unchanged. It also gets TRL's
trainer_state (TrainerState: the step), log_metric(name, value) (a number into the step's metrics.jsonl record, the
mean of the step's calls) and log_extra(column, values) (one value per completion, into completions.jsonl's rows).
The per-completion form always gets the rendered prompt and the completion as strings (the messages are in
row["prompt"]). Either form may be `async def` (or return an awaitable): the step's awaitables are awaited
concurrently (asyncio.gather, as TRL's GRPOTrainer) on one event loop that lives in a daemon thread, after the
synchronous rewards ran.
`module:function` imports from the installed packages or, after them, the working directory;
`path/to/file.py:function` loads that file.

Each call's value is a number, None (TRL's "no reward here": NaN, never a failure; counted, `reward_none`), or a
failure: it raised, or it
returned NaN/inf or something that is not a number. rl.failed_reward decides what a failure scores: 0 (zero), or
NaN (exclude: left out of the weighted sum, and the completion out of its group's statistics when every reward
failed or gave None there, as TRL's rule for None). A reward that fails on every call of one step stops the run
(RewardFailed, a ConfigError: exit 2) with its first exception's type and message, or with what it returned, and the
shapes it was called with.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import threading
from typing import Any, Callable, Sequence

from meshlm.errors import ConfigError

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def exact_match(prompt: str, completion: str, row: dict) -> float:
  return float(completion.strip() == str(row["answer"]).strip())


def numeric_match(prompt: str, completion: str, row: dict) -> float:
  m = _NUMBER.search(completion)
  return float(m is not None and math.isclose(float(m.group()), float(row["answer"]), rel_tol=1e-9, abs_tol=1e-9))


BUILT_IN: dict[str, Callable] = {"exact_match": exact_match, "numeric_match": numeric_match}
NAMES = ("exact_match", "numeric_match", "regex", "length_penalty")


class RewardFailed(ConfigError):
  """A reward failed on every call of a step: the run stops (exit 2)."""


def _load_file(spec: str, path: str):
  """The module of a reward file, loaded once per path (a name of its own, so two `reward.py` files never clash)."""
  full = os.path.abspath(path)
  if not os.path.isfile(full):
    raise ConfigError(f"rl.reward={spec}: {path}: no such file")
  name = f"meshlm_reward_{re.sub(r'[^0-9A-Za-z_]', '_', os.path.splitext(os.path.basename(full))[0])}_" \
         f"{hashlib.sha1(full.encode()).hexdigest()[:8]}"
  if name in sys.modules:
    return sys.modules[name]
  mspec = importlib.util.spec_from_file_location(name, full)
  mod = importlib.util.module_from_spec(mspec)
  sys.modules[name] = mod  # before running it, as import does (dataclasses and pickling look it up)
  try:
    mspec.loader.exec_module(mod)
  except Exception as e:  # noqa: BLE001 -- the user's file: any error is theirs to see, in one line
    del sys.modules[name]
    raise ConfigError(f"rl.reward={spec}: loading {path} raised {type(e).__name__}: {e}") from None
  return mod


def _import(spec: str, mod: str):
  """module `mod`, from the installed packages or, after them, the working directory (the console script's
  sys.path holds its own bin directory, not the directory the user runs it from)."""
  cwd = os.getcwd()
  if cwd not in sys.path and "" not in sys.path:
    sys.path.append(cwd)
  try:
    return importlib.import_module(mod)
  except (ImportError, ValueError) as e:
    raise ConfigError(f"rl.reward={spec}: cannot import it ({type(e).__name__}: {e}; a module in the working "
                      f"directory {cwd} or on the Python path, or give a file: path/to/file.py:function)") from None
  except Exception as e:  # noqa: BLE001 -- the module's own code raised while importing
    raise ConfigError(f"rl.reward={spec}: importing {mod} raised {type(e).__name__}: {e}") from None


def resolve(name: str, *, regex: str | None, max_new_tokens: int) -> Callable:
  """The callable a rl.reward entry names, or ConfigError in one line."""
  if name in BUILT_IN:
    return BUILT_IN[name]
  if name == "regex":
    if regex is None:
      raise ConfigError("rl.reward: regex needs rl.reward_regex=PATTERN")
    try:
      rx = re.compile(regex)
    except re.error as e:
      raise ConfigError(f"rl.reward_regex={regex!r}: not a regular expression ({e})") from None
    return lambda prompt, completion, row: float(rx.search(completion) is not None)
  if name == "length_penalty":
    # The completion's token count rides in the row the trainer passes (row["_completion_tokens"]).
    return lambda prompt, completion, row: -float(row["_completion_tokens"]) / max_new_tokens
  if ":" in name:
    where, _, fn = name.rpartition(":")  # the last colon: a path may hold one (C:\...)
    if not where or not fn:
      raise ConfigError(f"rl.reward={name}: expected module:function or path/to/file.py:function")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    mod = _load_file(name, where) if is_file else _import(name, where)
    f = getattr(mod, fn, None)
    if f is None:
      raise ConfigError(f"rl.reward={name}: {where} has no {fn}")
    if not callable(f):
      raise ConfigError(f"rl.reward={name}: {fn} is not callable")
    return f
  raise ConfigError(f"rl.reward={name}: unknown reward; expected one of {', '.join(NAMES)}, module:function or "
                    "path/to/file.py:function")


def is_batched(fn: Callable) -> bool:
  """TRL's signature: a parameter named `completions` (the function takes the whole step at once)."""
  try:
    return "completions" in inspect.signature(fn).parameters
  except (TypeError, ValueError):  # a builtin without a signature: per completion
    return False


def called_with(batched: bool, chat: bool) -> str:
  """The shapes a reward was called with, in words (for its failure message)."""
  if not batched:
    return "f(prompt: str, completion: str, row: dict), once per completion"
  if chat:
    return ("TRL's conversational shapes: prompts as lists of messages, each completion as "
            "[{'role': 'assistant', 'content': str}]")
  return "TRL's standard shapes: prompts and completions as strings (the prompts are plain text)"


def short_names(specs: Sequence[str]) -> list[str]:
  """Each reward's metric name: a built-in's own, else the function's name; the whole entry where two collide."""
  short = [s.rpartition(":")[2] if ":" in s else s for s in specs]
  names = [sh if short.count(sh) == 1 else s for sh, s in zip(short, specs)]
  dup = next((n for n in names if names.count(n) > 1), None)
  if dup is not None:
    raise ConfigError(f"rl.reward lists {dup} twice; give each reward once (rl.reward_weights weighs them)")
  return names


@dataclasses.dataclass
class Failures:
  """One reward's failures in one step."""
  raised: int = 0
  nan: int = 0
  other: int = 0  # returned something that is not a number
  none: int = 0  # returned None (TRL's "no reward here"): not a failure
  first: str | None = None  # the first failure, in words: "raised KeyError: 'answer'", "returned nan"

  def add(self, kind: str, what: str) -> None:
    setattr(self, kind, getattr(self, kind) + 1)
    self.first = self.first or what

  @property
  def total(self) -> int:
    return self.raised + self.nan + self.other


@dataclasses.dataclass
class Scored:
  """A step's rewards: the weighted total per completion (NaN: unscorable, rl.failed_reward=exclude), each
  reward's values (NaN where it failed or gave None) and its failures; what the rewards logged: log_metric's
  means and log_extra's columns (one value per completion)."""
  total: list[float]
  each: dict[str, list[float]]
  failures: dict[str, Failures]
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  extra: dict[str, list] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TrainerState:
  """TRL's `trainer_state` (transformers' TrainerState): the fields a reward reads of it, for curriculum rewards
  (`trainer_state.global_step / trainer_state.max_steps`)."""
  global_step: int  # the updates done before this rollout (rl.num_iterations per RL step): TRL's optimizer steps
  max_steps: int  # train.steps x rl.num_iterations
  epoch: float  # the prompts drawn before this step / the prompts in rl.prompts
  num_train_epochs: int  # the epochs train.steps draws, rounded up
  is_world_process_zero: bool
  is_local_process_zero: bool


class _Logs:
  """TRL's log_metric and log_extra of one scoring, which the rewards call."""

  def __init__(self, n: int):
    self.n = n  # the completions scored
    self.metrics: dict[str, list[float]] = {}  # every value logged under each name
    self.extra: dict[str, list] = {}  # one value per completion under each column

  def log_metric(self, name: str, value: float) -> None:
    if not isinstance(name, str) or not name:
      raise TypeError(f"log_metric: the name must be a non-empty string, got {name!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      try:
        value = float(value)  # numpy scalars, 0-d arrays
      except (TypeError, ValueError):
        raise TypeError(f"log_metric({name!r}, ...): {type(value).__name__} {value!r:.40} is not a number") from None
    self.metrics.setdefault(name, []).append(float(value))

  def log_extra(self, column: str, values) -> None:
    values = list(values)
    if len(values) != self.n:
      raise ValueError(f"log_extra({column!r}, ...): {len(values)} values for {self.n} completions; give one per "
                       "completion")
    self.extra[column] = values  # a column logged twice in a step (two of TRL's rewards log "solution"): the last


class _Raised:
  """A call's exception, in its value's place."""

  def __init__(self, error: Exception):
    self.error = error


_LOOP: asyncio.AbstractEventLoop | None = None


def _await_all(awaitables: list) -> list:
  """Each awaitable's value (or _Raised), awaited concurrently with asyncio.gather (TRL's GRPOTrainer runs its async
  rewards so) on one event loop kept in a daemon thread for the process (as TRL keeps one per trainer): an async
  client a reward keeps between steps stays on its loop, and a caller's own running loop is never needed."""
  global _LOOP
  if _LOOP is None:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="meshlm-rewards", daemon=True).start()
    _LOOP = loop

  async def one(aw):
    try:
      return await aw
    except Exception as e:  # noqa: BLE001 -- a user's reward; counted as its failure
      return _Raised(e)

  async def every():
    return await asyncio.gather(*(one(a) for a in awaitables))
  return asyncio.run_coroutine_threadsafe(every(), _LOOP).result()


def _value(v) -> tuple[float, str | None, str | None]:
  """(the float, the failure kind or None, the failure in words) of one returned value; None is NaN, no failure."""
  if v is None:
    return math.nan, None, None
  if isinstance(v, bool) or not isinstance(v, numbers.Real):
    try:  # numpy scalars and 0-d arrays are Real-like without the ABC
      x = float(v)
    except (TypeError, ValueError):
      return math.nan, "other", f"returned {type(v).__name__} {v!r:.60}, not a number"
  else:
    x = float(v)
  if not math.isfinite(x):
    return math.nan, "nan", f"returned {x}"
  return x, None, None


@dataclasses.dataclass
class Rewards:
  """The weighted sum of named rewards, with each one's values kept for its metrics."""
  names: list[str]
  fns: list[Callable]
  weights: list[float]
  specs: list[str] = dataclasses.field(default_factory=list)
  failed: str = "zero"
  errors: dict[str, int] = dataclasses.field(default_factory=dict)  # raised, so far (checkpointed)
  nans: dict[str, int] = dataclasses.field(default_factory=dict)  # returned NaN/inf or a non-number, so far
  nones: dict[str, int] = dataclasses.field(default_factory=dict)  # returned None, so far

  @classmethod
  def from_config(cls, rl) -> "Rewards":
    fns = [resolve(n, regex=rl.reward_regex, max_new_tokens=rl.max_new_tokens) for n in rl.reward]
    names = short_names(rl.reward)
    weights = list(rl.reward_weights) if rl.reward_weights is not None else [1.0] * len(fns)
    return cls(names, fns, weights, list(rl.reward), rl.failed_reward, {n: 0 for n in names}, {n: 0 for n in names},
               {n: 0 for n in names})

  def _call_batched(self, i: int, prompts, completions, rows, completion_ids, messages, context: dict) -> Any:
    """What TRL's form returns (a list, or an awaitable of one): called with TRL's keyword arguments, those a function
    without **kwargs names."""
    f = self.fns[i]
    cols = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)
            if k != "prompt" and not k.startswith("_")}
    if messages is not None:  # TRL's conversational shapes; copies, since a reward may edit them (TRL's pop)
      prompts = [copy.deepcopy(m) for m in messages]  # each its own, though a group shares one prompt
      completions = [[{"role": "assistant", "content": c}] for c in completions]
    kw = {"prompts": list(prompts), "completions": list(completions),
          "completion_ids": [list(c) for c in completion_ids] if completion_ids is not None else None, **cols,
          **context}
    params = inspect.signature(f).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
      kw = {k: v for k, v in kw.items() if k in params}
    return f(**kw)

  def _listed(self, i: int, out, n: int) -> list:
    """A per-step reward's return value as its n values; anything else stops the run (RewardFailed)."""
    spec = self.specs[i] if self.specs else self.names[i]
    try:
      out = list(out)
    except TypeError:
      raise RewardFailed(f"rl.reward={spec}: a per-step reward (it takes `completions`) returned "
                         f"{type(out).__name__}, not a list of {n} values") from None
    if len(out) != n:
      raise RewardFailed(f"rl.reward={spec}: returned {len(out)} values for {n} completions; return one per "
                         "completion (None where it has none)")
    return out

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict],
               completion_ids: Sequence[Sequence[int]] | None = None,
               messages: Sequence[list[dict]] | None = None, state: TrainerState | None = None) -> Scored:
    """Scores each completion. prompts: the rendered prompts; messages: each prompt's messages when the prompts are
    conversational (the per-step form then gets TRL's conversational shapes), else None; state: TRL's
    trainer_state. The synchronous rewards run in order, then every awaitable they returned at once."""
    n = len(completions)
    logs = _Logs(n)
    context = {"trainer_state": state, "log_metric": logs.log_metric, "log_extra": logs.log_extra}
    raw: list[Any] = []  # per reward: a per-step reward's return value (or _Raised), a per-completion one's values
    pending: list[tuple[int, int | None, Any]] = []  # (reward, completion or None for the whole step, awaitable)
    for i, f in enumerate(self.fns):
      if is_batched(f):
        try:
          out = self._call_batched(i, prompts, completions, rows, completion_ids, messages, context)
        except Exception as e:  # noqa: BLE001 -- a user's reward must not kill the run unless it always fails
          out = _Raised(e)
        if inspect.isawaitable(out):
          pending.append((i, None, out))
        raw.append(out)
      else:
        vals = []
        for j, (p, c, row) in enumerate(zip(prompts, completions, rows)):
          try:
            v = f(p, c, row)
          except Exception as e:  # noqa: BLE001
            v = _Raised(e)
          if inspect.isawaitable(v):
            pending.append((i, j, v))
          vals.append(v)
        raw.append(vals)
    if pending:
      for (i, j, _), v in zip(pending, _await_all([aw for _, _, aw in pending])):
        if j is None:
          raw[i] = v
        else:
          raw[i][j] = v
    each: dict[str, list[float]] = {}
    fails: dict[str, Failures] = {}
    for i, (name, f) in enumerate(zip(self.names, self.fns)):
      fl = fails[name] = Failures()
      out = raw[i]
      if is_batched(f):
        if isinstance(out, _Raised):
          out = [out] * n  # it raised: a failure of every completion
        else:
          out = self._listed(i, out, n)
      vals = []
      for v in out:
        if isinstance(v, _Raised):
          x, kind, what = math.nan, "raised", f"raised {type(v.error).__name__}: {v.error}"
        else:
          x, kind, what = _value(v)
          fl.none += v is None
        if kind:
          fl.add(kind, what)
        vals.append(x)
      if n and fl.total == n:
        spec = self.specs[i] if self.specs else name
        mixed = n not in (fl.raised, fl.nan, fl.other)
        raise RewardFailed(f"rl.reward={spec} failed on every one of the step's {n} completions; the first "
                           f"{fl.first}" + (f" ({fl.raised} raised, {fl.nan} returned nan or inf, {fl.other} no number)"
                                            if mixed else "") +
                           f"; it was called with {called_with(is_batched(f), messages is not None)}")
      self.errors[name] = self.errors.get(name, 0) + fl.raised
      self.nans[name] = self.nans.get(name, 0) + fl.nan + fl.other
      self.nones[name] = self.nones.get(name, 0) + fl.none
      # What enters the sum: zero scores a failure (and None) 0; exclude keeps NaN, left out below.
      each[name] = vals if self.failed == "exclude" else [0.0 if math.isnan(v) else v for v in vals]
    total = []
    for j in range(n):
      vs = [(w, each[nm][j]) for nm, w in zip(self.names, self.weights) if not math.isnan(each[nm][j])]
      total.append(sum(w * v for w, v in vs) if vs else math.nan)  # NaN only under exclude: nothing scored it
    metrics = {k: sum(v) / len(v) for k, v in logs.metrics.items()}  # TRL: the mean of the step's calls
    return Scored(total, each, fails, metrics, logs.extra)
