"""`meshlm bench`: argument handling and output (registered in cli.py)."""
from __future__ import annotations

from meshlm.config import ConfigError

BENCH_USAGE = "meshlm bench [key=value ...] --arm NAME:k=v[,k=v] ... --reps N [--steps-per-rep K] [--warmup N] [--json] [--plot PATH]"


def _int_opt(opts: dict, key: str, default: int, minimum: int) -> int:
  vals = opts.get(key)
  if not vals:
    return default
  try:
    n = int(vals[-1])
  except ValueError:
    raise ConfigError(f"{key}: expected an integer, got {vals[-1]!r}") from None
  if n < minimum:
    raise ConfigError(f"{key}: must be at least {minimum}, got {n}")
  return n


def cmd_bench(args: list[str], start: float) -> int:
  from meshlm.analysis.arms import build_arms, prepare_devices, split_args
  from meshlm.analysis.commands import dumps
  from meshlm.bench.harness import plot, render, run
  overrides, opts = split_args(args, {"--json": False, "--arm": True, "--reps": True, "--warmup": True,
                                      "--plot": True, "--steps-per-rep": True})
  reps = _int_opt(opts, "--reps", 7, 1)
  warmup = _int_opt(opts, "--warmup", 2, 0)
  steps_per_rep = _int_opt(opts, "--steps-per-rep", 1, 1)
  arms = build_arms(overrides, opts.get("--arm", []), min_arms=1)
  plot_path = opts.get("--plot", [None])[-1]
  if plot_path is not None:
    import os
    folder = os.path.dirname(os.path.abspath(plot_path))
    if not os.path.isdir(folder):
      raise ConfigError(f"--plot {plot_path}: folder {folder} does not exist")
  prepare_devices(arms)
  report = run(arms, reps, warmup, steps_per_rep=steps_per_rep)
  if plot_path is not None:
    plot(report, plot_path)
  print(dumps(report) if "--json" in opts else render(report))
  return 1 if any(a.get("error") for a in report["arms"].values()) else 0
