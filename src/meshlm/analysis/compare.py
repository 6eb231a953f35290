"""A/B comparison of census results: the counts side by side and a signature-bucketed HLO diff.

A signature is opcode + result type with layout (e.g. `transpose f32[256,768]{0,1}`). Buckets whose
instruction counts differ between arms are listed with the layers their instructions belong to.
Counting by signature (not by name) makes the diff independent of XLA's instruction numbering.
"""
from __future__ import annotations

import collections
from typing import Any

from meshlm.analysis import hlo as H
from meshlm.analysis.census import HLO_BOOKKEEPING, fmt_value, summary, summary_fields
from meshlm.analysis.scopes import attribute


def signature_buckets(hlo_text: str) -> dict[str, dict[str, Any]]:
  """signature -> {"count", "scopes": {scope: count}} over every computation of the module."""
  mod = H.parse(hlo_text)
  buckets: dict[str, dict[str, Any]] = {}
  for ins in mod.instrs():
    if ins.opcode in HLO_BOOKKEEPING:
      continue
    sig = f"{ins.opcode} " + (",".join(str(a) for a in ins.result) if ins.result else "()")
    b = buckets.setdefault(sig, {"count": 0, "scopes": collections.Counter()})
    b["count"] += 1
    b["scopes"][attribute(ins.op_name)] += 1
  return buckets


def diff_buckets(per_arm: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
  """Buckets whose counts differ between any two arms, largest difference first."""
  names = list(per_arm)
  sigs = sorted(set().union(*[set(b) for b in per_arm.values()]))
  out = []
  for sig in sigs:
    counts = {n: per_arm[n].get(sig, {}).get("count", 0) for n in names}
    if len(set(counts.values())) <= 1:
      continue
    scopes: collections.Counter = collections.Counter()
    for n in names:
      scopes.update(per_arm[n].get(sig, {}).get("scopes", {}))
    out.append({"signature": sig, "counts": counts, "scopes": [s for s, _ in scopes.most_common(3)]})
  out.sort(key=lambda d: (-(max(d["counts"].values()) - min(d["counts"].values())), d["signature"]))
  return out


def compare(results: dict[str, dict[str, Any]], hlo_texts: dict[str, str]) -> dict[str, Any]:
  """{"arms": {NAME: summary}, "identical_op_counts": bool, "diff": [buckets]}."""
  buckets = {n: signature_buckets(t) for n, t in hlo_texts.items()}
  op_counts = [(r["stablehlo"]["op_counts"], r["hlo"]["op_counts"]) for r in results.values()]
  return {
      "arms": {n: summary(r) for n, r in results.items()},
      "configs": {n: r.get("config", {}) for n, r in results.items()},
      "identical_op_counts": all(c == op_counts[0] for c in op_counts),
      "diff": diff_buckets(buckets),
  }


def render(report: dict[str, Any], max_buckets: int = 40) -> str:
  names = list(report["arms"])
  # The fixed fields, then each arm's per-key rows (weight-gradient dots by parameter), in order met.
  fields = list(dict.fromkeys([*summary_fields(), *(f for n in names for f in report["arms"][n])]))
  width = max(len(f) for f in fields)
  cols = [max(12, len(n)) for n in names]
  lines = [f"  {'field':<{width}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, cols))]
  for f in fields:
    vals = [report["arms"][n].get(f) for n in names]
    mark = "  *" if len(set(map(str, vals))) > 1 else ""
    lines.append(f"  {f:<{width}}  " + "  ".join(f"{fmt_value(v):>{w}}" for v, w in zip(vals, cols)) + mark)
  lines.append(f"op counts identical (StableHLO and HLO): {'yes' if report['identical_op_counts'] else 'no'}")
  diff = report["diff"]
  lines.append(f"HLO instruction buckets that differ: {len(diff)}" + (" (showing the largest)" if len(diff) > max_buckets else ""))
  if diff:
    sig_w = min(56, max(len(d["signature"]) for d in diff[:max_buckets]))
    lines.append(f"  {'signature':<{sig_w}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, cols)) + "  layers")
    for d in diff[:max_buckets]:
      lines.append(f"  {d['signature'][:sig_w]:<{sig_w}}  " + "  ".join(f"{d['counts'][n]:>{w}}" for n, w in zip(names, cols))
                   + "  " + ", ".join(d["scopes"]))
  return "\n".join(lines)
