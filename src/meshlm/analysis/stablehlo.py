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
  locs = _loc_names(text)
  ops: list[Op] = []
  funcs: dict[str, list[Op]] = {}
  func_args: dict[str, list] = {}
  defs: dict[tuple[str, str], Op] = {}
  all_defs: dict[tuple[str, str], list[Op]] = {}
  func = ""
  region_ids = iter(range(1, 1 << 62))
  # Open regions, innermost last: [op index, brace depth inside, "cond" | "do" (a while's) | "region",
  # region id].
  # JAX prints a while's `cond {`, `} do {` and `}` on lines of their own, and every other region
  # op opens its region at the end of its line and closes it on a line that starts with `}` and
  # carries the op's location; other braces balance within a line (attribute dicts).
  depth, regions, pending = 0, [], None
  trips: dict[int, int | None] = {}
  seen_bound: set[int] = set()
  for i, line in enumerate(text.splitlines()):
    before = depth
    depth += line.count("{") - line.count("}")
    stripped = line.strip()
    if stripped == "cond {" and pending is not None:
      regions.append([pending, depth, "cond", next(region_ids)])
      trips[pending] = None
      pending = None
      continue
    if stripped == "} do {" and regions and regions[-1][1] == before:
      regions[-1][2] = "do"
      regions[-1][3] = next(region_ids)
      continue
    while regions and depth < regions[-1][1]:
      k, _, kind, _ = regions.pop()
      loc = _LOC_REF.search(line)
      if kind == "region" and loc and not ops[k].close_scope:
        ops[k].close_scope = locs.get(loc.group(1), "")
    m = _FUNC.match(line)
    if m:
      func = m.group(1)
      funcs[func] = []
      func_args[func] = [(a, *_parse_tensor(t)) for a, t in re.findall(r"(%arg\d+):\s*tensor<([^<>]*)>", m.group(2))]
      continue
    m = _OP.match(line)
    results: list[str] = []
    if m:
      results = [r.strip() for r in m.group("results").split(",")]
      body = m.group("body")
    else:
      m = _BARE_OP.match(line)
      if not m:
        continue
      body = m.group("body")
    nm = _NAME.match(body)
    if not nm:
      continue
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
    op = Op(func, expanded, name, operands, out_types, in_types, scope, i, line.strip(),
            tuple(k for k, _, kind, _ in regions if kind == "do"), tuple(k for k, _, _, _ in regions),
            regions=tuple(r for _, _, _, r in regions))
    if regions and regions[-1][2] == "cond" and name == "stablehlo.constant" and out_types == [((), "i32")]:
      # The cond region compares the counter with the trip count: its one scalar i32 constant.
      m = re.search(r"dense<(-?\d+)>", line)
      w = regions[-1][0]
      trips[w] = int(m.group(1)) if m and w not in seen_bound else None
      seen_bound.add(w)
    if name == "stablehlo.while":
      pending = len(ops)
    elif depth > before:
      regions.append([len(ops), depth, "region", next(region_ids)])
    ops.append(op)
    funcs.setdefault(func, []).append(op)
    for k, r in enumerate(expanded):
      defs[(func, r.split("#")[0] if len(expanded) == 1 else r)] = op
      defs.setdefault((func, r.split("#")[0]), op)
    for base in dict.fromkeys(r.split("#")[0] for r in expanded):
      all_defs.setdefault((func, base), []).append(op)
  return Module(ops, funcs, func_args, defs, trips, all_defs)
