"""Where a MoE train step's time goes, by stage: XLA:CPU's own profile of the compiled step.

  .venv/bin/python benchmarks/moe_profile.py [key=value ...] [--steps 5] [--warmup 3] [--json PATH]

Builds the train step exactly as `meshlm bench` does (meshlm.bench.harness.compile_arm: the same
config keys, the same synthetic batch), runs --warmup steps, then profiles --steps steps with
jax.profiler and reads the trace back (jax.profiler.ProfileData). Every executed HLO op (a thunk of
XLA:CPU's runtime, inside loop bodies too) is one event with its op name; the compiled HLO's metadata
gives each op its JAX name stack (`moe/sort/...`, `transpose(jvp(...))` for the backward), and the op's
stage follows from that and its opcode:

  router        moe/router (the router matmul, softmax, top-k)
  sort          moe/sort (the argsort of the expert ids, the group sizes)
  gather        moe/gather (the token rows into expert order) and its backward's scatter-add
  block layout  gathers/scatters into and out of the padded block layout inside the grouped matmuls
  gate_up, down the grouped matmuls' dots (forward: y = x W; backward: dx and dW)
  glu           act(gate) * up between them
  unsort        moe/unsort (rows back to (token, slot) order)
  combine       moe/combine (the weighted sum over k)
  moe other     anything else under moe/ (the aux statistics, barriers, loop bookkeeping)
  kernel gathers / grad reduce  the collectives (all-gather / reduce-scatter / all-reduce) of the step
  dense glu     a dense model's GLU MLP (`mlp/mlp/`), for the arm a MoE step is measured against
  rest          everything outside moe/: attention, norms, embedding, loss, optimizer

Events on every thread are summed: "thread ms" is busy thread-time per step (XLA:CPU runs independent
thunks concurrently and a dot on several threads, so the column sums to more than the wall step),
averaged over the profiled steps and, under a mesh, over the devices (per device). Prints a markdown
table with each stage's forward and backward share.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
import tempfile

STAGES = ("router", "sort", "gather", "block layout", "gate_up", "glu", "down", "unsort", "combine", "moe other",
          "kernel gathers", "grad reduce", "dense glu", "rest")
TOP = int(os.environ.get("MOE_PROFILE_TOP", 25))  # the costliest ops listed under the table
COLLECTIVE_GATHER = ("all-gather", "all-gather-start", "all-gather-done")
COLLECTIVE_REDUCE = ("reduce-scatter", "all-reduce", "all-reduce-start", "all-reduce-done", "all-to-all")


def op_names(hlo_text: str) -> dict[str, tuple[str, str]]:
  """HLO instruction name -> (opcode, metadata op_name), over every computation of the module."""
  out = {}
  pat = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*[^=]*?\s([a-z][\w\-]*)\(")
  for line in hlo_text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)
    m = pat.match(line)
    if not m:
      continue
    name = m.group(1).lstrip("%")
    meta = re.search(r'op_name="([^"]*)"', line)
    out[name] = (m.group(2), meta.group(1) if meta else "")
  return out


def fusion_kinds(hlo_text: str) -> dict[str, str]:
  """fusion instruction name -> the opcodes inside its called computation, joined (to spot dots)."""
  comps, cur = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and "=" not in line.split("{")[0]:
      cur = head.group(1)
      comps[cur] = []
      continue
    m = re.match(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^=]*?\s([a-z][\w\-]*)\(", line)
    if cur and m:
      comps[cur].append(m.group(1))
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\sfusion\(.*calls=%?([\w.\-]+)", line)
    if m:
      out[m.group(1)] = " ".join(comps.get(m.group(2), []))
  return out


def stage_of(opcode: str, op_name: str, inner: str = "") -> str:
  if opcode in COLLECTIVE_GATHER:
    return "kernel gathers"
  if opcode in COLLECTIVE_REDUCE:
    return "grad reduce"
  op_name = op_name.replace("/shard_map", "")
  if "/moe/" not in f"/{op_name}":
    return "dense glu" if "/mlp/mlp/" in f"/{op_name}" else "rest"
  for scope, stage in (("moe/router", "router"), ("moe/sort", "sort"), ("moe/gather", "gather"),
                       ("moe/unsort", "unsort"), ("moe/combine", "combine")):
    if scope in op_name:
      return stage
  if "moe/experts" in op_name:
    dotlike = opcode in ("dot", "convolution", "custom-call") or "dot" in inner
    layout = opcode in ("gather", "scatter", "dynamic-slice", "dynamic-update-slice") or (
        opcode == "fusion" and ("gather" in inner or "scatter" in inner) and "dot" not in inner)
    for scope in ("gate_up", "down"):
      if f"experts/{scope}" in op_name:
        if dotlike:
          return scope
        if layout:
          return "block layout"
        return scope
    if "glu" in op_name or opcode == "fusion":
      return "glu"
  return "moe other"


def profile(cfg_args: list[str], steps: int, warmup: int):
  import jax
  from jax.profiler import ProfileData
  from meshlm.analysis.arms import build_arms, prepare_devices
  arms = build_arms(cfg_args, ["step:"], min_arms=1)
  prepare_devices(arms)
  from meshlm.bench.harness import compile_arm
  built = compile_arm(arms[0])
  runner = built.runner
  hlo = built.compiled.as_text()
  names = op_names(hlo)
  inner = fusion_kinds(hlo)
  for _ in range(warmup):
    runner.step(1)
  d = tempfile.mkdtemp(prefix="moe_profile_")
  jax.profiler.start_trace(d)
  runner.step(steps)
  jax.profiler.stop_trace()
  path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
  ns = collections.Counter()
  unknown = collections.Counter()
  by_op = collections.Counter()
  devices = set()
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      for ev in line.events:
        stats = dict(ev.stats)
        op = stats.get("hlo_op")
        if op is None:
          continue
        devices.add(stats.get("device_ordinal", 0))
        opcode, op_name = names.get(op, ("?", ""))
        if opcode == "?":
          unknown[op] += ev.duration_ns
        if opcode in ("while", "conditional", "call"):
          continue  # their bodies' thunks are events of their own
        direction = "bwd" if "transpose(" in op_name else "fwd"
        stage = stage_of(opcode, op_name, inner.get(op, ""))
        ns[(stage, direction)] += ev.duration_ns
        by_op[(stage, op, opcode, op_name)] += ev.duration_ns
  per = max(1, len(devices)) * steps
  table = {s: {dr: ns[(s, dr)] / per / 1e6 for dr in ("fwd", "bwd")} for s in STAGES}
  top = [(s, op, oc, name, t / per / 1e6) for (s, op, oc, name), t in by_op.most_common(TOP)]
  return table, {"devices": len(devices), "steps": steps, "unmapped_ms": sum(unknown.values()) / per / 1e6,
                 "unmapped": [(op, t / per / 1e6) for op, t in unknown.most_common(5)], "top": top}


def render(table: dict, info: dict) -> str:
  total = sum(v["fwd"] + v["bwd"] for v in table.values())
  moe = sum(v["fwd"] + v["bwd"] for s, v in table.items() if s not in ("rest", "dense glu"))
  rows = ["| stage | forward (thread ms) | backward (thread ms) | share of step |", "| --- | --- | --- | --- |"]
  for s, v in table.items():
    t = v["fwd"] + v["bwd"]
    rows.append(f"| {s} | {v['fwd']:.2f} | {v['bwd']:.2f} | {100 * t / total:.1f}% |")
  rows.append(f"| total | {sum(v['fwd'] for v in table.values()):.2f} | {sum(v['bwd'] for v in table.values()):.2f} "
              f"| MoE and collectives {100 * moe / total:.1f}% |")
  rows.append(f"\n{info['steps']} steps, {info['devices']} device(s); per device and step; "
              f"unmapped events {info['unmapped_ms']:.2f} ms")
  rows.append("\ncostliest ops (thread ms per device and step):")
  rows += [f"  {t:8.2f}  {s:14s} {op} {oc} {name[-90:]}" for s, op, oc, name, t in info["top"]]
  rows.append(f"unmapped: {info['unmapped']}")
  return "\n".join(rows)


def main(argv: list[str]) -> int:
  steps, warmup, out, args = 5, 3, None, []
  it = iter(argv)
  for a in it:
    if a == "--steps":
      steps = int(next(it))
    elif a == "--warmup":
      warmup = int(next(it))
    elif a == "--json":
      out = next(it)
    else:
      args.append(a)
  table, info = profile(args, steps, warmup)
  print(render(table, info))
  if out:
    with open(out, "w") as f:
      json.dump({"args": args, "table": table, "info": info}, f, indent=1)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main(sys.argv[1:]))
