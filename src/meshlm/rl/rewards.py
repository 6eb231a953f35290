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
so a reward written for TRL's GRPOTrainer (`completion[0]["content"]`) runs unchanged. The per-completion form always
gets the rendered prompt and the completion as strings (the messages are in row["prompt"]).
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
from typing import Callable, Sequence

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
  reward's values (NaN where it failed or gave None) and its failures."""
  total: list[float]
  each: dict[str, list[float]]
  failures: dict[str, Failures]


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

  def _call_batched(self, i: int, prompts, completions, rows, completion_ids, messages) -> list:
    f, spec, n = self.fns[i], self.specs[i] if self.specs else self.names[i], len(completions)
    cols = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)
            if k != "prompt" and not k.startswith("_")}
    if messages is not None:  # TRL's conversational shapes; copies, since a reward may edit them (TRL's pop)
      prompts = [copy.deepcopy(m) for m in messages]  # each its own, though a group shares one prompt
      completions = [[{"role": "assistant", "content": c}] for c in completions]
    kw = {"prompts": list(prompts), "completions": list(completions),
          "completion_ids": [list(c) for c in completion_ids] if completion_ids is not None else None, **cols}
    params = inspect.signature(f).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
      kw = {k: v for k, v in kw.items() if k in params}
    out = f(**kw)
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
               messages: Sequence[list[dict]] | None = None) -> Scored:
    """Scores each completion. prompts: the rendered prompts; messages: each prompt's messages when the prompts are
    conversational (the per-step form then gets TRL's conversational shapes), else None."""
    n = len(completions)
    each: dict[str, list[float]] = {}
    fails: dict[str, Failures] = {}
    for i, (name, f) in enumerate(zip(self.names, self.fns)):
      fl = fails[name] = Failures()
      vals = []
      if is_batched(f):
        try:
          raw = self._call_batched(i, prompts, completions, rows, completion_ids, messages)
        except RewardFailed:
          raise
        except Exception as e:  # noqa: BLE001 -- a user's reward must not kill the run unless it always fails
          raw, err = None, f"raised {type(e).__name__}: {e}"
          for _ in range(n):
            fl.add("raised", err)
          vals = [math.nan] * n
        if raw is not None:
          for v in raw:
            x, kind, what = _value(v)
            if kind:
              fl.add(kind, what)
            fl.none += v is None
            vals.append(x)
      else:
        for p, c, row in zip(prompts, completions, rows):
          try:
            v = f(p, c, row)
            x, kind, what = _value(v)
            fl.none += v is None
          except Exception as e:  # noqa: BLE001
            x, kind, what = math.nan, "raised", f"raised {type(e).__name__}: {e}"
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
    return Scored(total, each, fails)
