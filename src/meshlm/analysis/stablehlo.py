"""A small reader for the StableHLO text JAX lowers to (`Lowered.as_text(debug_info=True)`).

It keeps what the census needs: per function, each op's results, name, operands, result types and
the named-scope path from its location. It is a line reader, not an MLIR parser: JAX prints one
op per line, which is all it relies on.
"""
from __future__ import annotations

import dataclasses
import math
import re

_FUNC = re.compile(r"^\s*func\.func\s+(?:public|private)?\s*@([\w.$-]+)\((.*)")
_OP = re.compile(r"^\s*(?P<results>(?:%[\w#:.-]+(?:,\s*)?)+)\s*=\s*(?P<body>.*)$")
_BARE_OP = re.compile(r"^\s*(?P<body>(?:stablehlo|sdy|func|mhlo)\.[\w.]+.*)$")
_NAME = re.compile(r'^"?(?P<name>[a-z_]+\.[\w.]+|call)"?')
_VALUE = re.compile(r"%[\w#.-]+")
_TENSOR = re.compile(r"tensor<([^<>]*)>")
_LOC_DEF = re.compile(r"^#(loc\d*)\s*=\s*loc\((.*)\)\s*$")
_LOC_REF = re.compile(r"loc\(#(loc\d*)\)\s*$")
_CALLEE = re.compile(r"(?:call|func\.call)\s+@([\w.$-]+)")
_CUSTOM_TARGET = re.compile(r"custom_call\s*@([\w.$-]+)")

@dataclasses.dataclass
class Op:
  func: str
  results: list[str]
  name: str  # e.g. "stablehlo.transpose", "sdy.sharding_constraint", "call"
  operands: list[str]
  result_types: list[tuple[tuple[int, ...], str]]  # (shape, dtype) per tensor result
  operand_types: list[tuple[tuple[int, ...], str]]
  scope: str  # raw named-scope path from the location ("" when unknown)
  line: int
  text: str
  # Index (into Module.ops) of each stablehlo.while whose body holds this op, outermost first.
  loops: tuple[int, ...] = ()
  # Index of every op whose region holds this op (whiles, sdy.manual_computation, case, ...).
  parents: tuple[int, ...] = ()
  # A region op's location printed after its region (`}) : ... loc(#N)`): its name-stack path.
  close_scope: str = ""
  # Id of every region that holds this op, outermost first (a while's cond and do are two regions).
  regions: tuple[int, ...] = ()

  @property
  def target(self) -> str | None:
    """custom_call target (e.g. "Sharding") or callee for calls."""
    m = _CUSTOM_TARGET.search(self.text) or _CALLEE.search(self.text)
    return m.group(1) if m else None

  @property
  def out_elements(self) -> int:
    return max((math.prod(s) for s, _ in self.result_types), default=0)


@dataclasses.dataclass
class Module:
  ops: list[Op]
  funcs: dict[str, list[Op]]
  func_args: dict[str, list[tuple[str, tuple[int, ...], str]]]
  defs: dict[tuple[str, str], Op]  # (func, value) -> defining op
  # Index of each stablehlo.while op -> its trip count (None when the bound is not a constant).
  trip_counts: dict[int, int | None] = dataclasses.field(default_factory=dict)
  # (func, value) -> every op that defines that name, in text order. MLIR reuses value names across
  # sibling regions (two while bodies in one function, as JAX >= 0.11 prints inlined scan bodies).
  all_defs: dict[tuple[str, str], list[Op]] = dataclasses.field(default_factory=dict)

  def def_of(self, func: str, value: str, at: Op | None = None) -> Op | None:
    """The op defining value; with `at`, the one visible from that op (the last definition above
    it in its own region or an enclosing one), None when value is a block argument there."""
    key = (func, value.split("#")[0])
    if at is None:
      return self.defs.get(key)
    for d in reversed(self.all_defs.get(key, ())):
      if d.line < at.line and at.regions[:len(d.regions)] == d.regions:
        return d
    return None


def _parse_tensor(t: str) -> tuple[tuple[int, ...], str]:
  parts = t.split(",")[0].strip().split("x")
  dims, dtype = parts[:-1], parts[-1]
  shape = tuple(int(d) if d.isdigit() else -1 for d in dims)
  return shape, dtype


def _signature_types(body: str) -> tuple[list, list]:
  """(operand types, result types) from the trailing ': (a, b) -> c' or ': t' of an op line."""
  body = _LOC_REF.sub("", body).rstrip()
  idx = body.rfind(" : ")
  if idx < 0:
    return [], []
  sig = body[idx + 3:]
  if "->" in sig:
    lhs, rhs = sig.rsplit("->", 1)
    return [_parse_tensor(t) for t in _TENSOR.findall(lhs)], [_parse_tensor(t) for t in _TENSOR.findall(rhs)]
  types = [_parse_tensor(t) for t in _TENSOR.findall(sig)]
  # "op %a, %b : tensor<...>" is the elementwise short form: operands and result share the type.
  return types, types[-1:]


def _loc_names(text: str) -> dict[str, str]:
  """#locN -> its name-stack string (the first quoted name that is not a source file)."""
  raw = {}
  for line in text.splitlines():
    m = _LOC_DEF.match(line)
    if m:
      raw[m.group(1)] = m.group(2)
  names: dict[str, str] = {}

  def resolve(key: str, depth: int = 0) -> str:
    if key in names:
      return names[key]
    body = raw.get(key, "")
    out = ""
    for q in re.findall(r'"((?:[^"\\]|\\.)*)"', body):
      if not re.search(r"\.py$|\.py:", q) and not q.startswith("/"):
        out = q
        break
    if not out and depth < 8:
      for ref in re.findall(r"#(loc\d*)", body):
        out = resolve(ref, depth + 1)
        if out:
          break
    names[key] = out
    return out

  for key in raw:
    resolve(key)
  return names


def parse(text: str) -> Module:
  """Parses StableHLO text (with or without debug locations)."""
  reader = _Reader(_loc_names(text))
  for i, line in enumerate(text.splitlines()):
    reader.feed(i, line)
  return Module(reader.ops, reader.funcs, reader.func_args, reader.defs, reader.trips, reader.all_defs)


@dataclasses.dataclass
class _Region:
  """An open region: the op that holds it and the brace depth inside it."""
  op: int  # index into the ops
  depth: int
  kind: str  # "cond" | "do" (a while's) | "region"
  id: int


class _Reader:
  """parse's state between lines: the ops read so far, the function they are in and the open regions.

  JAX prints a while's `cond {`, `} do {` and `}` on lines of their own, and every other region
  op opens its region at the end of its line and closes it on a line that starts with `}` and
  carries the op's location; other braces balance within a line (attribute dicts).
  """

  def __init__(self, locs: dict[str, str]):
    self.locs = locs
    self.ops: list[Op] = []
    self.funcs: dict[str, list[Op]] = {}
    self.func_args: dict[str, list] = {}
    self.defs: dict[tuple[str, str], Op] = {}
    self.all_defs: dict[tuple[str, str], list[Op]] = {}
    self.func = ""
    self.region_ids = iter(range(1, 1 << 62))
    self.depth = 0
    self.regions: list[_Region] = []  # innermost last
    self.pending: int | None = None  # a stablehlo.while whose `cond {` is next
    self.trips: dict[int, int | None] = {}
    self.seen_bound: set[int] = set()  # whiles whose cond held a scalar constant: a second one leaves no bound

  def feed(self, i: int, line: str) -> None:
    before = self.depth
    self.depth += line.count("{") - line.count("}")
    stripped = line.strip()
    if stripped == "cond {" and self.pending is not None:
      self.regions.append(_Region(self.pending, self.depth, "cond", next(self.region_ids)))
      self.trips[self.pending] = None
      self.pending = None
      return
    if stripped == "} do {" and self.regions and self.regions[-1].depth == before:
      self.regions[-1].kind = "do"
      self.regions[-1].id = next(self.region_ids)
      return
    self._close_regions(line)
    m = _FUNC.match(line)
    if m:
      self.func = m.group(1)
      self.funcs[self.func] = []
      self.func_args[self.func] = [(a, *_parse_tensor(t))
                                   for a, t in re.findall(r"(%arg\d+):\s*tensor<([^<>]*)>", m.group(2))]
      return
    op = _read_op(self.func, i, line, self.locs, self.regions)
    if op is None:
      return
    self._note_trip_count(op, line)
    if op.name == "stablehlo.while":
      self.pending = len(self.ops)
    elif self.depth > before:
      self.regions.append(_Region(len(self.ops), self.depth, "region", next(self.region_ids)))
    self._add(op)

  def _close_regions(self, line: str) -> None:
    """Pops the regions this line closes; a region op's closing line carries its location."""
    while self.regions and self.depth < self.regions[-1].depth:
      region = self.regions.pop()
      loc = _LOC_REF.search(line)
      # A while's location closes its `do` region: its scope, by which the census names a loop it cannot count.
      if region.kind in ("region", "do") and loc and not self.ops[region.op].close_scope:
        self.ops[region.op].close_scope = self.locs.get(loc.group(1), "")

  def _note_trip_count(self, op: Op, line: str) -> None:
    # The cond region compares the counter with the trip count: its one scalar i32 constant.
    in_cond = bool(self.regions) and self.regions[-1].kind == "cond"
    if in_cond and op.name == "stablehlo.constant" and op.result_types == [((), "i32")]:
      m = re.search(r"dense<(-?\d+)>", line)
      w = self.regions[-1].op
      self.trips[w] = int(m.group(1)) if m and w not in self.seen_bound else None
      self.seen_bound.add(w)

  def _add(self, op: Op) -> None:
    self.ops.append(op)
    self.funcs.setdefault(op.func, []).append(op)
    expanded = op.results
    for r in expanded:
      self.defs[(op.func, r.split("#")[0] if len(expanded) == 1 else r)] = op
      self.defs.setdefault((op.func, r.split("#")[0]), op)
    for base in dict.fromkeys(r.split("#")[0] for r in expanded):
      self.all_defs.setdefault((op.func, base), []).append(op)


def _read_op(func: str, i: int, line: str, locs: dict[str, str], regions: list[_Region]) -> Op | None:
  """The op on line i (None when the line holds none), inside the open regions."""
  m = _OP.match(line)
  results: list[str] = []
  if m:
    results = [r.strip() for r in m.group("results").split(",")]
    body = m.group("body")
  else:
    m = _BARE_OP.match(line)
    if not m:
      return None
    body = m.group("body")
  nm = _NAME.match(body)
  if not nm:
    return None
  name = nm.group("name")
  if name == "call":
    name = "func.call"
  loc = _LOC_REF.search(body)
  scope = locs.get(loc.group(1), "") if loc else ""
  head = _LOC_REF.sub("", body)
  head = head[: head.rfind(" : ")] if " : " in head else head
  # Operands: values before any attribute dict / region; drop the op's own result names.
  operands = [v.split("#")[0] for v in _VALUE.findall(head.split("{")[0] if "{" in head and name != "func.call" else head)]
  in_types, out_types = _signature_types(body)
  expanded: list[str] = []
  for r in results:
    base, _, count = r.partition(":")
    expanded += [f"{base}#{k}" for k in range(int(count))] if count else [base]
  return Op(func, expanded, name, operands, out_types, in_types, scope, i, line.strip(),
            tuple(r.op for r in regions if r.kind == "do"), tuple(r.op for r in regions),
            regions=tuple(r.id for r in regions))
