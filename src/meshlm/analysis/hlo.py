"""A reader for optimized HLO text (`Compiled.as_text()`): computations, instructions, call graph.

Each instruction keeps its opcode, result shape and layout, operands, the computations it calls
and its metadata op_name (the named-scope path that survives compilation). `multipliers` says how
many times each computation runs per step: a `while` body counts its trip count (the backend config's
known_trip_count, or on XLA:TPU, which prints none, the count its condition and start value give), or once
per start where neither gives one (`unread_loops` names those).
"""
from __future__ import annotations

import dataclasses
import math
import re

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.-]+)\s*(\(.*\))?\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128|token)"
                    r"\[([\d,]*)\](\{[^}]*\})?")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|branch_computations)=(\{[^}]*\}|%?[\w.-]+)")

DTYPE_BYTES = {"pred": 1, "s4": 1, "s8": 1, "s16": 2, "s32": 4, "s64": 8, "u4": 1, "u8": 1, "u16": 2, "u32": 4,
               "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
               "token": 0}


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  shape: tuple[int, ...]
  layout: tuple[int, ...] | None  # minor-to-major, None when not printed

  @property
  def elements(self) -> int:
    return math.prod(self.shape)

  @property
  def bytes(self) -> int:
    return self.elements * DTYPE_BYTES.get(self.dtype, 4)

  def __str__(self) -> str:
    lay = "" if self.layout is None else "{" + ",".join(map(str, self.layout)) + "}"
    return f"{self.dtype}[{','.join(map(str, self.shape))}]{lay}"


@dataclasses.dataclass
class Instr:
  comp: str
  name: str
  opcode: str
  result: list[Array]  # one per array in the result (tuples flattened)
  operands: list[str]
  called: dict[str, list[str]]
  op_name: str
  trip_count: int | None
  text: str

  @property
  def out(self) -> Array | None:
    return max(self.result, key=lambda a: a.elements) if self.result else None


@dataclasses.dataclass
class HloModule:
  comps: dict[str, list[Instr]]
  entry: str
  by_name: dict[str, Instr]
  multipliers: dict[str, int]

  def instrs(self):
    for comp, items in self.comps.items():
      for ins in items:
        yield ins

  def unread_loops(self) -> list[Instr]:
    """The `while`s the entry reaches whose trip count was not read (multipliers counts their bodies once)."""
    return [i for i in self.instrs() if i.opcode == "while" and i.trip_count is None and i.comp in self.multipliers]


def _arrays(text: str) -> list[Array]:
  out = []
  for dtype, dims, layout in _ARRAY.findall(text):
    shape = tuple(int(d) for d in dims.split(",") if d)
    lay = None
    if layout:
      inner = layout[1:-1].split(":")[0]
      lay = tuple(int(d) for d in inner.split(",") if d.strip().isdigit())
    out.append(Array(dtype, shape, lay))
  return out


def _split_type_and_rest(rhs: str) -> tuple[str, str]:
  """'f32[2]{0} add(...)' or '(f32[2], s32[]) while(...)' -> (type text, 'opcode(...)...')."""
  if rhs.startswith("("):
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rhs[: i + 1], rhs[i + 1:].strip()
  head, _, rest = rhs.partition(" ")
  return head, rest.strip()


def parse(text: str) -> HloModule:
  comps: dict[str, list[Instr]] = {}
  by_name: dict[str, Instr] = {}
  entry = ""
  comp = ""
  for line in text.splitlines():
    if not line.strip() or line.startswith("HloModule"):
      continue
    m = _COMP.match(line)
    if m and not _INSTR.match(line):
      comp = m.group(2)
      comps[comp] = []
      if m.group(1):
        entry = comp
      continue
    m = _INSTR.match(line)
    if not m or not comp:
      continue
    name, rhs = m.group(2), m.group(3)
    type_text, rest = _split_type_and_rest(rhs)
    opcode = rest.split("(", 1)[0].strip()
    args = rest[len(opcode):]
    # Operands sit in the first parenthesised group after the opcode.
    depth, end = 0, 0
    for i, ch in enumerate(args):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0 and i > 0:
        end = i
        break
    operands = re.findall(r"%([\w.-]+)", args[: end + 1])
    called: dict[str, list[str]] = {}
    for key, val in _CALLED.findall(args):
      called[key] = re.findall(r"%?([\w.-]+)", val.strip("{}"))
    meta = _OPNAME.search(args)
    trip = _TRIP.search(args)
    ins = Instr(comp, name, opcode, _arrays(type_text), operands, called, meta.group(1) if meta else "",
                int(trip.group(1)) if trip else None, line.strip())
    comps[comp].append(ins)
    by_name[name] = ins
  for ins in by_name.values():
    if ins.opcode == "while" and ins.trip_count is None:
      ins.trip_count = _counted_trips(comps, ins)
  return HloModule(comps, entry, by_name, _multipliers(comps, entry))


_CONSTANT = re.compile(r"\bconstant\((-?\d+)\)")
_INDEX = re.compile(r"\bindex=(\d+)")


def _through_copies(local: dict[str, Instr], name: str) -> Instr | None:
  ins = local.get(name)
  while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
    ins = local.get(ins.operands[0])
  return ins


def _root(items: list[Instr]) -> Instr | None:
  return next((i for i in items if i.text.startswith("ROOT ")), None)


def _resolved(comps: dict[str, list[Instr]], local: dict[str, Instr], ins: Instr) -> tuple[Instr, list]:
  """(the instruction that computes ins, its operands): ins and its operands in `local`, or for a fusion (XLA:CPU
  wraps a loop's compare and add in one each) its fused root, whose parameters stand for the fusion's operands
  (an operand computed inside the fusion is that inner instruction). An operand not found is None."""
  if ins.opcode != "fusion":
    return ins, [local.get(o) for o in ins.operands]
  fused = comps.get((ins.called.get("calls") or [""])[0]) or []
  froot = _root(fused)
  if froot is None:
    return ins, []
  inner = {i.name: i for i in fused}
  operands = []
  for o in froot.operands:
    f = inner.get(o)
    m = re.search(r"parameter\((\d+)\)", f.text) if f is not None and f.opcode == "parameter" else None
    operands.append(local.get(ins.operands[int(m.group(1))]) if m and int(m.group(1)) < len(ins.operands) else f)
  return froot, operands


def _step(comps: dict[str, list[Instr]], loop: Instr, k: int) -> int | None:
  """How much the body adds to tuple element k per trip: its root's element k is `element k + S` for a constant
  S (through copies, or as a fusion whose root is that add). None for any other update."""
  items = comps.get((loop.called.get("body") or [""])[0]) or []
  local = {i.name: i for i in items}
  root = _root(items)
  if root is None or root.opcode != "tuple" or k >= len(root.operands):
    return None
  upd = _through_copies(local, root.operands[k])
  if upd is None:
    return None
  upd, operands = _resolved(comps, local, upd)
  if upd.opcode != "add" or len(operands) != 2 or any(o is None for o in operands):
    return None
  const = [o for o in operands if o.opcode == "constant"]
  other = [o for o in operands if o.opcode != "constant"]
  if len(const) != 1 or len(other) != 1:
    return None
  src = _through_copies(local, other[0].name) if other[0].name in local else other[0]
  index = _INDEX.search(src.text) if src is not None and src.opcode == "get-tuple-element" else None
  value = _CONSTANT.search(const[0].text)
  if index is None or int(index.group(1)) != k or value is None or int(value.group(1)) <= 0:
    return None
  return int(value.group(1))


def _counted_trips(comps: dict[str, list[Instr]], loop: Instr) -> int | None:
  """A while's trip count when its backend config does not say it (XLA:TPU prints none): the condition is
  `counter < N` for a constant N (the compare itself or a fusion of it), the counter is element k of the loop's
  tuple, the loop starts it at a constant C (through copies) and the body adds a constant S to it, so it runs
  ceil((N - C) / S) times (a scan's S is 1; XLA:TPU's windowed-einsum loops step by 2). None otherwise (a bound
  read from the state: a while_loop's, or an update that is not a constant step)."""
  cond = comps.get((loop.called.get("condition") or [""])[0]) or []
  local = {i.name: i for i in cond}
  root = _root(cond)
  if root is None:
    return None
  root, operands = _resolved(comps, local, root)
  if root.opcode != "compare" or "direction=LT" not in root.text or len(operands) != 2:
    return None
  counter, bound = operands
  if counter is None or bound is None or counter.opcode != "get-tuple-element" or bound.opcode != "constant":
    return None
  k, n = _INDEX.search(counter.text), _CONSTANT.search(bound.text)
  outer = {i.name: i for i in comps.get(loop.comp, [])}
  init = outer.get(loop.operands[0]) if loop.operands else None
  if k is None or n is None or init is None or init.opcode != "tuple" or int(k.group(1)) >= len(init.operands):
    return None
  start = _through_copies(outer, init.operands[int(k.group(1))])
  c = _CONSTANT.search(start.text) if start is not None and start.opcode == "constant" else None
  step = _step(comps, loop, int(k.group(1))) if c else None
  return max(0, -(-(int(n.group(1)) - int(c.group(1))) // step)) if step else None


def _multipliers(comps: dict[str, list[Instr]], entry: str) -> dict[str, int]:
  """Times each computation runs per execution of the entry: while bodies count their trip count."""
  mult: dict[str, int] = {entry: 1}
  order = [entry]
  seen = {entry}
  while order:
    comp = order.pop(0)
    for ins in comps.get(comp, []):
      for key, callees in ins.called.items():
        factor = ins.trip_count if (ins.opcode == "while" and key in ("body", "condition") and ins.trip_count) else 1
        for c in callees:
          if c not in comps:
            continue
          mult[c] = max(mult.get(c, 0), mult[comp] * factor)
          if c not in seen:
            seen.add(c)
            order.append(c)
  return mult
