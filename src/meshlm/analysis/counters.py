"""The counting kinds of the census that parts declare (models/family.CensusCounter, Instrument.census): which
program each reads, the fields it reports, and the compiled loops' dead-work count.

A part names what should be counted for it (a kind, one of its named scopes and a census field) and the census
(analysis/census.py) runs every registered part's counters on every step, so a model without the part shows
its fields with zeros. "scope_gathers_scatters" is counted in the census's one pass over the executed StableHLO
(census.executed_counts); "scan_dead_work" is `scan_dead_work` below, on the compiled HLO.
"""
from __future__ import annotations

import re
from typing import Any

from meshlm.analysis import hlo as H
from meshlm.models import registry
from meshlm.models.family import CENSUS_KINDS, CensusCounter

DIRECTIONS = ("forward", "backward")
DEAD_WORK = ("chunk_scans", "zero_filled_outputs", "hoisted_zero_carries", "copies", "transposes")
# The counting kinds a part declares its counters in (models/family.CensusCounter): the program each reads and
# the fields it reports under the counter's own, in order.
KINDS = {
    "scope_gathers_scatters": ("stablehlo", tuple(f"{op}.{d}" for op in ("gathers", "scatters") for d in DIRECTIONS)),
    "scan_dead_work": ("hlo", DEAD_WORK),
}
assert set(KINDS) == set(CENSUS_KINDS), (sorted(KINDS), CENSUS_KINDS)


def part_counters() -> tuple[CensusCounter, ...]:
  """The counters every registered part declares (models/registry.census_counters), so a model without a part
  shows that part's fields with zeros. A counter of a StableHLO kind sits under the "stablehlo." fields."""
  counters = registry.census_counters()
  for c in counters:
    if (KINDS[c.kind][0] == "stablehlo") != c.field.startswith("stablehlo."):
      raise ValueError(f"census field {c.field!r}: a {c.kind} counter reads the {KINDS[c.kind][0]} program, so its "
                       f"field {'must' if KINDS[c.kind][0] == 'stablehlo' else 'may not'} start with 'stablehlo.'")
  return counters


def put(out: dict, dotted: str, value: Any) -> None:
  """out["a"]["b"] = value for "a.b" (a field that is already there is an error: two counters, one field)."""
  *parents, last = dotted.split(".")
  for key in parents:
    out = out.setdefault(key, {})
  assert last not in out, f"census field {dotted!r} is counted twice"
  out[last] = value


# ------------------------------------------------------------------------- scan_dead_work, on the compiled HLO

_ZERO_CONSTANT = re.compile(r"constant\((-?0(\.0*)?(e[+-]?0+)?|false)\)")
_LOOKS_THROUGH = ("bitcast", "copy", "reshape", "convert")


def _root(mod: H.HloModule, comp: str) -> H.Instr | None:
  items = mod.comps.get(comp) or []
  roots = [i for i in items if i.text.startswith("ROOT ")]
  return roots[0] if roots else (items[-1] if items else None)


def _local(mod: H.HloModule, comp: str) -> dict[str, H.Instr]:
  """comp's instructions by name (printed names repeat across computations)."""
  return {i.name: i for i in mod.comps.get(comp, [])}


def _zero_broadcast(mod: H.HloModule, comp: str, name: str) -> bool:
  """The instruction (of comp) is a broadcast of a scalar zero, looking through bitcasts, copies, reshapes,
  converts and XLA:CPU's one-op "wrapped_broadcast" fusions."""
  local = _local(mod, comp)
  ins = local.get(name)
  while ins is not None and ins.opcode in _LOOKS_THROUGH and ins.operands:
    ins = local.get(ins.operands[0])
  if ins is None or not ins.operands:
    return False
  if ins.opcode == "fusion":
    root = _root(mod, (ins.called.get("calls") or [""])[0])
    if root is None or root.opcode != "broadcast":
      return False
  elif ins.opcode != "broadcast":
    return False
  src = local.get(ins.operands[0])
  return src is not None and src.opcode == "constant" and bool(_ZERO_CONSTANT.search(src.text))


def _reachable(mod: H.HloModule, comp: str) -> set[str]:
  """comp and every computation it calls (fusions, nested loops), transitively."""
  out, todo = set(), [comp]
  while todo:
    c = todo.pop()
    if c in out or c not in mod.comps:
      continue
    out.add(c)
    todo.extend(callee for ins in mod.comps[c] for callees in ins.called.values() for callee in callees)
  return out


def _carries(mod: H.HloModule, loop: H.Instr) -> list[tuple[str, str, H.Array]]:
  """(computation, instruction name, array) of each operand of the loop's initial tuple."""
  comp, local = loop.comp, _local(mod, loop.comp)
  init = local.get(loop.operands[0]) if loop.operands else None
  # XLA:CPU may wrap the loop in a computation of its own: follow its parameter to the call site.
  for _ in range(4):
    if init is None or init.opcode != "parameter":
      break
    index = int(re.search(r"parameter\((\d+)\)", init.text).group(1))
    site = next((i for i in mod.instrs() if any(comp in c for c in i.called.values())), None)
    if site is None or index >= len(site.operands):
      return []
    comp, local = site.comp, _local(mod, site.comp)
    init = local.get(site.operands[index])
  if init is None or init.opcode != "tuple":
    return []
  return [(comp, n, local[n].out) for n in init.operands if n in local and local[n].out is not None]


def scan_dead_work(mod: H.HloModule, scope: str) -> dict[str, Any]:
  """A "scan_dead_work" counter: dead work around the compiled step's while loops whose op name holds `scope`
  (a backward loop keeps its scope inside transpose(jvp(...))), DEAD_WORK's fields (see docs/analysis.md)."""
  whiles = [ins for ins in mod.instrs() if ins.opcode == "while"]
  body = lambda loop: (loop.called.get("body") or [""])[0]
  scans = [w for w in whiles if scope in w.op_name]
  scan_comps = {w.comp for w in scans}
  zero_outputs, copies, transposes = 0, 0, 0
  shapes = set()
  for loop in scans:
    for comp, name, arr in _carries(mod, loop):
      shapes.add(arr.shape)
      # One slot per iteration: a scan output (JAX starts every one as a broadcast zero).
      zero_outputs += bool(loop.trip_count and arr.shape[:1] == (loop.trip_count,) and _zero_broadcast(mod, comp, name))
    for comp in _reachable(mod, body(loop)):
      for ins in mod.comps[comp]:
        copies += ins.opcode in ("copy", "copy-start")
        transposes += ins.opcode == "transpose"
  # A loop around the scope's loops (the layer scan) carrying a zero buffer of one of their buffers' shape:
  # XLA hoisted a fill out of the layer body and copies it into every iteration.
  hoisted = 0
  for loop in whiles:
    if loop in scans or not (_reachable(mod, body(loop)) & scan_comps):
      continue
    hoisted += sum(arr.shape in shapes and _zero_broadcast(mod, comp, name) for comp, name, arr in _carries(mod, loop))
  return dict(zip(DEAD_WORK, (len(scans), zero_outputs, hoisted, copies, transposes)))
