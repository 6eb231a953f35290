"""Per-arm statistics and the noise-aware verdict."""
from __future__ import annotations

import statistics


def arm_stats(times_s: list[float]) -> dict:
  """{"median_s", "spread", "reps"}: spread is (max - min) / median over the reps."""
  med = statistics.median(times_s)
  return {"median_s": med, "spread": (max(times_s) - min(times_s)) / med if med > 0 else 0.0,
          "reps": list(times_s)}


def ratios(arms: dict[str, dict]) -> dict[str, float]:
  """Each arm's median over the first arm's (the baseline). Failed arms are left out."""
  ok = {n: a for n, a in arms.items() if a.get("median_s")}
  if not ok:
    return {}
  base = next(iter(arms.values())).get("median_s")
  if not base:
    return {}
  return {n: a["median_s"] / base for n, a in ok.items()}


def verdict(arms: dict[str, dict]) -> dict[str, dict]:
  """Per non-baseline arm: "faster"/"slower" only when the relative difference of the medians
  exceeds the larger of the two arms' spreads; otherwise "inside noise"."""
  names = list(arms)
  if not names:
    return {}
  base_name = names[0]
  base = arms[base_name]
  out = {}
  for n in names[1:]:
    a = arms[n]
    if not a.get("median_s") or not base.get("median_s"):
      out[n] = {"vs": base_name, "verdict": "failed", "difference": None, "noise": None}
      continue
    diff = a["median_s"] / base["median_s"] - 1.0
    noise = max(a["spread"], base["spread"])
    word = "inside noise" if abs(diff) <= noise else ("faster" if diff < 0 else "slower")
    out[n] = {"vs": base_name, "verdict": word, "difference": diff, "noise": noise}
  return out
