"""Per-arm statistics, the paired ratio with its confidence interval, and the verdict.

The bench runs arms in rounds. A round times every arm back to back, so each round gives one ratio
per arm against the baseline (the first arm), and slow drift of the machine cancels inside it. The
summary is the median of those per-round ratios, with a distribution-free interval from the order
statistics of the median (`median_ci`). Why order statistics and not a bootstrap over rounds: the
coverage is exact (at least `level` for any continuous distribution of i.i.d. rounds, heavy tails and
skew included), the answer is deterministic, and a bootstrap of the median under-covers at the few
tens of rounds a bench has (its resampled medians take only a handful of distinct values).
"""
from __future__ import annotations

import math
import statistics
from fractions import Fraction

LEVEL = 0.95
CI_METHOD = "order statistics of the median (binomial), distribution-free"


def arm_stats(times_s: list[float]) -> dict:
  """{"median_s", "spread", "reps"}: spread is (max - min) / median over the reps."""
  med = statistics.median(times_s)
  return {"median_s": med, "spread": (max(times_s) - min(times_s)) / med if med > 0 else 0.0,
          "reps": list(times_s)}


def order_stat_rank(n: int, level: float = LEVEL) -> int:
  """The largest k with P(x_(k) <= median <= x_(n+1-k)) >= level for n i.i.d. samples; 0 if none.

  That probability is 1 - 2 P(B <= k - 1) with B ~ Binomial(n, 1/2). Exact integer arithmetic, so
  it holds at any n (2**n overflows a float past n = 1023).
  """
  alpha = 1 - Fraction(level).limit_denominator(10**6)
  k, tail = 0, 0  # tail = sum_{i < k+1} C(n, i)
  for j in range(n // 2 + 1):
    tail += math.comb(n, j)
    # P(B <= j) <= alpha / 2  <=>  2 * tail <= alpha * 2**n
    if 2 * tail * alpha.denominator <= alpha.numerator * 2**n:
      k = j + 1
    else:
      break
  return k


def median_ci(values: list[float], level: float = LEVEL) -> tuple[float, float] | None:
  """A distribution-free `level` interval for the median of values: [x_(k), x_(n+1-k)], or None
  when there are too few values (n < 6 at 95%)."""
  k = order_stat_rank(len(values), level)
  if k == 0:
    return None
  xs = sorted(values)
  return xs[k - 1], xs[len(xs) - k]


def min_rounds(level: float = LEVEL) -> int:
  """The fewest values for which median_ci gives an interval (6 at 95%)."""
  n = 1
  while order_stat_rank(n, level) == 0:
    n += 1
  return n


def paired(base_s: list[float], arm_s: list[float], level: float = LEVEL) -> dict:
  """The arm against the baseline from per-round times (same length, round i paired with round i):
  {"ratio", "ratio_ci", "half_width", "rounds", "round_ratios"}. ratio is the median of the
  per-round ratios; half_width is half the interval's width, in ratio units (0.01 = 1%)."""
  assert len(base_s) == len(arm_s), (len(base_s), len(arm_s))
  r = [a / b for a, b in zip(arm_s, base_s)]
  ci = median_ci(r, level)
  return {"ratio": statistics.median(r) if r else None, "ratio_ci": list(ci) if ci else None,
          "half_width": (ci[1] - ci[0]) / 2 if ci else None, "rounds": len(r), "round_ratios": r}


def table_cells(base_s: list[float], arm_s: list[float], scale: float = 1.0, median_fmt: str = ".4f",
                digits: int = 3) -> list[str]:
  """A benchmark table row's cells for one arm against the base arm (per-round times in s): its median
  (times `scale`, e.g. 1e3 for ms), spread ((max - min) / median), ratio (the median of the per-round
  ratios, `paired`) and that ratio's 95% interval ("" with too few rounds)."""
  med = statistics.median(arm_s)
  r = paired(base_s, arm_s)
  ci = r["ratio_ci"]
  return [format(med * scale, median_fmt), f"{(max(arm_s) - min(arm_s)) / med:.0%}", f"{r['ratio']:.{digits}f}",
          "" if ci is None else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"]


def verdict_word(ratio_ci: list[float] | None, half_width: float | None, level: float = LEVEL) -> str:
  """"slower" / "faster" only when the interval excludes 1 (a closed interval: an end at exactly 1
  includes it); otherwise "no difference detected at +-X%", X the half-width."""
  if ratio_ci is None:
    return f"too few rounds for a {level:.0%} interval (need {min_rounds(level)})"
  low, high = ratio_ci
  if low > 1.0:
    return "slower"
  if high < 1.0:
    return "faster"
  return f"no difference detected at ±{half_width:.1%}"


def ratios(arms: dict[str, dict]) -> dict[str, float]:
  """Each arm's paired ratio to the first arm (the first is 1.0). Failed arms are left out."""
  names = list(arms)
  if not names or not arms[names[0]].get("median_s"):
    return {}
  out = {names[0]: 1.0}
  for n in names[1:]:
    if arms[n].get("ratio") is not None:
      out[n] = arms[n]["ratio"]
  return out


def verdict(arms: dict[str, dict], level: float = LEVEL) -> dict[str, dict]:
  """Per non-baseline arm: {"vs", "verdict", "ratio", "ratio_ci", "half_width", "difference"}, where
  difference = ratio - 1 and the verdict is verdict_word's."""
  names = list(arms)
  if not names:
    return {}
  base_name = names[0]
  out = {}
  for n in names[1:]:
    a = arms[n]
    if a.get("ratio") is None or not arms[base_name].get("median_s"):
      out[n] = {"vs": base_name, "verdict": "failed", "ratio": None, "ratio_ci": None, "half_width": None,
                "difference": None}
      continue
    out[n] = {"vs": base_name, "verdict": verdict_word(a["ratio_ci"], a["half_width"], level), "ratio": a["ratio"],
              "ratio_ci": a["ratio_ci"], "half_width": a["half_width"], "difference": a["ratio"] - 1.0}
  return out
