"""A run's directory: a fresh one by default, the keys a resume may change, and leaving the directory
as it was when a run fails before it starts.

  - run_dir=null (the default): a new `runs/<model_name>-<YYYYmmdd-HHMMSS>` is claimed with mkdir,
    so two runs started in the same second get two directories (the second gets a `-2` suffix).
  - Resuming (run_dir has a checkpoint) with settings that differ from its config.yaml is refused,
    naming the keys, except for config/resume.py's RESUMABLE: keys that change how long, how often or where
    the run goes, or how the step is compiled, and not what it trains. model.* and data.source/path are checked
    against the checkpoint itself (train/checkpoint.py), with messages of their own.
  - A run that fails before it starts (a bad data.path, a refused resume, Ctrl-C while compiling)
    removes the directories it created that are still empty, so the next command finds what was there.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
from typing import Iterator

import yaml

from meshlm.config import Config, to_yaml
from meshlm.config.resume import RESUMABLE, matches as _matches
from meshlm.errors import ConfigError

RUNS_ROOT = "runs"

# Checked against the checkpoint's own record (train/checkpoint.py), or the run's own address.
_CHECKED_ELSEWHERE = ("model.*", "model_name", "data.source", "data.path", "run_dir")


def fresh_run_dir(model_name: str, root: str = RUNS_ROOT, now: datetime.datetime | None = None) -> str:
  """Claims (creates) and returns a new `root/<model_name>-<YYYYmmdd-HHMMSS>[-N]`."""
  # A model=PATH run is named after the directory's last part, with nothing that would nest directories.
  name = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(os.path.normpath(model_name))).strip("-") or "run"
  stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
  for n in range(1, 10_000):
    path = os.path.join(root, f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
    try:
      os.makedirs(root, exist_ok=True)
      os.mkdir(path)  # atomic: of two runs in the same second, one gets -2
      return path
    except FileExistsError:
      continue
    except OSError as e:
      raise ConfigError(f"run_dir is null, and a fresh {path} cannot be created ({e.strerror or e}); "
                        "give run_dir=PATH") from None
  raise ConfigError(f"run_dir: {root}/{name}-{stamp}-N exists for every N up to 9999; give run_dir=PATH")


def _missing(path: str) -> list[str]:
  """path and its ancestors that do not exist yet, deepest first."""
  out, p = [], os.path.abspath(path)
  while not os.path.exists(p):
    out.append(p)
    p = os.path.dirname(p)
  return out


@contextlib.contextmanager
def leave_as_found(cfg: Config) -> Iterator[Config]:
  """Yields cfg with run_dir set (a fresh one claimed when it is null). If the block raises (any error,
  or Ctrl-C before the loop), the directories it created that are still empty are removed again."""
  from meshlm.train.checkpoint import checkpoint_dir
  made = []
  if cfg.run_dir is None:
    if cfg.distributed.enabled:
      raise ConfigError("run_dir is null (a fresh directory per run), but each process of a multi-process run "
                        "would pick its own; give every process the same run_dir=PATH")
    made = _missing(RUNS_ROOT)
    cfg = cfg.model_copy(update={"run_dir": fresh_run_dir(cfg.model_name)})
    made.insert(0, os.path.abspath(cfg.run_dir))
  made += _missing(cfg.run_dir) + _missing(checkpoint_dir(cfg))
  try:
    yield cfg
  except BaseException:
    for d in sorted(set(made), key=len, reverse=True):  # children before their parents
      with contextlib.suppress(OSError):  # not empty (the run wrote something) or already gone
        os.rmdir(d)
    raise


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def resume_mismatch(cfg: Config, step: int, ignore: tuple[str, ...] = ()) -> str | None:
  """The one-line refusal of resuming `step` with settings other than the run's config.yaml, or None.
  Keys in only one of the two (a meshlm that added or dropped a key since) are not compared, nor `ignore`'s
  (a trainer's keys derived from others: RL's train.per_device_batch_size follows rl.num_generations)."""
  path = os.path.join(cfg.run_dir, "config.yaml")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    saved = _flat(yaml.safe_load(f) or {})
  ours = _flat(yaml.safe_load(to_yaml(cfg)))  # through YAML too, so 1e-3 compares as the file wrote it
  diff = [k for k in ours if k in saved and ours[k] != saved[k]
          and not _matches(k, RESUMABLE) and not _matches(k, _CHECKED_ELSEWHERE) and k not in ignore]
  if not diff:
    return None
  what = "; ".join(f"{k} is {ours[k]!r} here but {saved[k]!r} there" for k in diff)
  return (f"run_dir={cfg.run_dir}: resuming its checkpoint at step {step} with settings other than its config.yaml "
          f"({what}); put {'it' if len(diff) == 1 else 'them'} back, or use a new run_dir "
          f"(checkpoint.load_params_from={cfg.run_dir} starts one from its parameters). "
          "Only the keys README.md's 'Stopping and resuming' lists may change on resume")
