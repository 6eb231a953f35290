"""FLOPs and memory traffic of a compiled step, counted from its optimized HLO with every loop's trip count.

`compiled.cost_analysis()` counts a `while` body once (XLA's HloCostAnalysis does not multiply by the trip
count), so for a step whose layers run in a scan its FLOPs are about one layer's plus the rest: llama3-8b on
v5p:2x2x1 reports 4.38e13 where the step does 5.3e14. These counts walk the same HLO with `multipliers`
(analysis/hlo.py: a scanned layer's body counts its trip count):

- `flops`: 2 x multiply-adds of every dot, convolution (XLA:TPU writes most dots as convolutions) and
  ragged dot, wherever it sits (inside fusions too), and of the dots XLA rewrote as a multiply and a sum (the
  matrix-vector products of a decode step: a reduce whose metadata names the dot_general it came from). A
  convolution counts only the (output, window) pairs that read a real input element, as HloCostAnalysis does, so
  the padded windows XLA uses to express a batched dot are not counted. Elementwise work is not counted: a lower
  bound for the roofline.
- `custom_call_flops`: the custom calls it knows, which XLA's count cannot see into: the splash attention kernel's
  (a Mosaic `tpu_custom_call` named splash_{mha,mqa}_{fwd,dq,dkv}...), from its operands' shapes. Per head and
  query row against S keys: the forward's q k^T and p v, 2 S (H + Hv); dq's recomputed scores, dp = do v^T and
  dq = ds k, 2 S (2H + Hv); dkv's scores, dv, dp and dk, 2 S (2H + 2Hv), and dq too when it is the fused backward
  (three outputs), 2 S (3H + 2Hv). The kernel skips the key blocks its block mask marks empty (the causal mask's
  upper triangle): the count is times the share of nonzero blocks, read from the mask's constant where XLA prints
  it, else (a mask too large to print) the causal triangle of square blocks, named in `estimated`. And XLA:TPU's
  ragged dot kernel (`jax.lax.ragged_dot` there, the MoE grouped matmul's `ragged`): 2 M K N, each row against one
  group's kernel, every row of the buffer counted (the rows past the groups' sizes too: an upper figure, named in
  `estimated`). And the Gated DeltaNet kernels (nn/gdn_pallas.py, `gdn_chunk_{fwd,bwd}`): per (row, value head,
  chunk of W positions) their matmuls, from v [B, T, N J], g [B, N, U, W] and a state [B, N, H, J] (`gdn_flops`). And
  the decode attention kernel (nn/decode_attention.py, `decode_attention...`): each query row against every slot of
  its layer's cache, 2 C (H + Hv), an upper figure (it computes each row's filled blocks).
- `bytes`: each top-level instruction (outside fusions) reads its operands and writes its result, counting only
  buffers in device memory (HBM: a buffer XLA:TPU's memory-space assignment keeps on chip, `S(1)` VMEM in its
  layout, moves nothing there); a fusion that only slices or gathers from an operand (a layer's row of a stacked
  kernel, an embedding lookup's rows; also through layout copies and casts, and in fusions nested in it) reads the
  slices, and one whose root (or a part of its tuple root) updates a buffer in place (a dynamic-update-slice or a
  scatter: a scan writing a layer's row, a decode step writing its K/V rows into the cache) writes and reads only
  the update; the decode attention kernel reads one layer's row of the cache stacks it is given, every slot (an
  upper figure: it reads each row's filled blocks, a runtime count), and the K/V write beside it (write_rows) each
  batch row's tile holding its slot, read and written back; XLA:TPU's async wrappers (call-start / call-update on
  the SparseCore: collectives, copies) read their data operands and write their outputs, not the operands they carry
  in their result (an async slice, slice-start, reads its window); a conditional counts its costliest branch (which
  one runs is a runtime value: a lax.switch over block sizes counts its largest). An estimate of the HBM traffic,
  not a measurement: on-chip reuse across instructions is not seen.
- The sampler's decode program is a loop over the new tokens whose trip count is a runtime value: `step_loop`
  finds it and `loop_comps` what one trip runs, so the counts above can be taken over one decode step (`within`),
  and what runs once per call around it (the float32 -> bf16 casts XLA hoists out of the loop) apart.
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
               "add-dependency", "iota", "slice-done"}
_SLICES = {"dynamic-slice", "slice", "gather"}  # read only what they take: a window, or rows (an embedding lookup)


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


def reached(mod: H.HloModule, roots: list[str]) -> set[str]:
  """The computations roots call, directly or through others (fusions, loops, calls, reducers), roots included."""
  seen, todo = set(roots), list(roots)
  while todo:
    for ins in mod.comps.get(todo.pop(), []):
      for callees in ins.called.values():
        for c in callees:
          if c in mod.comps and c not in seen:
            seen.add(c)
            todo.append(c)
  return seen


def step_loop(mod: H.HloModule) -> H.Instr | None:
  """The program's one outermost loop whose trip count is not read and which starts once per run (the sampler's
  token loop: its trips are the new tokens, a runtime value), or None where there is not exactly one."""
  unread = mod.unread_loops()
  nested = reached(mod, [c for i in unread for k in ("body", "condition") for c in i.called.get(k, [])])
  outer = [i for i in unread if i.comp not in nested and mod.multipliers.get(i.comp) == 1]
  return outer[0] if len(outer) == 1 else None


def loop_comps(mod: H.HloModule, loop: H.Instr) -> set[str]:
  """The computations one trip of loop runs (its body and condition, and what they call)."""
  return reached(mod, [c for k in ("body", "condition") for c in loop.called.get(k, [])])


def _counted(mod: H.HloModule, ins: H.Instr, within: set[str] | None) -> float:
  """ins's computation's runs per step, 0 where it is outside within (None: everywhere)."""
  if within is not None and ins.comp not in within:
    return 0
  return mod.multipliers.get(ins.comp) or 0


def _instr_flops(mod: H.HloModule, ins: H.Instr) -> float:
  if ins.opcode in ("dot", "ragged-dot"):
    return _dot_flops(mod, ins)
  if ins.opcode == "convolution":
    return _conv_flops(mod, ins)
  if ins.opcode == "reduce":
    return _reduce_dot_flops(mod, ins)
  return 0.0


def _taken(mod: H.HloModule, within: set[str] | None, measure) -> set[str] | None:
  """within (None: every computation) less the branches a conditional is not counted through: a conditional runs
  one of its branches, which one is a runtime value, so each counts its costliest by measure(instruction) (an
  upper bound for that instruction: a lax.switch over block sizes counts its largest block)."""
  conds = [i for i in mod.instrs() if i.opcode == "conditional" and _counted(mod, i, within)]
  if not conds:
    return within
  per_comp: dict[str, float] = {}
  for ins in mod.instrs():
    per_comp[ins.comp] = per_comp.get(ins.comp, 0.0) + (mod.multipliers.get(ins.comp) or 0) * measure(ins)
  untaken: set[str] = set()
  for c in conds:
    reach = [reached(mod, [b]) for b in c.called.get("branch_computations", [])]
    if len(reach) < 2:
      continue
    costs = [sum(per_comp.get(x, 0.0) for x in r) for r in reach]
    best = reach[costs.index(max(costs))]
    for r in reach:
      if r is not best:
        untaken |= r - best
  return (set(mod.comps) if within is None else within) - untaken


def flops(mod: H.HloModule, within: set[str] | None = None) -> float:
  """Matmul FLOPs of one step: every dot, ragged dot and convolution, and the dots XLA rewrote as a multiply and
  a sum, times its computation's runs (within: only these computations'; a conditional's costliest branch)."""
  measure = lambda ins: _instr_flops(mod, ins)  # noqa: E731
  within = _taken(mod, within, measure)
  return sum(_counted(mod, ins, within) * measure(ins) for ins in mod.instrs())


def _reduce_dot_flops(mod: H.HloModule, ins: H.Instr) -> float:
  """A dot XLA rewrote as a multiply and a sum over the contracted dims (a matrix-vector product: one row per
  device in a decode step), known by the dot_general it came from (its metadata) and an add reducer: 2 x the
  elements it reduces."""
  if not ins.op_name.endswith("dot_general"):
    return 0.0
  adds = [i for c in ins.called.get("to_apply", []) for i in mod.comps.get(c, []) if i.text.startswith("ROOT ")]
  ops = _operand_arrays(mod, ins)
  if not adds or adds[0].opcode != "add" or not ops or ops[0] is None:
    return 0.0
  return 2.0 * ops[0].elements


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


# The grouped matmul kernels counted as ragged dots: XLA:TPU's (`jax.lax.ragged_dot`) by name, and megablox's Pallas
# `gmm` and `tgmm` (the MoE grouped matmul's `megablox`) by the call site their op name records.
_GROUPED = re.compile(r"jit\(t?gmm\)\)*/pallas_call")


def ragged_dot_flops(mod: H.HloModule, ins: H.Instr) -> float | None:
  """FLOPs of one run of a grouped matmul kernel: XLA:TPU's ragged dot (a `tpu_custom_call` named ragged-dot..., what
  `jax.lax.ragged_dot` lowers to there) or megablox's gmm / tgmm (a Pallas call from jit(gmm) or jit(tgmm)); None for
  any other instruction. Each row meets one group's kernel: 2 M K N, whichever dim is ragged. The forward and dx
  ([M, K] x [G, K, N] -> [M, N]) and dW ([K, M] x [M, N] -> [G, K, N]) alike: the product of the two float operands'
  and the result's elements over G is (M K N)^2, G being the leading dim of the one rank-3 array among them."""
  if ins.opcode != "custom-call" or not (ins.name.startswith("ragged-dot") or _GROUPED.search(ins.op_name or "")):
    return None
  floats = [a for a in _operand_arrays(mod, ins) if a is not None and a.dtype in _FLOAT and len(a.shape) >= 2]
  out = [a for a in ins.result if a.dtype in _FLOAT]
  if len(floats) != 2 or len(out) != 1:
    return None
  grouped = [a for a in (*floats, out[0]) if len(a.shape) == 3]
  if len(grouped) != 1:
    return None
  return 2.0 * math.sqrt(floats[0].elements * floats[1].elements * out[0].elements / grouped[0].shape[0])


# The Gated DeltaNet kernels' custom calls (nn/gdn_pallas.FWD_NAME, BWD_NAME) and, per (row, value head, chunk),
# how many [W, W] x [W, H], [W, W] x [W, J] and [W, H] x [H, J] products each runs (2 m n k FLOPs apiece: forward
# k k^T, w, q k^T; u, P delta; w S, q S, kd^T delta; the backward's recomputation and its gradients, the module
# docstring of nn/gdn_pallas.py), besides the forward's inverse.
_GDN = re.compile(r"^gdn_chunk_(fwd|bwd)")
_GDN_PRODUCTS = {"fwd": (3, 2, 3), "bwd": (9, 5, 7)}


def gdn_flops(mod: H.HloModule, ins: H.Instr) -> float | None:
  """FLOPs of one run of a Gated DeltaNet kernel's custom call, or None for any other instruction. Its operands
  start q [B, Tp, K H], k, v [B, Tp, N J], g [B, N, U, W] and hold a state [B, N, H, J] (the forward's eighth, the
  backward's eleventh); per (row, value head, chunk) the products of _GDN_PRODUCTS, and the forward's inverse of
  I + A, 2 (log2 W - 1) products of [W, W] x [W, W]."""
  kind = _GDN.match(ins.name)
  if ins.opcode != "custom-call" or kind is None:
    return None
  ops = _operand_arrays(mod, ins)
  state = 7 if kind.group(1) == "fwd" else 10
  if len(ops) <= state or any(ops[i] is None for i in (0, 2, 3, state)) or len(ops[3].shape) != 4:
    return None
  v, g = ops[2], ops[3]
  B, N, U, W = g.shape
  H, J = ops[state].shape[-2:]
  if v.shape[-1] != N * J:
    return None
  ww_h, ww_j, wh_j = _GDN_PRODUCTS[kind.group(1)]
  per_chunk = 2.0 * (ww_h * W * W * H + ww_j * W * W * J + wh_j * W * H * J)
  if kind.group(1) == "fwd":
    per_chunk += 2.0 * 2 * max(int(math.log2(W)) - 1, 0) * W ** 3
  return B * N * U * per_chunk


def _decode_attention(mod: H.HloModule, ins: H.Instr) -> tuple[list, list] | None:
  """(the operands, the KV cache stacks among them) of nn/decode_attention's kernel (a `tpu_custom_call` named
  decode_attention...), or None for any other instruction. Its operands: the scalar-prefetched positions and layer
  index, q [B, K, G, H], the new key and value, then the K and V caches as stacks [L, B, K, C, H] of which it reads
  one layer's row."""
  if ins.opcode != "custom-call" or not ins.name.startswith("decode_attention"):
    return None
  ops = _operand_arrays(mod, ins)
  if len(ops) != 7 or any(a is None for a in ops[2:]) or any(len(a.shape) != 5 for a in ops[5:]):
    return None
  return ops, ops[5:]


def decode_attention_flops(mod: H.HloModule, ins: H.Instr) -> float | None:
  """FLOPs of one run of the decode attention kernel, or None for any other instruction: each query row (B x K x G)
  against every slot of its layer's cache, 2 C (H + Hv), an upper figure (the kernel computes only each row's
  filled blocks, a runtime count)."""
  got = _decode_attention(mod, ins)
  if got is None:
    return None
  q, (k, v) = got[0][2], got[1]
  return 2.0 * q.elements * k.shape[3] * (1 + v.shape[-1] / k.shape[-1])


def custom_call_flops(mod: H.HloModule, within: set[str] | None = None) -> tuple[float, list[str]]:
  """(FLOPs of the custom calls it knows, one step: splash_flops, ragged_dot_flops and gdn_flops times each
  computation's runs; the calls whose count is estimated, by name)."""
  total, estimated = 0.0, []
  for ins in mod.instrs():
    times = _counted(mod, ins, within)
    if not times or ins.opcode != "custom-call":
      continue
    upper = ragged_dot_flops(mod, ins)
    if upper is None:
      upper = decode_attention_flops(mod, ins)
    if upper is not None:  # a ragged dot's every buffer row (a compact dispatch's padding too), every cache slot
      total += times * upper
      estimated.append(ins.name)
      continue
    gdn = gdn_flops(mod, ins)
    if gdn is not None:
      total += times * gdn
      continue
    got = splash_flops(mod, ins)
    if got is not None:
      total += times * got[0]
      if got[1]:
        estimated.append(ins.name)
  return total, estimated


_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # the in-place updates: the operand that holds the update


def _hbm(a: H.Array | None) -> int:
  """a's bytes where it lives in device memory (HBM); 0 for a buffer kept on chip (VMEM, SMEM) or unknown."""
  return a.bytes if a is not None and a.memory_space == 0 else 0


def _update_bytes(local: dict[str, H.Instr], ins: H.Instr) -> int:
  """The bytes an in-place update (dynamic-update-slice, scatter) writes: its update operand's."""
  k = _IN_PLACE[ins.opcode]
  upd = local.get(ins.operands[k]) if len(ins.operands) > k else None
  return upd.out.bytes if upd is not None and upd.out is not None else 0


def _params(items: list[H.Instr]) -> dict[str, int]:
  """{parameter instruction name: its index} of a computation."""
  out = {}
  for i in items:
    m = re.search(r"parameter\((\d+)\)", i.text) if i.opcode == "parameter" else None
    if m:
      out[i.name] = int(m.group(1))
  return out


def _users(items: list[H.Instr]) -> dict[str, list[H.Instr]]:
  users: dict[str, list[H.Instr]] = {}
  for i in items:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  return users


_VIEWS = {"bitcast", "copy", "convert", "reshape"}  # one output element per input element


def _elementwise_root(items: list[H.Instr], param: str) -> bool:
  """Whether a fused computation is its parameter `param` passed through views alone (a layout copy, a cast)."""
  local = {i.name: i for i in items}
  root = next((i for i in items if i.text.startswith("ROOT ")), None)
  while root is not None and root.name != param:
    if root.opcode not in _VIEWS or len(root.operands) != 1:
      return False
    root = local.get(root.operands[0])
  return root is not None


def _sliced(mod: H.HloModule, items: list[H.Instr], users: dict[str, list[H.Instr]], name: str,
            skip: H.Instr | None = None) -> float | None:
  """The share of the value `name` (of a computation of items) read, where it is read through slices alone: by
  its users (but skip), slices of it, views of it (bitcasts, layout copies, casts) read so, and fusions nested in
  the computation whose own parameter is read so or which only view it, their output read so. None where some
  user reads it whole."""
  local = {i.name: i for i in items}
  whole = local[name].out.elements if name in local and local[name].out is not None else 0
  root = next((i for i in items if i.text.startswith("ROOT ")), None)
  if not whole or root is None or name == root.name or (root.opcode == "tuple" and name in root.operands):
    return None  # the computation's result: read whole
  total = 0.0
  for u in users.get(name, []):
    if u is skip:
      continue
    if u.opcode in _SLICES and u.operands[0] == name:
      got = u.out.elements / whole if u.out is not None else 0.0
    elif u.opcode in _VIEWS:
      got = _sliced(mod, items, users, u.name)
    elif u.opcode == "fusion":
      inner = mod.comps.get((u.called.get("calls") or [""])[0], [])
      names = {k: n for n, k in _params(inner).items()}
      got = 0.0
      for k, o in enumerate(u.operands):
        if o != name or got is None:
          continue
        share = _sliced(mod, inner, _users(inner), names.get(k, ""))
        if share is None and k in names and _elementwise_root(inner, names[k]):
          share = _sliced(mod, items, users, u.name)  # a view fused apart: read as its output is
        got = None if share is None else got + share
    else:
      got = None
    if got is None:
      return None
    total += got
  return total


def _fused_reads(mod: H.HloModule, fusion: H.Instr) -> tuple[dict[int, int], int | None]:
  """({operand index: bytes read} for operands the fused computation only slices (itself or in a fusion nested in
  it) or updates in place; the bytes the fusion writes where its root (or a part of its tuple root) updates a
  parameter's buffer in place (a dynamic-update-slice or scatter: the update's bytes, the buffer never read
  whole), else None)."""
  comp = (fusion.called.get("calls") or [""])[0]
  items = mod.comps.get(comp, [])
  local = {i.name: i for i in items}
  params, users = _params(items), _users(items)
  ops = _operand_arrays(mod, fusion)
  size = lambda k: _hbm(ops[k]) if k < len(ops) else 0  # noqa: E731
  sliced = {}
  for name, k in params.items():
    share = _sliced(mod, items, users, name) if users.get(name) else None
    if share is not None:
      sliced[k] = round(share * size(k))
  root = next((i for i in items if i.text.startswith("ROOT ")), None)
  if root is None:
    return sliced, None
  parts = [local.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
  written, in_place = 0, False
  for n, part in enumerate(parts):
    out = fusion.result[n] if len(fusion.result) == len(parts) else None  # this part's buffer, as the fusion holds it
    if part is not None and part.opcode in _IN_PLACE and part.operands and part.operands[0] in params:
      buf = part.operands[0]
      # The buffer is written in place: read only where something else in the fusion slices it.
      sliced[params[buf]] = round((_sliced(mod, items, users, buf, skip=part) or 0) * size(params[buf]))
      written += _update_bytes(local, part) if _hbm(out) else 0
      in_place = True
    else:
      written += _hbm(out)
  return sliced, written if in_place else None


def _fusion_bodies(mod: H.HloModule) -> set[str]:
  """The computations that run inside an instruction (fusion bodies, reducers): no traffic of their own."""
  inner = set()
  for ins in mod.instrs():
    if ins.opcode == "fusion":
      inner.update(ins.called.get("calls", []))
    inner.update(ins.called.get("to_apply", []))
  return inner


_ASYNC = {"call-start", "call-update"}  # XLA:TPU's async wrappers (collectives and copies on the SparseCore)


def _async_outputs(ins: H.Instr) -> list[H.Array]:
  """An async wrapper's result less what it only carries: its type is ((operands), outputs..., state), and the
  operands it holds are the ones it reads, not bytes it writes."""
  rhs = ins.text.split("=", 1)[1].strip() if "=" in ins.text else ""
  if not rhs.startswith("(("):
    return ins.result
  depth = 0
  for i, ch in enumerate(rhs[1:], start=1):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return ins.result[len(H._arrays(rhs[1:i + 1])):]
  return ins.result


def instruction_bytes(mod: H.HloModule, ins: H.Instr) -> tuple[int, int]:
  """(bytes read, bytes written) by one run of a top-level instruction (module docstring)."""
  if ins.opcode in _NO_TRAFFIC:
    return 0, 0
  ops = _operand_arrays(mod, ins)
  written = sum(_hbm(a) for a in ins.result)
  if ins.opcode == "slice-start":
    # XLA:TPU's async slice (a DMA of a window, often into VMEM): its operand's window, the size of the slice it
    # produces, read where the operand is in HBM; the slice written where it lands in HBM.
    outs = [a for a in _async_outputs(ins) if a.dtype != "s32"]
    src = ops[0] if ops else None
    return (sum(a.bytes for a in outs) if _hbm(src) else 0), sum(_hbm(a) for a in outs)
  if ins.opcode in _ASYNC:
    local = _local(mod, ins.comp)
    data = [a for o, a in zip(ins.operands, ops) if o not in local or local[o].opcode not in _ASYNC]
    return sum(_hbm(a) for a in data), sum(_hbm(a) for a in _async_outputs(ins))
  if ins.opcode == "fusion":
    sliced, update = _fused_reads(mod, ins)
    read = sum(sliced.get(k, _hbm(a)) for k, a in enumerate(ops))
    if update is not None:
      written = update
  elif _decode_attention(mod, ins) is not None:
    # The decode attention reads one layer's row of each cache stack, counted whole (its filled blocks are a
    # runtime count: an upper figure, named in `estimated`), and its small operands.
    ops, stacks = _decode_attention(mod, ins)
    read = sum(_hbm(a) for a in ops[:5]) + sum(_hbm(a) // a.shape[0] for a in stacks)
  elif ins.opcode == "custom-call" and ins.name.startswith("write_rows") and len(ops) == 3 and ops[2] is not None:
    # nn/kv_cache.write_by_blocks: each batch row's tile of device memory holding its slot, read and written back
    # (the cache aliased in place), and the new rows.
    cache = ops[2]
    share = min(8, cache.shape[-2]) / cache.shape[-2]  # XLA:TPU's (8, 128) tiles of [.., C, H]
    read = sum(_hbm(a) for a in ops[:2]) + round(_hbm(cache) * share)
    written = round(_hbm(cache) * share)
  elif ins.opcode in _SLICES:
    src = ops[0] if ops else None
    read = round(_hbm(src) * (ins.out.elements / src.elements)) if src is not None and ins.out and src.elements else 0
    read += sum(_hbm(a) for a in ops[1:])  # the start indices, a gather's index array
  elif ins.opcode in _IN_PLACE:
    k = _IN_PLACE[ins.opcode]
    update = _hbm(ops[k]) if len(ops) > k else 0
    read, written = update, (update if ins.result and _hbm(ins.result[0]) else 0)
  else:
    read = sum(_hbm(a) for a in ops)
  return read, written


def traffic(mod: H.HloModule, within: set[str] | None = None) -> list[tuple[float, H.Instr]]:
  """[(bytes per step, instruction)] of every top-level instruction that moves data, times its computation's runs
  (within: only these computations'; a conditional's costliest branch), the largest first."""
  inner = _fusion_bodies(mod)

  def measure(ins):
    return sum(instruction_bytes(mod, ins)) if ins.comp not in inner and ins.opcode not in _NO_TRAFFIC else 0

  within = _taken(mod, within, measure)
  out = []
  for ins in mod.instrs():
    times = _counted(mod, ins, within)
    if times and ins.comp not in inner and ins.opcode not in _NO_TRAFFIC:
      out.append((times * measure(ins), ins))
  return sorted(out, key=lambda t: -t[0])


def traffic_bytes(mod: H.HloModule, within: set[str] | None = None) -> float:
  """Estimated bytes read and written by one step's top-level instructions, times their computation's runs
  (within: only these computations')."""
  return sum(b for b, _ in traffic(mod, within))
