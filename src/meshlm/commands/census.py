"""`meshlm census` and `meshlm compare`: argument handling and output (registered in cli.py)."""
from __future__ import annotations

import json
import sys

from meshlm.commands.resolve import load_config
from meshlm.errors import ConfigError

CENSUS_USAGE = "meshlm census [key=value ...] [--json]"
COMPARE_USAGE = "meshlm compare [key=value ...] --arm NAME:k=v[,k=v] --arm NAME:k=v[,k=v] [--json]"
CENSUS_OPTIONS = "  --json  the census as JSON (field list: docs/analysis.md); nothing runs, the step is only compiled"
COMPARE_OPTIONS = """  --arm NAME:k=v[,k=v]  one arm: the base keys plus these overrides (at least 2; the first is the baseline)
  --json                the report as JSON"""


def dumps(obj) -> str:
  """Stable JSON: sorted keys, fixed indentation, so two runs of the same config diff cleanly."""
  return json.dumps(obj, indent=2, sort_keys=True, default=str)


def cmd_census(args: list[str], start: float) -> int:
  from meshlm.analysis.arms import split_args
  from meshlm.analysis.census import census, render
  from meshlm.parallel import set_cpu_devices
  from meshlm.parallel.mesh import make_mesh
  overrides, opts = split_args(args, {"--json": False})
  cfg = load_config(*overrides)
  set_cpu_devices(cfg.cpu_devices)
  make_mesh(cfg)  # validates the mesh before anything compiles
  result = census(cfg)
  print(dumps(result) if "--json" in opts else render(result))
  return 0


def cmd_compare(args: list[str], start: float) -> int:
  from meshlm.analysis.arms import build_arms, prepare_devices, split_args
  from meshlm.analysis.census import census_of, config_summary, lower_and_compile
  from meshlm.analysis.compare import compare, render
  overrides, opts = split_args(args, {"--json": False, "--arm": True})
  arms = build_arms(overrides, opts.get("--arm", []), min_arms=2, load=load_config)
  prepare_devices(arms)
  results, texts, errors = {}, {}, {}
  for arm in arms:
    try:
      low = lower_and_compile(arm.cfg)
    except Exception as e:  # one arm's failure (e.g. out of memory at lowering) must not hide the others
      errors[arm.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      print(f"meshlm compare: arm {arm.name} failed: {errors[arm.name]}", file=sys.stderr)
      continue
    results[arm.name] = census_of(low) | {"config": config_summary(arm.cfg)}
    texts[arm.name] = low.hlo
  if not results:
    raise ConfigError("compare: every arm failed (" + "; ".join(f"{k}: {v}" for k, v in errors.items()) + ")")
  report = compare(results, texts)
  report["errors"] = errors
  print(dumps(report) if "--json" in opts else render(report))
  return 1 if errors else 0
