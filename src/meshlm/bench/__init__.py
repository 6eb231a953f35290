"""Interleaved-arm benchmarks of the real train step: harness, statistics, tables and plots."""
from meshlm.bench.harness import plot, render, run
from meshlm.bench.stats import arm_stats, median_ci, paired, ratios, verdict

__all__ = ["arm_stats", "median_ci", "paired", "plot", "ratios", "render", "run", "verdict"]
