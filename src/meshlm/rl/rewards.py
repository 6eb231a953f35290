"""Rewards: (prompt, completion, row) -> float, built in or `module:function`, several with weights.

Built in (row is the prompt's JSONL object):
  exact_match     1 if the completion, stripped of surrounding whitespace, equals row["answer"], else 0
  numeric_match   1 if the first number in the completion equals float(row["answer"]), else 0
  regex           1 if rl.reward_regex is found in the completion, else 0
  length_penalty  -len(completion tokens) / rl.max_new_tokens (weights scale it)

A reward that raises scores 0 for that completion; Rewards.errors counts them per reward, and the
trainer warns with the count.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import re
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
    mod, _, fn = name.partition(":")
    try:
      f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError, ValueError) as e:
      raise ConfigError(f"rl.reward={name}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(f):
      raise ConfigError(f"rl.reward={name}: {fn} is not callable")
    return f
  raise ConfigError(f"rl.reward={name}: unknown reward; expected one of {', '.join(NAMES)} or module:function")


@dataclasses.dataclass
class Rewards:
  """The weighted sum of named rewards, with each one's values kept for its metrics."""
  names: list[str]
  fns: list[Callable]
  weights: list[float]
  errors: dict[str, int] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(cls, rl) -> "Rewards":
    fns = [resolve(n, regex=rl.reward_regex, max_new_tokens=rl.max_new_tokens) for n in rl.reward]
    weights = list(rl.reward_weights) if rl.reward_weights is not None else [1.0] * len(fns)
    return cls(list(rl.reward), fns, weights, {n: 0 for n in rl.reward})

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]
               ) -> tuple[list[float], dict[str, list[float]]]:
    """(total reward per completion, {name: its values}); a raising reward gives 0 and is counted."""
    each: dict[str, list[float]] = {n: [] for n in self.names}
    for p, c, row in zip(prompts, completions, rows):
      for n, f in zip(self.names, self.fns):
        try:
          v = float(f(p, c, row))
          if not math.isfinite(v):
            raise ValueError(f"non-finite reward {v}")
        except Exception:  # noqa: BLE001 -- a user's reward must not kill the run
          self.errors[n] += 1
          v = 0.0
        each[n].append(v)
    total = [sum(w * each[n][i] for n, w in zip(self.names, self.weights)) for i in range(len(completions))]
    return total, each
