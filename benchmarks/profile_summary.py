"""Where a step's device time goes, from a `jax.profiler` trace (benchmarks/chip.py --profile writes them).

  python benchmarks/profile_summary.py DIR [--top 40] [--json OUT] [--scopes delta_rule,conv1d,...]

Reads the Perfetto/Chrome trace JSON that `jax.profiler.trace(..., create_perfetto_trace=True)` writes under DIR
(`perfetto_trace.json.gz`), takes the device's op events (the "XLA Ops" line of the first TPU or GPU process; every
complete event of it when there is no such line) and sums their own times (a loop's op counts only the time no op
inside it covers): per op name, per op kind (a dot or
convolution fusion, a custom call such as splash attention, a collective, a copy or transpose, the rest), and per
named scope (the meshlm `jax.named_scope`s that reach the op's metadata). Prints the tables; --json writes them.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

KINDS = (  # (kind, pattern over the op's name and long name), first match wins
    ("custom-call (splash, Pallas)", r"custom-call|custom_call|splash|mosaic|pallas"),
    ("collective", r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"),
    ("matmul (dot/convolution fusion)", r"convolution|\bdot\b|dot\.|dot_general|kOutput|kConvolution|matmul"),
    ("copy / transpose", r"\bcopy|transpose|bitcast"),
    ("dynamic slice / update", r"dynamic-slice|dynamic-update-slice|dynamic_slice|dynamic_update_slice"),
    ("reduce", r"\breduce"),
    ("other fusion (elementwise)", r"fusion|loop"),
)


def load_events(path: str) -> list[dict]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def find_trace(folder: str) -> str:
  hits = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json*"), recursive=True)
                + glob.glob(os.path.join(folder, "**", "*.trace.json*"), recursive=True))
  if not hits:
    raise SystemExit(f"{folder}: no perfetto_trace.json(.gz) or *.trace.json(.gz) under it")
  return hits[-1]


def device_ops(events: list[dict]) -> tuple[list[dict], str]:
  """The complete ("X") events of the device's op line, and a description of which line that was."""
  procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
           and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "thread_name"}
  dev = [p for p, n in procs.items() if re.search(r"TPU:0|GPU:0|/device:(TPU|GPU)", n)]
  if not dev:
    dev = [p for p, n in procs.items() if re.search(r"TPU|GPU", n)]
  for p in dev:
    ops = [t for t, n in threads.items() if t[0] == p and n == "XLA Ops"]
    if ops:
      return [e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in ops], \
          f"{procs[p]} / XLA Ops"
  if dev:
    return [e for e in events if e.get("ph") == "X" and e["pid"] == dev[0]], f"{procs[dev[0]]} (every line)"
  return [e for e in events if e.get("ph") == "X"], "every process (no device process found)"


def self_times(ops: list[dict]) -> list[tuple[dict, float]]:
  """Each event with its own time: its duration less the time of the events nested inside it on the same line (a
  while or conditional op spans the ops of its body), so the times add up to the line's busy time."""
  out = []
  by_line = collections.defaultdict(list)
  for e in ops:
    by_line[(e.get("pid"), e.get("tid"))].append(e)
  for events in by_line.values():
    events.sort(key=lambda e: (e.get("ts", 0), -e.get("dur", 0)))
    stack: list[list] = []  # [event, end, own time]
    for e in events:
      start, dur = e.get("ts", 0), e.get("dur", 0)
      while stack and stack[-1][1] <= start:
        out.append(tuple(stack.pop()[::2]))
      if stack:  # nested: its time is not its parent's own
        stack[-1][2] -= dur
      stack.append([e, start + dur, dur])
    out += [tuple(s[::2]) for s in reversed(stack)]
  return out


def kind_of(e: dict) -> str:
  args = e.get("args", {})
  text = " ".join([e.get("name", "")] + [str(v) for k, v in args.items() if k in ("long_name", "hlo_op", "category")])
  for kind, pat in KINDS:
    if re.search(pat, text):
      return kind
  return "other"


def scope_of(e: dict, depth: int) -> str:
  args = e.get("args", {})
  s = args.get("tf_op") or args.get("name_scope") or args.get("scope") or ""
  parts = [p for p in str(s).split("/") if p and not p.startswith("jit(")]
  return "/".join(parts[:depth]) or "(no scope)"


def named_scope_of(e: dict, names: tuple[str, ...]) -> str:
  """The innermost of `names` among the op's scope path components (its tf_op), or "(other)": the time of each
  meshlm jax.named_scope however deep it sits (inside a layer scan and its transpose)."""
  args = e.get("args", {})
  parts = str(args.get("tf_op") or args.get("name_scope") or args.get("scope") or "").split("/")
  for p in reversed(parts):
    for n in names:
      if p == n or p.startswith(n + "[") or p.startswith(n + "."):
        return n
  return "(other)"


def summarize(events: list[dict], top: int = 40, steps: int = 1, scopes: tuple[str, ...] = ()) -> dict:
  ops, line = device_ops(events)
  timed = self_times(ops)
  total = sum(d for _, d in timed)
  by_name, by_kind, by_scope = collections.Counter(), collections.Counter(), collections.Counter()
  by_named = collections.Counter()
  count = collections.Counter()
  sample_args = {}
  for e, d in timed:
    by_name[e["name"]] += d
    count[e["name"]] += 1
    by_kind[kind_of(e)] += d
    by_scope[scope_of(e, 3)] += d
    if scopes:
      by_named[named_scope_of(e, scopes)] += d
    sample_args.setdefault(e["name"], {k: str(v)[:300] for k, v in e.get("args", {}).items()})
  us = lambda c: [{"name": k, "us_per_step": v / steps, "share": v / total if total else 0,  # noqa: E731
                   "calls_per_step": count[k] / steps if k in count else None} for k, v in c.most_common(top)]
  return {"line": line, "events": len(ops), "device_us_per_step": total / steps, "steps": steps,
          "by_kind": us(by_kind), "by_scope": us(by_scope), "by_named_scope": us(by_named), "by_op": us(by_name),
          "op_args": {r["name"]: sample_args[r["name"]] for r in us(by_name)[:top]}}


def render(s: dict) -> str:
  lines = [f"device time {s['device_us_per_step'] / 1e3:,.1f} ms per step ({s['events']} op events, {s['line']})"]
  for key, title in (("by_kind", "kind"), ("by_scope", "scope"), ("by_named_scope", "named scope"), ("by_op", "op")):
    if not s.get(key):
      continue
    lines += ["", f"| {title} | ms per step | share |", "| --- | --- | --- |"]
    lines += [f"| {r['name'][:90]} | {r['us_per_step'] / 1e3:,.2f} | {r['share']:.1%} |" for r in s[key]]
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("folder")
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("--steps", type=int, default=3, help="the steps the trace holds (chip.py traces 3)")
  ap.add_argument("--json", default=None)
  ap.add_argument("--scopes", default="", help="comma-separated meshlm named scopes (delta_rule,conv1d,...): device "
                  "time per scope, the innermost listed one an op sits in, at any depth")
  args = ap.parse_args(argv)
  path = args.folder if os.path.isfile(args.folder) else find_trace(args.folder)
  s = summarize(load_events(path), args.top, args.steps, tuple(n for n in args.scopes.split(",") if n))
  s["trace"] = path
  print(render(s))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(s, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
