"""A reader for optimized HLO text (`Compiled.as_text()`): computations, instructions, call graph.

Each instruction keeps its opcode, result shape and layout, operands, the computations it calls
and its metadata op_name (the named-scope path that survives compilation). `multipliers` says how
many times each computation runs per step: a `while` body counts its trip count (the backend config's
known_trip_count, or on XLA:TPU, which prints none, the count its condition and start value give; where the
start or the bound is computed from an enclosing loop's counter, as a causal block loop's is, the trips of each
of that loop's iterations, evaluated and averaged: `mean_trips`), or once per start where none of these gives one
(`unread_loops` names those).
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.-]+)\s*(\(.*\))?\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128|token)"
                    r"\[([\d,]*)\](\{[^}]*\})?")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_SPACE = re.compile(r"S\((\d+)\)")
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
  # Where the buffer lives: the layout's S(n), 0 (device memory, HBM) when not printed; XLA:TPU puts buffers its
  # memory-space assignment keeps on chip in 1 (VMEM).
  memory_space: int = 0

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
  # A loop whose trip count differs between starts but follows from the enclosing loop's counter (a causal
  # block loop: i + 1 key blocks for query block i): its trips per start, averaged over the enclosing loop's.
  mean_trips: float | None = None

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
    return [i for i in self.instrs() if i.opcode == "while" and i.trip_count is None and i.mean_trips is None
            and i.comp in self.multipliers]


def _arrays(text: str) -> list[Array]:
  out = []
  for dtype, dims, layout in _ARRAY.findall(text):
    shape = tuple(int(d) for d in dims.split(",") if d)
    lay, space = None, 0
    if layout:
      inner = layout[1:-1].split(":")[0]
      lay = tuple(int(d) for d in inner.split(",") if d.strip().isdigit())
      m = _SPACE.search(layout)
      space = int(m.group(1)) if m else 0
    out.append(Array(dtype, shape, lay, space))
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
  unread = [i for i in by_name.values() if i.opcode == "while" and i.trip_count is None]
  if unread:
    ev = _Evaluator(comps)
    runs = {(i.called.get("body") or [""])[0]: i for i in by_name.values() if i.opcode == "while" and i.trip_count}
    for ins in unread:
      ins.mean_trips = _trips_over_enclosing_loop(ev, runs.get(ins.comp), ins)
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


def _multipliers(comps: dict[str, list[Instr]], entry: str) -> dict[str, float]:
  """Times each computation runs per execution of the entry: while bodies count their trip count (or their mean
  trips per start, mean_trips)."""
  mult: dict[str, int] = {entry: 1}
  order = [entry]
  seen = {entry}
  while order:
    comp = order.pop(0)
    for ins in comps.get(comp, []):
      for key, callees in ins.called.items():
        trips = (ins.trip_count or ins.mean_trips) if ins.opcode == "while" else None
        factor = trips if (key in ("body", "condition") and trips is not None) else 1
        for c in callees:
          if c not in comps:
            continue
          mult[c] = max(mult.get(c, 0), mult[comp] * factor)
          if c not in seen:
            seen.add(c)
            order.append(c)
  return mult


# --- trip counts that follow from an enclosing loop's counter ---------------------------------------------------

_DIRECTION = re.compile(r"direction=(\w+)")
_COMPARE = {"LT": np.less, "LE": np.less_equal, "GT": np.greater, "GE": np.greater_equal, "EQ": np.equal,
            "NE": np.not_equal}
_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "minimum": np.minimum,
           "maximum": np.maximum, "and": np.bitwise_and, "or": np.bitwise_or,
           # HLO's integer division rounds toward zero, its remainder takes the dividend's sign
           "divide": lambda a, b: np.trunc(a / b).astype(np.result_type(a, b)),
           "remainder": np.fmod, "xor": np.bitwise_xor, "shift-left": np.left_shift,
           "shift-right-arithmetic": np.right_shift,
           # on the value's own width (32-bit indices): the sign bit shifts in as a zero
           "shift-right-logical": lambda a, b: (a & 0xFFFFFFFF) >> b}
_UNARY = {"negate": np.negative, "sign": np.sign, "abs": np.abs, "not": np.invert}
_PASS = ("copy", "bitcast", "reshape", "convert")
_MAX_ELEMENTS = 1 << 16  # only small integer arrays (block indices, iotas) are evaluated


class _Unknown(Exception):
  """A value the evaluator does not follow (data read at run time, an op it does not know)."""


def _literal(ins: Instr) -> np.ndarray:
  m = re.search(r"\bconstant\((.*)\)", ins.text)
  if m is None or "..." in m.group(1) or ins.out is None or not ins.out.dtype.startswith(("s", "u", "pred")):
    raise _Unknown(ins.name)
  vals = [v == "true" if v in ("true", "false") else int(v) for v in re.findall(r"true|false|-?\d+", m.group(1))]
  return np.array(vals, dtype=np.int64).reshape(ins.out.shape)


def _dims(ins: Instr, key: str) -> list[int]:
  m = re.search(key + r"=\{([\d,]*)\}", ins.text)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


class _Evaluator:
  """Integer values of HLO instructions, where they follow from constants, iotas and the enclosing loops' counters:
  env maps (computation, tuple index) of a loop body's parameter to its value in one iteration."""

  def __init__(self, comps: dict[str, list[Instr]]):
    self.comps = comps
    self.local = {c: {i.name: i for i in items} for c, items in comps.items()}

  def value(self, comp: str, name: str, env: dict, args: dict | None = None) -> np.ndarray:
    ins = self.local[comp].get(name)
    if ins is None or ins.out is None or ins.out.elements > _MAX_ELEMENTS or ins.out.dtype.startswith(("f", "bf")):
      raise _Unknown(name)
    op = lambda k: self.value(comp, ins.operands[k], env, args)  # noqa: E731
    code = ins.opcode
    if code == "parameter":
      k = int(re.search(r"parameter\((\d+)\)", ins.text).group(1))
      if args is None or k not in args:
        raise _Unknown(name)
      return args[k]
    if code == "get-tuple-element":
      k = int(_INDEX.search(ins.text).group(1))
      src = self.local[comp].get(ins.operands[0])
      if src is not None and src.opcode == "parameter" and (comp, k) in env:
        return env[comp, k]
      if src is not None and src.opcode == "tuple":
        return self.value(comp, src.operands[k], env, args)
      raise _Unknown(name)
    if code == "constant":
      return _literal(ins)
    if code in _PASS:
      return op(0).reshape(ins.out.shape).astype(bool if ins.out.dtype == "pred" else np.int64)
    if code == "iota":
      d, shape = int(re.search(r"iota_dimension=(\d+)", ins.text).group(1)), ins.out.shape
      return np.broadcast_to(np.arange(shape[d]).reshape([-1 if i == d else 1 for i in range(len(shape))]),
                             shape).copy()
    if code == "broadcast":
      x, shape, dims = op(0), ins.out.shape, _dims(ins, "dimensions")
      return np.broadcast_to(x.reshape([shape[i] if i in dims else 1 for i in range(len(shape))]), shape).copy()
    if code == "dynamic-slice":
      x = op(0)
      sizes = _dims(ins, "dynamic_slice_sizes")
      starts = [int(op(1 + i)) for i in range(x.ndim)]
      starts = [min(max(s, 0), n - z) for s, n, z in zip(starts, x.shape, sizes)]  # XLA clamps the starts
      return x[tuple(slice(s, s + z) for s, z in zip(starts, sizes))]
    if code in _BINARY:
      return _BINARY[code](op(0), op(1))
    if code == "compare":
      return _COMPARE[_DIRECTION.search(ins.text).group(1)](op(0), op(1))
    if code == "select":
      return np.where(op(0), op(1), op(2))
    if code == "clamp":
      return np.minimum(np.maximum(op(1), op(0)), op(2))
    if code in _UNARY:
      return _UNARY[code](op(0))
    if code == "fusion":
      fused = (ins.called.get("calls") or [""])[0]
      root = _root(self.comps.get(fused, []))
      if root is None:
        raise _Unknown(name)
      return self.value(fused, root.name, env, {k: op(k) for k in range(len(ins.operands))})
    raise _Unknown(name)


def _loop_bounds(comps: dict[str, list[Instr]], loop: Instr) -> tuple[int, int, str | int] | None:
  """(the counter's tuple index, its constant step per trip, the bound) of a `counter < bound` loop: the bound is a
  constant, or the instruction of the loop's start tuple whose element the body leaves unchanged. None otherwise."""
  cond = comps.get((loop.called.get("condition") or [""])[0]) or []
  root = _root(cond)
  if root is None:
    return None
  root, operands = _resolved(comps, {i.name: i for i in cond}, root)
  if root.opcode != "compare" or "direction=LT" not in root.text or len(operands) != 2 or None in operands:
    return None
  counter, bound = operands
  outer = {i.name: i for i in comps.get(loop.comp, [])}
  init = outer.get(loop.operands[0]) if loop.operands else None
  if counter.opcode != "get-tuple-element" or init is None or init.opcode != "tuple":
    return None
  k = int(_INDEX.search(counter.text).group(1))
  step = _step(comps, loop, k)
  if step is None or k >= len(init.operands):
    return None
  if bound.opcode == "constant" and _CONSTANT.search(bound.text):
    return k, step, int(_CONSTANT.search(bound.text).group(1))
  if bound.opcode != "get-tuple-element":
    return None
  kb = int(_INDEX.search(bound.text).group(1))
  return (k, step, init.operands[kb]) if kb < len(init.operands) and _kept(comps, loop, kb) else None


def _kept(comps: dict[str, list[Instr]], loop: Instr, j: int) -> bool:
  """Whether the loop's body passes tuple element j on unchanged."""
  body = comps.get((loop.called.get("body") or [""])[0]) or []
  root = _root(body)
  if root is None or root.opcode != "tuple" or j >= len(root.operands):
    return False
  kept = _through_copies({i.name: i for i in body}, root.operands[j])
  return kept is not None and kept.opcode == "get-tuple-element" and int(_INDEX.search(kept.text).group(1)) == j


def _trips_over_enclosing_loop(ev: _Evaluator, parent: Instr | None, loop: Instr) -> float | None:
  """The mean trips per start of a `counter < bound` loop whose start or bound is computed, in the body of an
  enclosing loop with a read trip count (`parent`, which runs loop.comp), from that loop's counter (and constants,
  iotas, its unchanged tuple elements): each of the enclosing loop's iterations evaluated (a causal flash loop: i + 1
  key blocks for query block i). None where the values are not followed that far (read from data at run time: a
  grouped matmul's row counts)."""
  comps = ev.comps
  mine = _loop_bounds(comps, loop)
  theirs = _loop_bounds(comps, parent) if parent is not None and parent.trip_count <= _MAX_ELEMENTS else None
  if mine is None or theirs is None:
    return None
  (k, step, bound), (ko, so, _) = mine, theirs
  init = ev.local[loop.comp][loop.operands[0]]
  parent_init = ev.local[parent.comp][parent.operands[0]]
  try:
    # The enclosing loop's tuple elements its body passes on unchanged keep their start values (those the
    # evaluator follows); its counter takes each iteration's.
    fixed = {}
    for j, name in enumerate(parent_init.operands):
      if j != ko and _kept(comps, parent, j):
        try:
          fixed[loop.comp, j] = ev.value(parent.comp, name, {})
        except _Unknown:
          pass
    c0 = int(ev.value(parent.comp, parent_init.operands[ko], {}))
    total = 0
    for t in range(parent.trip_count):
      env = {**fixed, (loop.comp, ko): np.array(c0 + t * so)}
      lo = int(ev.value(loop.comp, init.operands[k], env))
      hi = bound if isinstance(bound, int) else int(ev.value(loop.comp, bound, env))
      total += max(0, -(-(hi - lo) // step))
  except (_Unknown, KeyError, ValueError, IndexError, AttributeError, TypeError):
    return None
  return total / parent.trip_count
