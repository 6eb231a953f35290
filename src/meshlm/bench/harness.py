"""The interleaved-arm benchmark: compile each arm once, warm up, then time A B A B ...

Every arm times the real compiled train step (built by `build_train_step`, as `meshlm train`
does) on one fixed synthetic batch. Interleaving spreads machine drift evenly across arms, so the
ratio between arms is fairer than back-to-back blocks; the spread says how far to trust it.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np

from meshlm.analysis.arms import Arm
from meshlm.bench.stats import arm_stats, ratios, verdict


@dataclasses.dataclass
class _Runner:
  name: str
  call: Any
  state: Any
  batch: Any

  def step(self, n: int = 1) -> float:
    """Seconds per step, averaged over n back-to-back steps (one rep)."""
    import jax
    t0 = time.perf_counter()
    for _ in range(n):
      self.state, metrics = self.call(self.state, self.batch)  # the step donates its state: rebind
    jax.block_until_ready((self.state, metrics))
    return (time.perf_counter() - t0) / n


def synthetic_batch(global_batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A fixed packed-looking batch: random tokens, one segment per row, positions 0..T-1."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(global_batch, seq_len + 1), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (global_batch, seq_len)).copy()
  return {"inputs": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy(),
          "segment_ids": np.ones((global_batch, seq_len), np.int32), "positions": positions,
          "loss_mask": np.ones((global_batch, seq_len), np.float32)}


def _prepare(arm: Arm) -> _Runner:
  import jax
  from meshlm.train.step import build_train_step
  step = build_train_step(arm.cfg)
  state = step.init_state(jax.random.key(arm.cfg.train.seed))
  batch = step.put_batch(synthetic_batch(step.global_batch, arm.cfg.train.seq_len, arm.cfg.model.vocab_size))
  with jax.set_mesh(step.mesh):
    compiled = step.fn.lower(state, batch).compile()
  return _Runner(arm.name, compiled, state, batch)


def _reason(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"


def run(arms: list[Arm], reps: int, warmup: int = 2, log=None, prepare=None, steps_per_rep: int = 1) -> dict[str, Any]:
  """{"arms": {NAME: {"median_s", "spread", "reps"} or {"error"}}, "ratios", "verdict"}.

  prepare(arm) -> runner with .step(n) -> seconds per step; the default compiles the arm's train
  step. Each rep times steps_per_rep back-to-back steps of one arm, then moves to the next arm.
  """
  log = log or (lambda msg: print(msg, file=sys.stderr))
  prepare = prepare or _prepare
  runners: dict[str, _Runner] = {}
  errors: dict[str, str] = {}
  for arm in arms:
    log(f"bench: compiling {arm.name}")
    try:
      runners[arm.name] = prepare(arm)
      for _ in range(warmup):
        runners[arm.name].step()
    except Exception as e:  # report the arm and the reason; the other arms still run
      errors[arm.name] = _reason(e)
      runners.pop(arm.name, None)
      log(f"bench: arm {arm.name} failed: {errors[arm.name]}")
  times: dict[str, list[float]] = {n: [] for n in runners}
  for r in range(reps):
    for name in list(runners):
      try:
        times[name].append(runners[name].step(steps_per_rep))
      except Exception as e:
        errors[name] = _reason(e)
        runners.pop(name)
        times.pop(name)
        log(f"bench: arm {name} failed during rep {r}: {errors[name]}")
  results: dict[str, dict] = {}
  for arm in arms:
    if arm.name in times and times[arm.name]:
      results[arm.name] = arm_stats(times[arm.name])
    else:
      results[arm.name] = {"median_s": None, "spread": None, "reps": [], "error": errors.get(arm.name, "no reps")}
  return {"arms": results, "ratios": ratios(results), "verdict": verdict(results)}


def render(report: dict[str, Any]) -> str:
  lines = [f"  {'arm':<20} {'median s':>10} {'spread':>8} {'ratio':>7} {'reps':>5}  verdict"]
  for name, a in report["arms"].items():
    if a.get("error"):
      lines.append(f"  {name:<20} {'failed':>10}  {a['error']}")
      continue
    v = report["verdict"].get(name)
    word = "baseline" if v is None else f"{v['verdict']} ({v['difference']:+.1%} vs {v['vs']}, noise {v['noise']:.1%})"
    lines.append(f"  {name:<20} {a['median_s']:>10.4f} {a['spread']:>8.1%} {report['ratios'].get(name, float('nan')):>7.3f} "
                 f"{len(a['reps']):>5}  {word}")
  return "\n".join(lines)


def plot(report: dict[str, Any], path: str, title: str = "") -> None:
  """Per-arm rep times (dots) and medians (bars) as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [n for n, a in report["arms"].items() if a.get("reps")]
  fig, ax = plt.subplots(figsize=(1.6 + 1.4 * max(1, len(names)), 3.6), dpi=120)
  for i, n in enumerate(names):
    a = report["arms"][n]
    ms = [t * 1e3 for t in a["reps"]]
    ax.bar(i, a["median_s"] * 1e3, color="#9ecae1", width=0.6)
    ax.scatter([i] * len(ms), ms, color="#08519c", s=12, zorder=3)
  ax.set_xticks(range(len(names)), names)
  ax.set_ylabel("step time (ms)")
  ax.set_title(title or "meshlm bench: per-rep step time, bar = median")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
