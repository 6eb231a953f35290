"""Arms for compare and bench: `--arm NAME:k=v[,k=v]`, validated before anything compiles."""
from __future__ import annotations

import dataclasses
import re

from meshlm.config import load_config
from meshlm.errors import ConfigError


@dataclasses.dataclass
class Arm:
  name: str
  overrides: list[str]
  cfg: object


def split_args(args: list[str], flags: dict[str, bool]) -> tuple[list[str], dict[str, list[str]]]:
  """Separates key=value overrides from --options. flags maps option -> takes a value."""
  overrides: list[str] = []
  opts: dict[str, list[str]] = {}
  i = 0
  while i < len(args):
    a = args[i]
    if a.startswith("--"):
      key, eq, val = a.partition("=")
      if key not in flags:
        raise ConfigError(f"{key}: unknown option; options: {', '.join(sorted(flags))}")
      if flags[key]:
        if not eq:
          if i + 1 >= len(args):
            raise ConfigError(f"{key}: needs a value")
          i += 1
          val = args[i]
        opts.setdefault(key, []).append(val)
      else:
        opts.setdefault(key, []).append("")
    else:
      overrides.append(a)
    i += 1
  return overrides, opts


def parse_arm(spec: str) -> tuple[str, list[str]]:
  """'explicit:shard_mode=explicit,weight_grad_impl=auto_axes' -> (name, [overrides])."""
  name, sep, body = spec.partition(":")
  name = name.strip()
  if not sep or not re.match(r"^[\w.+-]+$", name):
    raise ConfigError(f"--arm {spec!r}: expected NAME:key=value[,key=value] (NAME of letters, digits, _ . + -)")
  overrides = [kv.strip() for kv in body.split(",") if kv.strip()] if body else []
  return name, overrides


def build_arms(base: list[str], specs: list[str], *, min_arms: int = 1, load=load_config) -> list[Arm]:
  """Validates every arm's config (base overrides, then the arm's). Fails before any compilation.

  load: the config loader; the commands pass theirs, which also resolves model=PATH.
  """
  if len(specs) < min_arms:
    raise ConfigError(f"--arm: need at least {min_arms} arms, got {len(specs)}")
  arms: list[Arm] = []
  seen: set[str] = set()
  for spec in specs:
    name, overrides = parse_arm(spec)
    if name in seen:
      raise ConfigError(f"--arm {name}: duplicate arm name")
    seen.add(name)
    try:
      cfg = load(*base, *overrides)
    except ConfigError as e:
      raise ConfigError(f"--arm {name}: {e}") from None
    arms.append(Arm(name, overrides, cfg))
  devices = {a.cfg.cpu_devices for a in arms}
  if len(devices) > 1:
    raise ConfigError(f"--arm: every arm must use the same cpu_devices (got {sorted(map(str, devices))}); "
                      "set cpu_devices once, outside the arms")
  return arms


def prepare_devices(arms: list[Arm]) -> None:
  """Sets the fake device count once, then checks every arm's mesh against it (still no compile)."""
  from meshlm.parallel import set_cpu_devices
  from meshlm.parallel.mesh import make_mesh
  set_cpu_devices(arms[0].cfg.cpu_devices)
  for arm in arms:
    try:
      make_mesh(arm.cfg)
    except ConfigError as e:
      raise ConfigError(f"--arm {arm.name}: {e}") from None
