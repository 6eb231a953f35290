"""`meshlm bench`: argument handling and output (registered in cli.py)."""
from __future__ import annotations

from meshlm.commands.resolve import load_config
from meshlm.errors import ConfigError

BENCH_USAGE = ("meshlm bench [key=value ...] --arm NAME:k=v[,k=v] ... [--reps N] [--target-ci F [--max-seconds S]] "
               "[--timer wall|cpu] [--steps-per-rep K] [--warmup N] [--share on|off] [--park auto|on|off] [--json] "
               "[--plot PATH]")

BENCH_OPTIONS = """  --arm NAME:k=v[,k=v]  one arm: the base keys plus these overrides (repeat; the first is the baseline)
  --reps N              timed rounds (default 7); with 2+ arms at least 6, for a 95% interval on each ratio
  --target-ci F         add rounds until every ratio's half-width is <= F (0.01 = 1%); --reps is then the fewest
  --max-seconds S       bounds --target-ci (default 600)
  --timer wall|cpu      what a round measures (default wall)
  --steps-per-rep K     back-to-back steps per timed visit (default 1)
  --warmup N            untimed rounds first (default 2)
  --share on|off        arms whose programs take the same state layout step one state in turn (default on)
  --park auto|on|off    the idle states wait in host memory (default auto: on an accelerator, with 2+ states)
  --json, --plot PATH   the report as JSON; a per-round plot"""


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


def _float_opt(opts: dict, key: str, low: float, high: float) -> float | None:
  vals = opts.get(key)
  if not vals:
    return None
  try:
    x = float(vals[-1])
  except ValueError:
    raise ConfigError(f"{key}: expected a number, got {vals[-1]!r}") from None
  if not low < x <= high:
    raise ConfigError(f"{key}: must be in ({low:g}, {high:g}], got {vals[-1]}")
  return x


def cmd_bench(args: list[str], start: float) -> int:
  from meshlm.analysis.arms import build_arms, prepare_devices, split_args
  from meshlm.commands.census import dumps
  from meshlm.bench.harness import plot, render, run
  overrides, opts = split_args(args, {"--json": False, "--arm": True, "--reps": True, "--warmup": True,
                                      "--plot": True, "--steps-per-rep": True, "--target-ci": True,
                                      "--max-seconds": True, "--timer": True,
                                      "--park": True, "--share": True})
  # --reps: the number of rounds, or the fewest rounds before --target-ci may stop.
  reps = _int_opt(opts, "--reps", 7, 1)
  target_ci = _float_opt(opts, "--target-ci", 0.0, 1.0)
  max_seconds = _float_opt(opts, "--max-seconds", 0.0, float("inf"))
  if max_seconds is not None and target_ci is None:
    raise ConfigError("--max-seconds: only bounds --target-ci (without it, --reps rounds run); add --target-ci F")
  if target_ci is not None and max_seconds is None:
    max_seconds = 600.0  # a target that the machine's noise never reaches must still end
  timer = opts.get("--timer", ["wall"])[-1]
  if timer not in ("wall", "cpu"):
    raise ConfigError(f"--timer: expected wall or cpu, got {timer!r}")
  park = {"auto": None, "on": True, "off": False}.get(opts.get("--park", ["auto"])[-1], "bad")
  if park == "bad":
    raise ConfigError(f"--park: expected auto, on or off, got {opts['--park'][-1]!r}")
  share = {"on": True, "off": False}.get(opts.get("--share", ["on"])[-1], "bad")
  if share == "bad":
    raise ConfigError(f"--share: expected on or off, got {opts['--share'][-1]!r}")
  warmup = _int_opt(opts, "--warmup", 2, 0)
  steps_per_rep = _int_opt(opts, "--steps-per-rep", 1, 1)
  arms = build_arms(overrides, opts.get("--arm", []), min_arms=1, load=load_config)
  from meshlm.bench.stats import LEVEL, min_rounds
  # Without --target-ci exactly --reps rounds run; a ratio's interval needs min_rounds of them, so say so now.
  if len(arms) > 1 and target_ci is None and reps < min_rounds(LEVEL):
    raise ConfigError(f"--reps {reps}: comparing {len(arms)} arms needs at least {min_rounds(LEVEL)} rounds for a "
                      f"{LEVEL:.0%} interval on each ratio; use --reps {min_rounds(LEVEL)} or more, or --target-ci F")
  plot_path = opts.get("--plot", [None])[-1]
  if plot_path is not None:
    import os
    folder = os.path.dirname(os.path.abspath(plot_path))
    if not os.path.isdir(folder):
      raise ConfigError(f"--plot {plot_path}: folder {folder} does not exist")
  prepare_devices(arms)
  report = run(arms, reps, warmup, steps_per_rep=steps_per_rep, target_ci=target_ci, max_seconds=max_seconds,
               timer=timer, park=park, share=share)
  if plot_path is not None:
    plot(report, plot_path)
  print(dumps(report) if "--json" in opts else render(report))
  return 1 if any(a.get("error") for a in report["arms"].values()) else 0
