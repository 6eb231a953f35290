"""FLOPs and memory traffic of a compiled step, counted from its optimized HLO with every loop's trip count.

`compiled.cost_analysis()` counts a `while` body once (XLA's HloCostAnalysis does not multiply by the trip
count), so for a step whose layers run in a scan its FLOPs are about one layer's plus the rest: llama3-8b on
v5p:2x2x1 reports 4.38e13 where the step does 5.3e14. These counts walk the same HLO with `multipliers`
(analysis/hlo.py: a scanned layer's body counts its trip count):

- `flops`: 2 x multiply-adds of every dot, convolution (XLA:TPU writes most dots as convolutions) and
  ragged dot, wherever it sits (inside fusions too). A convolution counts only the (output, window) pairs that
  read a real input element, as HloCostAnalysis does, so the padded windows XLA uses to express a batched
  dot are not counted. Elementwise work is not counted: a lower bound for the roofline.
- `custom_call_flops`: the custom calls it knows, which XLA's count cannot see into: the splash attention kernel's
  (a Mosaic `tpu_custom_call` named splash_{mha,mqa}_{fwd,dq,dkv}...), from its operands' shapes. Per head and
  query row against S keys: the forward's q k^T and p v, 2 S (H + Hv); dq's recomputed scores, dp = do v^T and
  dq = ds k, 2 S (2H + Hv); dkv's scores, dv, dp and dk, 2 S (2H + 2Hv), and dq too when it is the fused backward
  (three outputs), 2 S (3H + 2Hv). The kernel skips the key blocks its block mask marks empty (the causal mask's
  upper triangle): the count is times the share of nonzero blocks, read from the mask's constant where XLA prints
  it, else (a mask too large to print) the causal triangle of square blocks, named in `estimated`.
- `bytes`: each top-level instruction (outside fusions) reads its operands and writes its result; a
  fusion that only slices an operand (a layer's row of a stacked kernel) reads the slices, and one whose
  root updates a buffer in place (a scan writing a layer's row) writes and reads only the update. An
  estimate of the HBM traffic, not a measurement: on-chip reuse across instructions is not seen.
"""
from __future__ import annotations

import math
import re

import numpy as np

from meshlm.analysis import hlo as H

_DIMS = re.compile(r"(lhs_contracting_dims|rhs_contracting_dims)=\{([\d,]*)\}")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_LABELS = re.compile(r"dim_labels=([\w]+)_([\w]+)->([\w]+)")
# Bookkeeping that moves no data (a bitcast is a view; a tuple only names its parts); the loops and calls
# themselves are counted through their bodies.
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "copy-done", "all-gather-done", "all-reduce-done",
               "collective-permute-done", "async-done", "call-done", "send-done", "recv-done", "opt-barrier",
               "add-dependency", "iota"}
_SLICES = {"dynamic-slice", "slice"}


def _local(mod: H.HloModule, comp: str) -> dict[str, H.Instr]:
  return {i.name: i for i in mod.comps.get(comp, [])}


def _operand_arrays(mod: H.HloModule, ins: H.Instr) -> list[H.Array | None]:
  local = _local(mod, ins.comp)
  return [local[o].out if o in local else None for o in ins.operands]


def _window_pairs(out_size: int, in_size: int, size: int, stride: int, low: int, lhs_dilate: int,
                  rhs_dilate: int) -> int:
  """(output position, window position) pairs of one spatial dim that read a real input element."""
  o = np.arange(out_size, dtype=np.int64)[:, None]
  total = 0
  for start in range(0, size, 4096):  # chunks keep the [out, window] table small
    k = np.arange(start, min(size, start + 4096), dtype=np.int64)[None, :]
    p = o * stride + k * rhs_dilate - low
    ok = (p >= 0) & (p % lhs_dilate == 0) & (p // lhs_dilate < in_size)
    total += int(ok.sum())
  return total


def _conv_flops(mod: H.HloModule, ins: H.Instr) -> float:
  labels = _LABELS.search(ins.text)
  ops = _operand_arrays(mod, ins)
  out = ins.result[0] if ins.result else None
  if labels is None or len(ops) < 2 or ops[0] is None or ops[1] is None or out is None:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  lhs, rhs = ops[0].shape, ops[1].shape
  spatial = sorted((c for c in rhs_l if c.isdigit()), key=int)  # window dims are in spatial-index order
  fields: dict[str, list[str]] = {}
  window = _WINDOW.search(ins.text)
  for item in (window.group(1).split() if window else []):
    key, _, val = item.partition("=")
    fields[key] = val.split("x")
  pairs = 1
  for n, d in enumerate(spatial):
    get = lambda key, default: int(fields[key][n]) if key in fields else default  # noqa: E731
    pad = fields["pad"][n].split("_") if "pad" in fields else ["0", "0"]
    pairs *= _window_pairs(out.shape[out_l.index(d)], lhs[lhs_l.index(d)], rhs[rhs_l.index(d)], get("stride", 1),
                           int(pad[0]), get("lhs_dilate", 1), get("rhs_dilate", 1))
  return 2.0 * out.shape[out_l.index("b")] * out.shape[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs


def _dot_flops(mod: H.HloModule, ins: H.Instr) -> float:
  dims = dict(_DIMS.findall(ins.text))
  ops = _operand_arrays(mod, ins)
  out = ins.result[0] if ins.result else None
  if not ops or ops[0] is None or out is None:
    return 0.0
  contract = [int(d) for d in dims.get("lhs_contracting_dims", "").split(",") if d]
  return 2.0 * out.elements * math.prod(ops[0].shape[d] for d in contract)


def flops(mod: H.HloModule) -> float:
  """Matmul FLOPs of one step: every dot, ragged dot and convolution, times its computation's runs."""
  total = 0.0
  for ins in mod.instrs():
    times = mod.multipliers.get(ins.comp)
    if not times:
      continue
    if ins.opcode in ("dot", "ragged-dot"):
      total += times * _dot_flops(mod, ins)
    elif ins.opcode == "convolution":
      total += times * _conv_flops(mod, ins)
  return total


# The splash kernel's custom calls (jax.experimental.pallas.ops.tpu.splash_attention get_kernel_name) and the
# FLOPs of each, per (head, query row, key) pair, as multiples of (H, Hv): the matmuls of the forward, dq and dkv
# kernels (dkv with dq: the fused backward, which has three outputs).
_SPLASH = re.compile(r"^splash_(mha|mqa)_(fwd|dq|dkv)")
_SPLASH_MATMULS = {"fwd": (1, 1), "dq": (2, 1), "dkv": (2, 2), "dkv_fused": (3, 2)}
_FLOAT = ("bf16", "f16", "f32", "f64", "f8e4m3fn", "f8e5m2")
_LITERAL = re.compile(r"\bconstant\((\{.*\})\)")


def _mask_literal(mod: H.HloModule, ins: H.Instr, name: str) -> list[int] | None:
  """The values of the constant behind operand `name` of ins (through copies and async copies), None where XLA
  printed no literal (it elides large ones as {...})."""
  local = _local(mod, ins.comp)
  src = local.get(name)
  while src is not None and src.opcode in ("copy", "copy-done", "copy-start", "bitcast") and src.operands:
    src = local.get(src.operands[0])
  m = _LITERAL.search(src.text) if src is not None and src.opcode == "constant" else None
  if m is None or "..." in m.group(1):
    return None
  return [int(v) for v in re.findall(r"-?\d+", m.group(1))]


def splash_flops(mod: H.HloModule, ins: H.Instr) -> tuple[float, bool] | None:
  """(FLOPs of one run of a splash kernel's custom call, whether its block-mask share is estimated), or None for
  any other instruction (module docstring)."""
  kind = _SPLASH.match(ins.name)
  if ins.opcode != "custom-call" or kind is None:
    return None
  ops = _operand_arrays(mod, ins)
  floats = [a for a in ops if a is not None and a.dtype in _FLOAT and len(a.shape) >= 2]
  if len(floats) < 3:
    return None
  q, k, v = floats[:3]  # the kernel's operands after its scalar prefetch (the block tables): q, k, v first
  units, T, H = math.prod(q.shape[:-2]), q.shape[-2], q.shape[-1]
  S, Hv = k.shape[-2], v.shape[-1]
  phase = kind.group(2) + ("_fused" if kind.group(2) == "dkv" and len(ins.result) == 3 else "")
  a, b = _SPLASH_MATMULS[phase]
  # The block mask: an int8 [heads or 1, query blocks, key blocks] table, 0 where a block is skipped.
  tables = [(n, o) for n, o in zip(ins.operands, ops) if o is not None and o.dtype == "s8" and len(o.shape) == 3]
  named = [n for n, _ in tables if "block_mask" in n] or [n for n, _ in tables[1:2]]
  values = _mask_literal(mod, ins, named[0]) if named else None
  if values:
    share, estimated = sum(x != 0 for x in values) / len(values), False
  else:
    n = tables[0][1].shape[-1] if tables else 1
    share, estimated = (n + 1) / (2 * n), True  # the causal triangle of n x n blocks, the diagonal's included
  return 2.0 * units * T * S * share * (a * H + b * Hv), estimated


def custom_call_flops(mod: H.HloModule) -> tuple[float, list[str]]:
  """(FLOPs of the custom calls it knows, one step: splash_flops times each computation's runs; the calls
  whose count is estimated, by name)."""
  total, estimated = 0.0, []
  for ins in mod.instrs():
    times = mod.multipliers.get(ins.comp)
    if not times or ins.opcode != "custom-call":
      continue
    got = splash_flops(mod, ins)
    if got is not None:
      total += times * got[0]
      if got[1]:
        estimated.append(ins.name)
  return total, estimated


def _fused_reads(mod: H.HloModule, fusion: H.Instr) -> tuple[dict[int, int], int | None]:
  """({operand index: bytes read} for operands the fused computation only slices; the in-place root's
  (dynamic-update-slice) buffer parameter index and its update's bytes, or None)."""
  comp = (fusion.called.get("calls") or [""])[0]
  items = mod.comps.get(comp, [])
  params = {}
  for i in items:
    if i.opcode == "parameter":
      m = re.search(r"parameter\((\d+)\)", i.text)
      if m:
        params[i.name] = int(m.group(1))
  users: dict[str, list[H.Instr]] = {}
  for i in items:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  sliced = {}
  for name, k in params.items():
    us = users.get(name, [])
    if us and all(u.opcode in _SLICES and u.operands[0] == name for u in us):
      sliced[k] = sum(u.out.bytes for u in us if u.out is not None)
  root = next((i for i in items if i.text.startswith("ROOT ")), None)
  update = None
  if root is not None and root.opcode == "dynamic-update-slice" and root.operands and root.operands[0] in params:
    local = {i.name: i for i in items}
    upd = local.get(root.operands[1]) if len(root.operands) > 1 else None
    sliced[params[root.operands[0]]] = 0  # the buffer is written in place, never read whole
    update = upd.out.bytes if upd is not None and upd.out is not None else 0
  return sliced, update


def traffic_bytes(mod: H.HloModule) -> float:
  """Estimated bytes read and written by one step's top-level instructions, times their computation's runs."""
  inner = set()
  for ins in mod.instrs():
    if ins.opcode == "fusion":
      inner.update(ins.called.get("calls", []))
    inner.update(ins.called.get("to_apply", []))
  total = 0.0
  for ins in mod.instrs():
    times = mod.multipliers.get(ins.comp)
    if not times or ins.comp in inner or ins.opcode in _NO_TRAFFIC:
      continue
    ops = _operand_arrays(mod, ins)
    written = sum(a.bytes for a in ins.result)
    if ins.opcode == "fusion":
      sliced, update = _fused_reads(mod, ins)
      read = sum(sliced.get(k, a.bytes if a is not None else 0) for k, a in enumerate(ops))
      if update is not None:
        written = update
    elif ins.opcode in _SLICES:
      read = written
    elif ins.opcode == "dynamic-update-slice":
      update = ops[1].bytes if len(ops) > 1 and ops[1] is not None else 0
      read, written = update, update
    else:
      read = sum(a.bytes for a in ops if a is not None)
    total += times * (read + written)
  return total
