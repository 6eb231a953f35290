"""The census: structural counts of the real train step, read from its StableHLO and optimized HLO.

`census(cfg)` builds the step with `build_train_step` (what `meshlm train` runs), lowers it from abstract inputs and
compiles it; nothing executes. The result is a nested dict whose dotted paths are the field names of DESIGN.md
("stablehlo.transpose_of_dot.blocked" is `result["stablehlo"]["transpose_of_dot"]["blocked"]`). docs/analysis.md
explains every field; it also runs every registered part's counters (Instrument.census, analysis/counters.py).
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

from meshlm.analysis import hlo as H
from meshlm.analysis import stablehlo as SH
from meshlm.analysis.counters import DIRECTIONS, KINDS, part_counters, put, scan_dead_work
from meshlm.analysis.scopes import attribute, join
from meshlm.models.family import CensusCounter
from meshlm.models.registry import part_reports

SHARDING_OPS = {"sdy.sharding_constraint", "sdy.reshard", "mhlo.sharding"}
SHARDING_TARGETS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
# Ops that may sit between a dot and its transpose and still leave the pair "blocked" rather than unrelated: the
# barrier itself, a copy, a reshape (JAX also wraps the dot in a no-op convert when the dtypes already match, which
# does not exist in StableHLO text, so it is not listed).
PASS_THROUGH = {"sdy.sharding_constraint", "sdy.reshard", "stablehlo.copy", "stablehlo.reshape",
                "stablehlo.custom_call"}
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
BLOWUP_RATIO = 8
# A rebuilt constant table smaller than this costs less than the noise of any step we can time.
BLOWUP_MIN_ELEMENTS = 1 << 20
# Not work: bookkeeping instructions the signature diff and op counts may skip.
HLO_BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


@dataclasses.dataclass
class Lowered:
  """What the census reads: the texts and the compiled executable's analyses."""
  stablehlo: str
  hlo: str
  memory: dict[str, int]
  cost: dict[str, float]


def lower_and_compile(cfg, mesh=None) -> Lowered:
  """Builds the train step exactly as `meshlm train` does, lowers and compiles it. Runs nothing."""
  from meshlm.train.step import build_train_step
  lowered = build_train_step(cfg, mesh).lower()
  return lowered_of(lowered, lowered.compile())


def lowered_of(lowered, compiled) -> Lowered:
  """What the census reads, from a jax Lowered and its Compiled (e.g. the executable a bench times)."""
  return Lowered(lowered.as_text(debug_info=True), compiled.as_text(), _memory(compiled), _cost(compiled))


def _memory(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
  out = {k: int(getattr(stats, k)) for k in keys if hasattr(stats, k)}
  # What the step holds at its peak: arguments + outputs that are not aliased to them + temporaries.
  out["total_bytes"] = (out.get("argument_size_in_bytes", 0) + out.get("output_size_in_bytes", 0)
                        - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0))
  return out


def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  keep = ("flops", "transcendentals", "bytes accessed", "optimal_seconds")
  return {k.replace(" ", "_"): float(cost[k]) for k in keep if cost and k in cost}


# ---------------------------------------------------------------------------------------- StableHLO

def _func_prefixes(mod: SH.Module) -> dict[str, str]:
  """Each function's name-stack prefix from its call site (so scan bodies know fwd from bwd)."""
  callers: dict[str, str] = {}
  for op in mod.ops:
    if op.name == "func.call" and op.target:
      callers.setdefault(op.target, (op.func, op.scope))
  prefixes: dict[str, str] = {}

  def prefix(func: str, depth: int = 0) -> str:
    if func in prefixes:
      return prefixes[func]
    if func not in callers or depth > 32:
      return ""
    parent, scope = callers[func]
    p = join(prefix(parent, depth + 1), scope)
    prefixes[func] = p
    return p

  for f in mod.funcs:
    prefix(f)
  return prefixes


def _is_barrier(op: SH.Op) -> bool:
  return op.name in SHARDING_OPS or (op.name == "stablehlo.custom_call" and op.target in SHARDING_TARGETS)


def _merged(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
  """A rank-3 kernel used as a matrix, two adjacent dims merged ([] for another rank)."""
  return [(shape[0], shape[1] * shape[2]), (shape[0] * shape[1], shape[2])] if len(shape) == 3 else []


def _kernel_shapes(mod: SH.Module) -> set[tuple[int, ...]]:
  """Shapes of the step's rank>=2 arguments, of one layer of each stacked one (dims 0 or 1 dropped), and _merged."""
  main = mod.func_args.get("main", [])
  shapes: set[tuple[int, ...]] = set()
  for _, shape, _ in main:
    if len(shape) >= 2:
      shapes.add(shape)
      if len(shape) >= 3:
        shapes.add(shape[1:])
        shapes.add(shape[:1] + shape[2:])
  return shapes | {m for s in shapes for m in _merged(s)}


def executed(mod: SH.Module, entry: str = "main"):
  """Every op as the step runs it: (op, its full name-stack path, times per step).

  Walks the call graph from the entry: an op in a function called from k sites is met k times, each with its call
  site's path (a function JAX lowered once may run in the forward and in the backward), and an op in a while body
  runs the loop's trip count times (1 when the count is not a constant: such a loop is one of `unread_loops`, which
  the census reports). Ops inside a shard_map (sdy.manual_computation) name their scopes from the shard_map's own."""
  stack: list[str] = []

  def scope(op: SH.Op) -> str:
    path = ""
    for k in op.parents:
      if mod.ops[k].name == "sdy.manual_computation":
        path = join(path, mod.ops[k].close_scope)
    return join(path, op.scope or op.close_scope)

  def walk(func: str, prefix: str, times: int):
    if func not in mod.funcs or func in stack or len(stack) > 64:
      return
    stack.append(func)
    for op in mod.funcs[func]:
      n = times
      for w in op.loops:
        n *= mod.trip_counts.get(w) or 1
      path = join(prefix, scope(op))
      yield op, path, n
      if op.name == "func.call" and op.target:
        yield from walk(op.target, path, n)
    stack.pop()

  yield from walk(entry, "", 1)


def unread_loops(mod: SH.Module) -> list[dict]:
  """The `while` loops whose trip count the StableHLO does not give (a bound read from the loop's state: a
  lax.while_loop, a fori_loop over traced bounds), as the step meets them: [{"scope", "runs"}] per scope (the
  layer, analysis/scopes.attribute), runs = how many times per step such loops start. The per-step counts
  (executed) count these bodies once per start; [] when every loop's count was read."""
  index = {id(op): k for k, op in enumerate(mod.ops)}
  runs: collections.Counter = collections.Counter()
  for op, path, n in executed(mod):
    if op.name == "stablehlo.while" and mod.trip_counts.get(index[id(op)]) is None:
      runs[attribute(path)] += n
  return [{"scope": k, "runs": v} for k, v in sorted(runs.items())]


def _param_shapes(mod: SH.Module) -> set[tuple[int, ...]]:
  """Shapes a weight gradient can have, as `_dims` tuples (a gradient may come out transposed):
  each rank>=2 argument of the step with 0, 1 or 2 of its leading (stacking) axes dropped, or
  one stacked axis dropped; and of a rank-3 slice, also with one dim of at most 64 (a head count)
  split in two (grouped-query attention's gradient per kv head and group), or _merged."""
  shapes = set()
  for _, shape, _ in mod.func_args.get("main", []):
    cuts = [shape[k:] for k in range(min(3, len(shape) - 1))]
    if len(shape) >= 3:
      cuts.append(shape[:1] + shape[2:])
    for cut in cuts:
      shapes.add(_dims(cut))
      if len(cut) != 3:
        continue
      shapes.update(_dims(m) for m in _merged(cut))
      for i, d in enumerate(cut):
        for a in range(2, d if d <= 64 else 0):
          if d % a == 0:
            shapes.add(_dims(cut[:i] + (a, d // a) + cut[i + 1:]))
  return shapes


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
  """A shape compared up to order and size-1 axes (one kv head: [D, 1, G, Dh] is [D, H, Dh])."""
  return tuple(sorted(d for d in shape if d != 1))


_CONTRACT = re.compile(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]")
_PERM = re.compile(r"dims = \[([\d, ]*)\]")


def _contracts_leading_axes(mod: SH.Module, op: SH.Op) -> bool:
  """Whether a dot contracts the leading axis of both operands (looking through a transpose):
  the token axis of activations, which a weight gradient sums over and an input gradient keeps."""
  m = _CONTRACT.search(op.text)
  if not m or len(op.operands) < 2:
    return False
  for side, operand in zip(m.groups(), op.operands[:2]):
    dims = [int(d) for d in side.split(",") if d.strip()]
    src = mod.def_of(op.func, operand, at=op)
    if src is not None and src.name == "stablehlo.transpose":
      perm = _PERM.search(src.text)
      if perm:
        order = [int(d) for d in perm.group(1).split(",") if d.strip()]
        dims = [order[d] for d in dims if d < len(order)]
    if 0 not in dims:
      return False
  return True


def _strip_direction(where: str) -> str:
  return where.rsplit(" ", 1)[0]


def executed_counts(mod: SH.Module, counters: tuple[CensusCounter, ...] | None = None) -> dict[str, Any]:
  """Per step (see docs/analysis.md): sorts and weight-gradient dots, and the gathers and scatters under the
  scope of each "scope_gathers_scatters" counter (None: every registered part's), at its field below
  "stablehlo." (the scope is a component of an op's layer path: "mlp" of "layers/mlp/down")."""
  scoped = [c for c in (part_counters() if counters is None else counters) if c.kind == "scope_gathers_scatters"]
  sorts = {d: 0 for d in DIRECTIONS}
  gathered = {c.field: {kind: {d: 0 for d in DIRECTIONS} for kind in ("gathers", "scatters")} for c in scoped}
  wgrad: collections.Counter = collections.Counter()
  params = _param_shapes(mod)
  for op, path, n in executed(mod):
    if op.name not in ("stablehlo.sort", "stablehlo.gather", "stablehlo.scatter", "stablehlo.dot_general"):
      continue
    where = attribute(path)
    direction = "backward" if where.endswith(" backward") else "forward"
    if op.name == "stablehlo.sort":
      sorts[direction] += n
    elif op.name == "stablehlo.dot_general":
      shape = op.result_types[0][0] if op.result_types else ()
      if (direction == "backward" and len(_dims(shape)) >= 2 and _dims(shape) in params
          and _contracts_leading_axes(mod, op)):
        wgrad[_strip_direction(where)] += n
    else:
      scopes = where.split(" ")[0].split("/")
      for c in scoped:
        if c.scope in scopes:
          gathered[c.field]["gathers" if op.name == "stablehlo.gather" else "scatters"][direction] += n
  out: dict[str, Any] = {"sorts": sorts}
  for c in scoped:
    put(out, c.field.removeprefix("stablehlo."), gathered[c.field])
  out["weight_grad_dots"] = dict(sorted(wgrad.items()))
  return out


def optimization_barriers(mod: SH.Module) -> dict[str, int]:
  """`stablehlo.optimization_barrier` ops per step, by direction: the scheduling fences the step asks
  XLA for (a part's own fences around its gradients, remat's, if any)."""
  out = {d: 0 for d in DIRECTIONS}
  for op, path, n in executed(mod):
    if op.name == "stablehlo.optimization_barrier":
      out["backward" if attribute(path).endswith(" backward") else "forward"] += n
  return out


def stablehlo_counts(text: str, counters: tuple[CensusCounter, ...] | None = None
                     ) -> tuple[dict[str, Any], list[dict], SH.Module]:
  """StableHLO fields (with the parts' declared counters of a StableHLO kind; None: every registered part's),
  the transpose-of-dot pair list and the parsed module."""
  mod = SH.parse(text)
  prefixes = _func_prefixes(mod)
  where = lambda op: attribute(join(prefixes.get(op.func, ""), op.scope))
  barriers = collections.Counter()
  for op in mod.ops:
    if _is_barrier(op):
      barriers[op.name if op.name != "stablehlo.custom_call" else f"custom_call @{op.target}"] += 1
  kernels = _kernel_shapes(mod)
  pairs = []
  for op in mod.ops:
    if op.name != "stablehlo.transpose" or not op.operands:
      continue
    src = mod.def_of(op.func, op.operands[0], at=op)
    between = []
    while src is not None and src.name in PASS_THROUGH and src.name != "stablehlo.dot_general":
      if src.name == "stablehlo.custom_call" and src.target not in SHARDING_TARGETS:
        break
      between.append(src.name if src.name != "stablehlo.custom_call" else f"custom_call @{src.target}")
      src = mod.def_of(src.func, src.operands[0], at=src) if src.operands else None
    if src is None or src.name != "stablehlo.dot_general":
      continue
    shape = op.result_types[0][0] if op.result_types else ()
    pairs.append({"kind": "blocked" if between else "adjacent", "between": between, "scope": where(op),
                  "shape": list(shape), "weight_grad": tuple(shape) in kernels, "line": op.line})
  kinds = collections.Counter(op.name for op in mod.ops)
  counts = {
      "sharding_barriers": sum(barriers.values()),
      "sharding_barrier_kinds": dict(sorted(barriers.items())),
      "transpose_of_dot": {
          "adjacent": sum(p["kind"] == "adjacent" for p in pairs),
          "blocked": sum(p["kind"] == "blocked" for p in pairs),
          # The subset whose transpose produces a parameter-shaped value: a weight gradient.
          "weight_grad": {"adjacent": sum(p["kind"] == "adjacent" and p["weight_grad"] for p in pairs),
                          "blocked": sum(p["kind"] == "blocked" and p["weight_grad"] for p in pairs)},
      },
      "transposes": kinds["stablehlo.transpose"],
      "dots": kinds["stablehlo.dot_general"],
      "op_counts": dict(sorted(kinds.items())),
      "optimization_barriers": optimization_barriers(mod),
      **executed_counts(mod, counters),
      "unread_loops": unread_loops(mod),
  }
  return counts, pairs, mod


def blowups(mod: SH.Module, ratio: int = BLOWUP_RATIO, min_elements: int = BLOWUP_MIN_ELEMENTS) -> list[dict]:
  """Ops whose output has >= ratio x the elements of their largest input, built from constants only.

  Broadcasts are looked through (they never materialize on their own; the op that consumes them does), so
  `iota[N] * inv_freq[F]` counts as an [N, F] output from an [N] input. Only values that depend on no argument are
  flagged: per-token expansions (one-hot targets, rotary angles from the positions, segment masks) scale with the
  batch and are the work itself, while a large table built from iota and constants every step is the YaRN
  pathology: work that could start from positions.
  """
  prefixes = _func_prefixes(mod)
  const: dict[tuple[str, str], bool] = {}
  eff: dict[tuple[str, str], int] = {}  # effective (pre-broadcast) element count of a value
  found = []
  for op in mod.ops:
    ins = [(op.func, v) for v in op.operands]
    is_const = all(const.get(k, False) for k in ins)  # args/iter-args are unknown -> not constant
    if op.name in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
      is_const = False
    in_sizes = [eff.get(k, 0) for k in ins]
    out = op.out_elements
    if op.name in ("stablehlo.broadcast_in_dim", "stablehlo.broadcast"):
      size = max(in_sizes, default=1)
    elif op.name in ("stablehlo.constant", "stablehlo.iota"):
      size = out if op.name == "stablehlo.iota" else 1  # splat constants carry one value
      is_const = True
    else:
      size = out
      largest = max(in_sizes, default=0)
      if (is_const and ins and out >= min_elements and out >= ratio * max(largest, 1)
          and op.name not in ("func.call", "stablehlo.reshape", "sdy.sharding_constraint")):
        dims = op.result_types[0][0] if op.result_types else ()
        found.append({"op": op.name, "shape": list(dims), "elements": out, "largest_input": largest,
                      "ratio": round(out / max(largest, 1), 1),
                      "scope": attribute(join(prefixes.get(op.func, ""), op.scope)), "line": op.line})
    for r in op.results:
      key = (op.func, r.split("#")[0])
      const[key] = is_const
      eff[key] = size
  return found


# ------------------------------------------------------------------------------------- optimized HLO

def reduce_scatter_fusions(mod: H.HloModule) -> set[str]:
  """The computations of XLA:TPU's reduce-scatters: it writes one as a fusion (kind=kCustom, its emitter
  "SingleInputAllReduceScatterFusion") whose computation all-reduces its input and roots in this device's slice of
  the sum. The fusion is the collective (each device receives its shard), not the all-reduce inside it."""
  out = set()
  for comp, items in mod.comps.items():
    root = next((i for i in items if i.text.startswith("ROOT ")), None)
    if root is not None and root.opcode == "dynamic-slice" and root.operands and any(
        i.name == root.operands[0] and i.opcode == "all-reduce" for i in items):
      out.add(comp)
  return out


def _collective_kind(ins: H.Instr, scatter_fusions: set[str]) -> str | None:
  """The collective kind ins is (an async pair counts at its start), or None. A reduce-scatter fusion is a
  reduce-scatter; the all-reduce inside it is not counted apart."""
  if ins.opcode == "fusion" and (ins.called.get("calls") or [""])[0] in scatter_fusions:
    return "reduce-scatter"
  if ins.comp in scatter_fusions:
    return None
  return ins.opcode.removesuffix("-start")


def hlo_counts(text: str) -> tuple[dict[str, Any], H.HloModule]:
  mod = H.parse(text)
  ops = collections.Counter(i.opcode for i in mod.instrs())
  scatter_fusions = reduce_scatter_fusions(mod)
  collectives: dict[str, dict[str, Any]] = {}
  for kind in COLLECTIVES:
    calls: dict[tuple, dict] = {}
    for ins in mod.instrs():
      # An async pair is one collective: count the start, skip the done.
      if ins.opcode not in (kind, f"{kind}-start", "fusion") or _collective_kind(ins, scatter_fusions) != kind:
        continue
      out = ins.out
      if out is None:
        continue
      times = mod.multipliers.get(ins.comp, 1)
      key = (str(out), attribute(ins.op_name))
      c = calls.setdefault(key, {"shape": str(out), "bytes_per_call": out.bytes, "count": 0, "scope": key[1]})
      c["count"] += times
    per_call = sorted(calls.values(), key=lambda c: (-c["bytes_per_call"] * c["count"], c["shape"]))
    collectives[kind] = {"count": sum(c["count"] for c in per_call),
                         "bytes": sum(c["count"] * c["bytes_per_call"] for c in per_call), "calls": per_call}
  counts = {
      "op_counts": dict(sorted(ops.items())),
      "copies": ops["copy"] + ops["copy-start"],
      "transposes": ops["transpose"],
      "fusions": ops["fusion"],
      "collectives": collectives,
      "while_loops": [{"trip_count": i.trip_count, "scope": attribute(i.op_name)} for i in mod.instrs()
                      if i.opcode == "while"],
      "unread_loops": hlo_unread_loops(mod),
  }
  return counts, mod


def hlo_unread_loops(mod: H.HloModule, skip: H.Instr | None = None) -> list[dict]:
  """The `while` loops of the optimized HLO whose trip count neither the backend config nor the condition gives
  (analysis/hlo.py), reached from the entry: [{"scope", "runs"}] per scope, runs = how many times per step such
  loops start. The per-step counts (collectives, the roofline's FLOPs and bytes) count their bodies once per start.
  skip: a loop left out (the sampler's token loop, whose one trip the decode roofline is)."""
  runs: collections.Counter = collections.Counter()
  for ins in (i for i in mod.unread_loops() if i is not skip):
    runs[attribute(ins.op_name)] += mod.multipliers[ins.comp]
  return [{"scope": k, "runs": v} for k, v in sorted(runs.items())]


def unread_loops_line(unread: dict[str, list[dict]], top: int = 4) -> str | None:
  """One report line naming the loops whose trip count was not read ({"stablehlo": [...], "hlo": [...]}: the
  lists above; the `top` scopes of each that start most, then how many more), or None when there are none."""
  parts = []
  for where, items in unread.items():
    if items:
      ranked = sorted(items, key=lambda u: (-u["runs"], u["scope"]))
      scopes = "; ".join(f"{u['scope']} x{u['runs']}" for u in ranked[:top])
      more = f"; {len(ranked) - top} more scopes" if len(ranked) > top else ""
      parts.append(f"{where} {sum(u['runs'] for u in items)} ({scopes}{more})")
  if not parts:
    return None
  return "loops counted once per start (trip count not read): " + ", ".join(parts)


def scan_layout_flags(mod: H.HloModule) -> list[dict]:
  """Stacked arrays carried by a scanned `while` whose layout does not keep the layer axis major.

  A scanned stack is a loop-carried array whose leading dimension is the trip count. Its layout (minor-to-major)
  should end with dimension 0; otherwise every per-layer dynamic-update-slice writes a strided, degenerate slice (the
  param_scan_axis pathology).
  """
  flags = []
  for ins in mod.instrs():
    if ins.opcode != "while" or not ins.trip_count or ins.trip_count < 2:
      continue
    for k, arr in enumerate(ins.result):
      if len(arr.shape) < 2 or arr.shape[0] != ins.trip_count or arr.layout is None or not arr.layout:
        continue
      if arr.layout[-1] != 0:
        flags.append({"while": ins.name, "index": k, "array": str(arr), "scope": attribute(ins.op_name)})
  return flags


# ---------------------------------------------------------------------------------------- the census

def census_of(low: Lowered) -> dict[str, Any]:
  """The census dict from lowered/compiled texts (see docs/analysis.md for every field), with the counters the
  registered parts declare."""
  counters = part_counters()
  shlo, pairs, smod = stablehlo_counts(low.stablehlo, counters)
  hlo, hmod = hlo_counts(low.hlo)
  shlo["transpose_of_dot"]["pairs"] = [{k: p[k] for k in ("kind", "weight_grad", "between", "scope", "shape")}
                                       for p in pairs]
  out = {"stablehlo": shlo, "hlo": hlo, "blowups": blowups(smod), "scan_layout": scan_layout_flags(hmod)}
  for c in counters:
    if c.kind == "scan_dead_work":
      put(out, c.field, scan_dead_work(hmod, c.scope))
  return out | {"memory": low.memory, "cost": low.cost}


def census(cfg, mesh=None) -> dict[str, Any]:
  """Lowers and compiles cfg's train step and returns its census, with the config it describes."""
  out = census_of(lower_and_compile(cfg, mesh))
  out["config"] = config_summary(cfg)
  return out


def attention_record(cfg, platform: str | None = None, device_kind: str | None = None):
  """The attention core the train step runs (models/context.attention_core at train.seq_len on platform, by default
  JAX's backend, over mesh.context shards; -1 there, the devices left, counts as more than one): the record the
  step's context holds, which the reports print."""
  import jax
  from meshlm.models.context import attention_core
  from meshlm.models.model import resolve
  M = resolve(cfg)
  context = cfg.mesh.context if cfg.mesh.context > 0 else 2
  rows = max(cfg.train.per_device_batch_size // cfg.train.micro_batches, 1)
  return attention_core(M.cfg, M.attention_shapes, cfg.train.seq_len, platform=platform or jax.default_backend(),
                        context=context, device_kind=device_kind, rows=rows)


def attention_impl(cfg, platform: str | None = None) -> str:
  """The attention core's name (attention_record's): what the banners print."""
  return attention_record(cfg, platform).name


def config_summary(cfg, platform: str | None = None) -> dict[str, Any]:
  from meshlm.analysis.keys import program_keys
  core = attention_record(cfg, platform)
  return {"model": cfg.model_name, "shard_mode": cfg.shard_mode, **core.summary(), **program_keys(cfg, platform),
          "lm_head_weight_grad_in_kernel_order": cfg.lm_head_weight_grad_in_kernel_order,
          "dense_weight_grad_in_kernel_order": cfg.dense_weight_grad_in_kernel_order,
          "weight_grad_impl": cfg.weight_grad_impl, "mesh": cfg.mesh.sizes(), "cpu_devices": cfg.cpu_devices,
          "compute_dtype": cfg.train.compute_dtype, "per_device_batch_size": cfg.train.per_device_batch_size,
          "seq_len": cfg.train.seq_len, "loss_impl": cfg.loss_impl, **part_reports(cfg, platform)}


# Scalar fields shown in tables and compared side by side, in order; the parts' declared counters follow them
# (summary_fields).
STEP_FIELDS = (
    "stablehlo.sharding_barriers", "stablehlo.transpose_of_dot.adjacent", "stablehlo.transpose_of_dot.blocked",
    "stablehlo.transpose_of_dot.weight_grad.adjacent", "stablehlo.transpose_of_dot.weight_grad.blocked",
    "stablehlo.transposes", "stablehlo.dots", "hlo.transposes", "hlo.copies", "hlo.fusions",
    *[f"hlo.collectives.{k}.{f}" for k in COLLECTIVES for f in ("count", "bytes")],
    "blowups", "scan_layout", "memory.temp_size_in_bytes", "memory.total_bytes", "cost.flops", "cost.bytes_accessed",
    "stablehlo.sorts.forward", "stablehlo.sorts.backward",
    "stablehlo.optimization_barriers.forward", "stablehlo.optimization_barriers.backward",
)
# A dict field shown as one row per key: "stablehlo.weight_grad_dots.layers/attn/q".
SUMMARY_DICTS = ("stablehlo.weight_grad_dots",)


def summary_fields() -> tuple[str, ...]:
  """The scalar fields of a table, in order: STEP_FIELDS, then each registered part's counters' (part_counters)."""
  return STEP_FIELDS + tuple(f"{c.field}.{leaf}" for c in part_counters() for leaf in KINDS[c.kind][1])


def field(result: dict, dotted: str) -> Any:
  """result["a"]["b"] for "a.b"; lists count as their length (blowups, scan_layout)."""
  node: Any = result
  for part in dotted.split("."):
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return len(node) if isinstance(node, list) else node


def summary(result: dict) -> dict[str, Any]:
  out = {f: field(result, f) for f in summary_fields()}
  for f in SUMMARY_DICTS:
    for k, v in (field(result, f) or {}).items():
      out[f"{f}.{k}"] = v
  return out


def fmt_value(v: Any) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, int) and abs(v) >= 10_000:
    return f"{v:,}"
  return str(v)


def render(result: dict) -> str:
  """The human table for `meshlm census`."""
  from meshlm.analysis.keys import keys_line
  lines = []
  c = result.get("config", {})
  if c:
    lines.append(f"census {c['model']}  shard_mode={c['shard_mode']}  lm_head_kernel_order="
                 f"{c['lm_head_weight_grad_in_kernel_order']}  dense_kernel_order={c['dense_weight_grad_in_kernel_order']}"
                 f"  weight_grad_impl={c['weight_grad_impl']}  attention={c.get('attention_impl', '-')}"
                 + (f"  loss_impl={c['loss_impl']}" if "loss_impl" in c else ""))
    lines += [line for line in (keys_line(c),) if line]
  rows = summary(result)
  width = max(len(f) for f in rows)
  for f, v in rows.items():
    lines.append(f"  {f:<{width}}  {fmt_value(v)}")
  pairs = result["stablehlo"]["transpose_of_dot"].get("pairs", [])
  if pairs:
    lines.append("transpose-of-dot pairs:")
    for p in pairs:
      via = f" via {' -> '.join(p['between'])}" if p["between"] else ""
      wg = "dW " if p["weight_grad"] else "   "
      lines.append(f"  {p['kind']:<8} {wg}{p['scope']:<36} {p['shape']}{via}")
  for key, title in (("blowups", "blow-ups"), ("scan_layout", "scanned stacks not layer-major")):
    items = result.get(key) or []
    if items:
      lines.append(f"{title}:")
      for b in items:
        lines.append("  " + "  ".join(f"{k}={v}" for k, v in b.items() if k != "line"))
  unread = unread_loops_line({"stablehlo": result["stablehlo"].get("unread_loops", []),
                               "hlo": result["hlo"].get("unread_loops", [])})
  if unread:
    lines.append(unread)
  for kind, col in result["hlo"]["collectives"].items():
    for call in col["calls"]:
      lines.append(f"  {kind:<18} x{call['count']:<4} {call['shape']:<28} {call['bytes_per_call']:>10,} B/call  {call['scope']}")
  return "\n".join(lines)
