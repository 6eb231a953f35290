"""Ahead-of-time compiles for a topology (`meshlm compile`): memory against the chip, census, roofline.

`compile_report(lowered, inputs, chip, cfg)` compiles a lowered program for its mesh's devices (a TPU slice
from libtpu, or fake CPU devices), runs nothing, and reports
- memory per device: the executable's own `memory_analysis()` (arguments, outputs, aliased, temporaries,
  peak), the arguments split by what they hold (parameters, optimizer state, batch) from the inputs' shard
  shapes, against the device's HBM: fits or does not fit. XLA:TPU refuses to compile a program that does
  not fit; the report then carries the compiler's own figures from its error (required, available);
- the census of the compiled program (analysis/census.py), on the texts of this very executable;
- a roofline: matmul FLOPs (the dots', and the splash kernel's custom calls' from their shapes) and estimated HBM
  bytes of the step (analysis/cost.py, every loop counted its trip count; XLA's cost_analysis, which counts a loop
  body once and sees no FLOPs in a custom call, beside them) over the chip's published peak and bandwidth: a lower
  bound on the step time, and the MFU that bound implies for the model FLOPs; `estimated` names the parts that are
  estimates;
- the compile time.
"""
from __future__ import annotations

import dataclasses
import math
import re
import tempfile
import time
from typing import Any

from meshlm.analysis import cost as C
from meshlm.analysis import hlo as H
from meshlm.analysis.census import census_of, hlo_unread_loops, lowered_of

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ChipFigures:
  """Published per-chip figures (Google Cloud TPU documentation; TPU7x from Google's Ironwood announcement):
  bf16 peak FLOP/s, HBM bandwidth in bytes/s, HBM capacity in bytes."""
  name: str
  peak_flops: float
  hbm_bandwidth: float
  hbm_bytes: float


# Keyed by the device_kind libtpu reports. TPU7x: 4,614 TFLOP/s is its published FP8 peak; bf16 is half that,
# as on every TPU MXU.
PUBLISHED = {
    "TPU v4": ChipFigures("v4", 275e12, 1200e9, 32 * GiB),
    "TPU v5 lite": ChipFigures("v5e", 197e12, 819e9, 16e9),
    "TPU v5": ChipFigures("v5p", 459e12, 2765e9, 95e9),
    "TPU v6 lite": ChipFigures("v6e", 918e12, 1640e9, 32e9),
    "TPU7x": ChipFigures("tpu7x", 4614e12 / 2, 7370e9, 192e9),
}


@dataclasses.dataclass
class Chip:
  """One device of the topology: its kind, how many share a chip, its HBM and where that figure came from
  ("compiler": libtpu's own limit; "published": the chip's figure over its devices; "hbm_gib": given), and
  the published peak and bandwidth per device (None where unknown: fake CPU devices)."""
  kind: str
  platform: str
  devices: int
  devices_per_chip: int
  hbm_bytes: int | None
  hbm_source: str | None
  peak_flops: float | None
  hbm_bandwidth: float | None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_SIZE = r"([\d.]+)\s*([KMGTP]?)i?B?"
_OOM = re.compile(r"total memory required for HLO temporaries \(" + _SIZE + r"\) exceeds available HBM \(" + _SIZE
                  + r"\)")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def _bytes(value: str, unit: str) -> int:
  return int(round(float(value) * _UNITS[unit]))


def oom_figures(message: str) -> dict | None:
  """XLA:TPU's CompileTimeHbmOom error -> {"required_bytes", "available_bytes"} (its 1024-based figures to
  two decimals: arguments and temporaries together, and the device's usable HBM), or None for another error."""
  m = _OOM.search(message)
  if m is None:
    return None
  return {"required_bytes": _bytes(m.group(1), m.group(2)), "available_bytes": _bytes(m.group(3), m.group(4))}


_VMEM = re.compile(r"Scoped allocation with size " + _SIZE + r" and limit " + _SIZE)
_VMEM_KERNEL = re.compile(r"allocating on stack for %([A-Za-z_][\w-]*?)(?:\.\d+)? = ")
_VMEM_BLOCKS = re.compile(r'\\?"(block_\w+)\\?": (\d+)')


def vmem_figures(message: str) -> dict | None:
  """XLA:TPU's CompileTimeScopedVmemOom error -> {"kernel" (the custom call's name: Mosaic's kernel), "required_bytes",
  "limit_bytes", "blocks" (the kernel's recorded block sizes), and what to change where a kernel's module knows it
  (nn/splash_rule.vmem_advice: "kernel", "phase", "key")}, or None for another error."""
  m = _VMEM.search(message)
  if m is None:
    return None
  kernel = _VMEM_KERNEL.search(message)
  out = {"kernel": kernel.group(1) if kernel else None, "required_bytes": _bytes(m.group(1), m.group(2)),
         "limit_bytes": _bytes(m.group(3), m.group(4)),
         "blocks": {k: int(v) for k, v in _VMEM_BLOCKS.findall(message)}}
  from meshlm.nn.splash_rule import vmem_advice
  advice = vmem_advice(out["kernel"] or "", out["blocks"])
  return out | ({"advice": advice} if advice else {})


def vmem_line(v: dict) -> str:
  """The one line a scoped-VMEM refusal prints: "splash dkv kernel needs 16.44 MiB of scoped VMEM, the chip has
  16.00: set sa_block_kv_dkv_compute=512"."""
  need, has = v["required_bytes"] / (1 << 20), v["limit_bytes"] / (1 << 20)
  a = v.get("advice")
  if a is None:
    return (f"kernel {v['kernel'] or '(unnamed)'} needs {need:.2f} MiB of scoped VMEM, the chip has {has:.2f}: "
            "lower its block sizes")
  return f"{a['kernel']} {a['phase']} kernel needs {need:.2f} MiB of scoped VMEM, the chip has {has:.2f}: set {a['key']}"


def hbm_limit(device) -> int | None:
  """The HBM XLA:TPU lets one program of this device use, read from the compiler's refusal of a program that
  needs 1 TiB (it compiles nothing else; about a second). None off TPU, or if the compiler says otherwise."""
  import jax
  import jax.numpy as jnp
  if device.platform != "tpu":
    return None
  big = jax.ShapeDtypeStruct((1 << 30, 1024), jnp.int8, sharding=jax.sharding.SingleDeviceSharding(device))
  try:
    jax.jit(lambda a: a + 1).lower(big).compile()
  except Exception as e:  # the refusal is the answer
    found = oom_figures(str(e))
    return found["available_bytes"] if found else None
  return None


def chip_for(devices: list, chips: int, hbm_gib: float | None = None) -> Chip:
  """The device description: kind, per-chip count, HBM (hbm_gib given, else the compiler's limit, else the
  published figure) and the published peak and bandwidth per device."""
  d = devices[0]
  per_chip = max(1, len(devices) // max(chips, 1))
  pub = PUBLISHED.get(d.device_kind)
  hbm, source = None, None
  if hbm_gib is not None:
    hbm, source = int(hbm_gib * GiB), "hbm_gib"
  elif d.platform == "tpu":
    hbm = hbm_limit(d)
    source = "compiler" if hbm else None
    if hbm is None and pub is not None:
      hbm, source = int(pub.hbm_bytes / per_chip), "published"
  return Chip(d.device_kind, d.platform, len(devices), per_chip, hbm, source,
              pub.peak_flops / per_chip if pub else None, pub.hbm_bandwidth / per_chip if pub else None)


_REPORT_ROW = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*(\d+);\s*(.*)$")
_REPORT_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def largest_buffers(dump_dir: str, top: int = 8) -> list[dict]:
  """The largest allocations of the program's device memory, from the memory-usage report XLA writes into its
  dump (`*memory-usage-report.txt`, also when the program does not fit): [{"bytes", "values", "shapes"}], each
  one buffer of the assignment and the values that share it ("5×f32[32,1,8,4,8192,8192]": five values of that
  shape). The program's module is the dump's largest report; [] when XLA wrote none."""
  import glob
  import os
  best, rows = -1, []
  for path in glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt")):
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    total = next((int(ln.split()[2]) for ln in lines if ln.startswith("Total bytes:")), 0)
    if total <= best:
      continue
    best, rows = total, []
    for ln in lines[lines.index(next(x for x in lines if x.startswith("Total bytes:"))) + 1:] if total else []:
      if ln.startswith("Memory Space:") or ln.strip().startswith("The rest"):
        break
      m = _REPORT_ROW.match(ln)
      if m:
        rows.append({"bytes": int(float(m.group(1)) * _REPORT_UNITS.get(m.group(2), 1)), "values": int(m.group(3)),
                     "shapes": m.group(4).strip()})
  return rows[:top]


def shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings: each leaf's shard shape."""
  import jax
  import numpy as np
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def _memory(compiled, inputs: dict[str, Any], hbm: int | None, platform: str) -> dict:
  stats = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes", "peak_memory_in_bytes")
  out = {k.removesuffix("_size_in_bytes").removesuffix("_in_bytes") + "_bytes": int(getattr(stats, k))
         for k in keys if stats is not None and hasattr(stats, k)}
  # XLA:TPU's peak is its buffer assignment's, live ranges considered. XLA:CPU's leaves the temporaries out
  # (it is arguments + unaliased outputs there), so off TPU the peak is what the program holds at once at most:
  # arguments, outputs that do not reuse an argument's buffer, temporaries.
  held = (out.get("argument_bytes", 0) + out.get("output_bytes", 0) - out.get("alias_bytes", 0)
          + out.get("temp_bytes", 0))
  peak = out.pop("peak_memory_bytes", 0)
  if platform == "tpu" and peak:
    out["peak_bytes"], out["peak_source"] = peak, "memory_analysis.peak_memory_in_bytes"
  else:
    out["peak_bytes"], out["peak_source"] = held, "arguments + outputs - aliased + temporaries"
  out["arguments_by_input"] = {k: shard_bytes(v) for k, v in inputs.items()}
  out["hbm_bytes"] = hbm
  out["fits"] = None if hbm is None else out["peak_bytes"] <= hbm
  return out


def roofline(hlo_text: str, xla_cost: dict, chip: Chip, model_flops: float | None, recompute: float = 0.0,
             step_loop: bool = False) -> dict:
  """Step-time lower bound max(FLOPs / peak, bytes / bandwidth) per device, and the MFU it implies. recompute: the
  share of model_flops the program runs again (remat_recompute): `model_flops_run` = model_flops x (1 + recompute)
  is what the HLO's count should come to, `hlo_over_model` the ratio. step_loop: the program is a loop of steps
  whose trip count is a runtime value (the sampler's decode loop): `flops` and `bytes` are one trip of it
  (cost.step_loop), `once_flops` and `once_bytes` what runs once per call around it (casts and relayouts XLA
  hoists out of the loop), `step_loop` the loop's name (None where the program has no one such loop: then the
  whole program, the loop's body once)."""
  mod = H.parse(hlo_text)
  loop = C.step_loop(mod) if step_loop else None
  within = C.loop_comps(mod, loop) if loop is not None else None
  dots, traffic = C.flops(mod, within), C.traffic_bytes(mod, within)
  custom, guessed = C.custom_call_flops(mod, within)
  flops = dots + custom
  unread = hlo_unread_loops(mod, skip=loop)
  # Collective instructions as the program text holds them, each once (a loop body's once, however many trips):
  # how the seed counts its 397B program's collectives; the census counts them per step.
  kinds = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
  instructions = {k: sum(i.opcode in (k, f"{k}-start") for i in mod.instrs()) for k in kinds}
  # The loops whose trip count is not read count once per start in flops and bytes: named, never silent.
  out = {"flops": flops, "dot_flops": dots, "custom_call_flops": custom, "bytes": traffic,
         "estimated": estimated_parts(guessed, unread), "collective_instructions": instructions,
         "unread_loops": unread, "xla_cost_analysis": xla_cost, "model_flops": model_flops,
         "model_flops_run": model_flops * (1 + recompute) if model_flops else None,
         "hlo_over_model": flops / (model_flops * (1 + recompute)) if model_flops else None,
         "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth}
  if step_loop:
    out["step_loop"] = loop.name if loop is not None else None
    if loop is not None:
      out["once_flops"] = C.flops(mod) + C.custom_call_flops(mod)[0] - flops
      out["once_bytes"] = C.traffic_bytes(mod) - traffic
  if chip.peak_flops and chip.hbm_bandwidth:
    compute_s, memory_s = flops / chip.peak_flops, traffic / chip.hbm_bandwidth
    bound = max(compute_s, memory_s)
    out |= {"compute_s": compute_s, "memory_s": memory_s, "bound_s": bound,
            "bound_by": "compute" if compute_s >= memory_s else "memory",
            "mfu_at_bound": (model_flops / (bound * chip.peak_flops)) if model_flops and bound else None}
    if "once_bytes" in out:
      out["once_s"] = max(out["once_flops"] / chip.peak_flops, out["once_bytes"] / chip.hbm_bandwidth)
  return out


def estimated_parts(guessed_calls: list[str], unread: list[dict]) -> list[str]:
  """What in the roofline is an estimate rather than a count, one line each: the HBM bytes (always), the custom
  calls whose FLOPs rest on an assumed mask (cost.custom_call_flops), the loops whose trip count was not read."""
  out = ["bytes: each instruction's operands and result, without on-chip reuse across instructions"]
  splash = [n for n in guessed_calls if n.startswith("splash")]
  decode = [n for n in guessed_calls if n.startswith("decode_attention")]
  if splash:
    out.append(f"custom calls: {len(splash)} splash kernels' skipped blocks taken as the causal triangle (their "
               "block mask too large for the HLO text to print)")
  if decode:
    out.append(f"custom calls: {len(decode)} decode attention kernels count every slot of their layer's cache (they "
               "read each row's filled blocks, a runtime count)")
  if len(splash) + len(decode) < len(guessed_calls):
    out.append(f"custom calls: {len(guessed_calls) - len(splash) - len(decode)} grouped matmul kernels (ragged dot, megablox) count every row of "
               "their buffer (rows past the groups' sizes too: a compact dispatch's padding)")
  if unread:
    out.append(f"loops: {sum(u['runs'] for u in unread)} loop starts per step whose trip count was not read count "
               "their body once (unread_loops)")
  return out


def compile_report(lowered, inputs: dict[str, Any], chip: Chip, model_flops: float | None = None,
                   census: bool = True, keep: bool = False, recompute: float = 0.0, step_loop: bool = False) -> dict:
  """Compiles one lowered program and reports on it (module docstring). A program XLA:TPU refuses for
  memory gives {"fits": False, "oom": the compiler's figures} and no census; one a kernel's scoped VMEM refuses
  {"fits": False, "vmem": vmem_figures(...)}; other errors propagate.
  keep: the report also holds the executable under "_compiled" (None when refused), for a caller that needs
  its output shardings."""
  with tempfile.TemporaryDirectory(prefix="meshlm-compile-") as dump:
    start = time.perf_counter()
    try:
      # The dump holds XLA's memory-usage report: the buffers that make up the peak, even when it does not fit.
      compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
    except Exception as e:
      found = oom_figures(str(e))
      vmem = None if found else vmem_figures(str(e))
      if vmem is not None:
        return {"compile_s": time.perf_counter() - start, "memory": {
            "fits": False, "hbm_bytes": chip.hbm_bytes, "peak_bytes": None, "peak_source": "compiler error",
            "arguments_by_input": {k: shard_bytes(v) for k, v in inputs.items()}, "vmem": vmem,
            "largest_buffers": []}} | ({"_compiled": None} if keep else {})
      if found is None:
        raise
      seconds = time.perf_counter() - start
      return {"compile_s": seconds, "memory": {
          "fits": False, "hbm_bytes": chip.hbm_bytes or found["available_bytes"], "peak_bytes": found["required_bytes"],
          "peak_source": "compiler error", "arguments_by_input": {k: shard_bytes(v) for k, v in inputs.items()},
          "oom": found, "largest_buffers": largest_buffers(dump)}} | ({"_compiled": None} if keep else {})
    seconds = time.perf_counter() - start
    biggest = largest_buffers(dump)
  low = lowered_of(lowered, compiled)
  out = {"compile_s": seconds, "memory": _memory(compiled, inputs, chip.hbm_bytes, chip.platform)
         | {"largest_buffers": biggest},
         "roofline": roofline(low.hlo, low.cost, chip, model_flops, recompute, step_loop)}
  out["collective_instructions"] = out["roofline"].pop("collective_instructions")
  if census:
    out["census"] = census_of(low)
  if keep:
    out["_compiled"] = compiled
  return out


# ------------------------------------------------------------------------------------------- model FLOPs

def remat_recompute(cfg) -> float:
  """The share of the training FLOPs (model_flops_per_token) a step runs again under its remat policy: remat=full
  recomputes the forward in the backward, a third of the 6x count (the blockwise loss recomputes the head's logits
  too); none and dots recompute no matmul."""
  return 1 / 3 if cfg.remat == "full" else 0.0


def model_flops_per_token(cfg) -> float:
  """Training FLOPs of one token (forward + backward): 6 x the matmul parameters it meets, plus causal
  attention as Megatron and MaxText count it: 6 x heads x (qk + v head dims) x the keys a query sees on
  average (seq / 2 under the causal mask, PaLM's 12 x heads x head_dim x seq halved; a sliding-window layer's
  queries see at most the window).

  The matmul parameters are the kernels of the parameter tree (every leaf with two or more dims besides the
  layer axis; the embedding table only when it is the tied head), each times the share of it a token meets
  (its part's Instrument.active_fraction). The widths are the parts' (Instrument.attention_width; a part without
  one does not attend). A recurrence's own work and the elementwise work are not counted."""
  import jax
  from meshlm import spec as S
  from meshlm.models.params import param_specs
  from meshlm.models.model import resolve
  M = resolve(cfg)
  m = M.m
  flat = jax.tree_util.tree_flatten_with_path(param_specs(M), is_leaf=S.is_spec)[0]
  matmul = 0.0
  for path, s in flat:
    names = [str(getattr(k, "key", k)) for k in path]
    if names[0] == "embed" and not m.tie_embeddings:
      continue
    if len([a for a in s.axes if a != "layers"]) < 2:
      continue
    n = float(math.prod(s.shape))
    part = _owner(M, names)
    if part is not None:
      n *= part.instrument.active_fraction(m, s)
    matmul += n
  T = cfg.train.seq_len
  attention = 0.0
  for kind, context in zip(M.plan.kinds, M.plan.contexts):
    w = m.sliding_window if context == "local" and m.sliding_window else T
    # The keys a query sees, averaged over the row: min(i, w) for query i (T / 2 for causal attention).
    keys = T / 2 if w >= T else (w * (w + 1) / 2 + (T - w) * w) / T
    for part in M.kinds[kind].parts:
      if part.instrument.attention_width is not None:
        attention += 6.0 * part.instrument.attention_width(m) * keys
  return 6.0 * matmul + attention


def _owner(M, names: list[str]):
  """The Part whose parameters hold the leaf at the path `names` (["layers", kind, part key, ...]); None
  outside the layers' parts (the embedding, the head, the layer norms)."""
  if names[0] != "layers" or len(names) < 3:
    return None
  return next((p for p in M.kinds[names[1]].parts if p.key == names[2]), None)
