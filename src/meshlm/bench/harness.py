"""The paired, interleaved-arm benchmark: compile each arm once, warm up, then time rounds.

Every arm times the real compiled train step (built by `build_train_step`, as `meshlm train`
does) on one fixed synthetic batch. A round visits the arms forward then backward (A B B A, or
A B C C B A): every arm's two visits sit at the same mean position, so a linear drift of the
machine inside the round cancels, and so does an order effect (a step that runs faster or slower
just after another arm's). The next round starts one arm later (B A A B), so every arm takes the
round's ends equally often. Each round gives one time per arm (the mean of its two visits) and so one
ratio per arm against the baseline; the report is the median of those ratios with a distribution-free
95% interval (stats.py). With a target half-width, rounds are added until the interval is that
narrow or the time budget runs out.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import numpy as np

from meshlm.analysis.arms import Arm
from meshlm.bench.stats import CI_METHOD, LEVEL, arm_stats, paired, ratios, verdict


# What a visit measures. wall: elapsed time, what a user waits for. cpu: the CPU seconds every thread
# of this process used (user + system), so time spent waiting for a core that another process holds
# is not counted; it measures work, not latency (a change that only idles cores is invisible to it).
TIMERS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_interleaved(fns: dict[str, tuple[Callable, tuple]], reps: int, timer: str = "cpu") -> dict[str, list[float]]:
  """Seconds per call of each jitted fn(*args), {name: (fn, args)}: each compiled and warmed once, then `reps`
  rounds that visit every arm in a rotated order (round r starts at arm r mod n), so drift in the machine's
  load falls on every arm alike. For benchmark scripts that time functions rather than train steps."""
  import jax
  clock = TIMERS[timer]
  for fn, args in fns.values():
    jax.block_until_ready(fn(*args))  # compile + warm
  times: dict[str, list[float]] = {name: [] for name in fns}
  names = list(fns)
  for r in range(reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      fn, args = fns[name]
      t = clock()
      jax.block_until_ready(fn(*args))
      times[name].append(clock() - t)
  return times


@dataclasses.dataclass
class _Runner:
  name: str
  call: Any
  state: Any
  batch: Any
  timer: Callable[[], float] = time.perf_counter
  parked: Any = None  # the state's shardings while the state waits in host memory (park)

  def park(self) -> None:
    """Moves the state (parameters and optimizer moments) to host memory, so that another arm's fits on the device."""
    import jax
    self.parked = jax.tree.map(lambda a: a.sharding, self.state)
    self.state = jax.device_get(self.state)

  def unpark(self) -> None:
    import jax
    if self.parked is not None:
      self.state, self.parked = jax.device_put(self.state, self.parked), None

  def step(self, n: int = 1) -> float:
    """Seconds per step on self.timer, averaged over n back-to-back steps (one visit)."""
    import jax
    t0 = self.timer()
    for _ in range(n):
      self.state, metrics = self.call(self.state, self.batch)  # the step donates its state: rebind
    jax.block_until_ready((self.state, metrics))
    return (self.timer() - t0) / n


def synthetic_batch(global_batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A fixed packed-looking batch: random tokens, one segment per row, positions 0..T-1."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(global_batch, seq_len + 1), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (global_batch, seq_len)).copy()
  return {"inputs": tokens[:, :-1].copy(), "targets": tokens[:, 1:].copy(),
          "segment_ids": np.ones((global_batch, seq_len), np.int32), "positions": positions,
          "loss_mask": np.ones((global_batch, seq_len), np.float32)}


@dataclasses.dataclass
class CompiledArm:
  """An arm's runner and what building it produced, so that a census or a compile-time table reads
  the very executable that is timed (one compile per arm, not two)."""
  runner: _Runner
  lowered: Any  # jax Lowered
  compiled: Any  # jax Compiled
  lower_s: float  # wall seconds to trace and lower the step
  compile_s: float  # wall seconds for XLA to compile it
  lower_cpu_s: float  # this process's CPU seconds (every thread) for the lowering ...
  compile_cpu_s: float  # ... and for the compile: on a shared machine, steadier than wall seconds


def compile_arm(arm: Arm, timer: Callable[[], float] = time.perf_counter) -> CompiledArm:
  """Builds the arm's train step, its initialized state and the fixed batch; lowers and compiles it."""
  import jax
  from meshlm.train.step import build_train_step
  step = build_train_step(arm.cfg)
  state = step.init_state(jax.random.key(arm.cfg.train.seed))
  batch = step.put_batch(synthetic_batch(step.global_batch, arm.cfg.train.seq_len, arm.cfg.model.vocab_size))
  with jax.set_mesh(step.mesh):
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.fn.lower(state, batch)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
  return CompiledArm(_Runner(arm.name, compiled, state, batch, timer), lowered, compiled, t1 - t0, t2 - t1,
                     c1 - c0, c2 - c1)


def prepare_arm(arm: Arm, timer: Callable[[], float] = time.perf_counter) -> _Runner:
  """The default runner: the arm's compiled train step, its initialized state and the fixed batch."""
  return compile_arm(arm, timer).runner


def _reason(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"


def _widest(times: dict[str, list[float]], level: float) -> float | None:
  """The largest half-width over the non-baseline arms; None while any has no interval yet."""
  names = list(times)
  widths = [paired(times[names[0]], times[n], level)["half_width"] for n in names[1:]]
  return None if any(w is None for w in widths) else max(widths)


@dataclasses.dataclass
class _Live:
  """The arms still running and why the others stopped: `fail` moves an arm from one to the other."""
  runners: dict[str, Any]
  errors: dict[str, str]
  log: Callable[[str], None]

  def fail(self, name: str, e: BaseException, when: str) -> None:
    self.errors[name] = _reason(e)
    self.runners.pop(name, None)
    self.log(f"bench: arm {name} failed{when}: {self.errors[name]}")


def _prepare_all(arms: list[Arm], prepare, warmup: int, log: Callable[[str], None], park: bool = False) -> _Live:
  """Every arm's runner, compiled and then warmed up; an arm that fails is reported and the others still run. With
  park, each arm's state waits in host memory whenever the arm is not running (_visit)."""
  live = _Live({}, {}, log)
  for arm in arms:
    log(f"bench: compiling {arm.name}")
    try:
      live.runners[arm.name] = prepare(arm)
      if park:
        live.runners[arm.name].park()
    except Exception as e:  # report the arm and the reason; the other arms still run
      live.fail(arm.name, e, "")
  # Warm up after every arm has compiled, so no arm's first timed round follows a long compile.
  for name in list(live.runners):
    try:
      for _ in range(warmup):
        _visit(live.runners[name], 1, park)
    except Exception as e:
      live.fail(name, e, " during warm-up")
  return live


def _visit(runner, steps: int, park: bool) -> float:
  """runner.step(steps); with park, the state comes to the device before and goes back to the host after (neither
  move is timed)."""
  if not park:
    return runner.step(steps)
  runner.unpark()
  try:
    return runner.step(steps)
  finally:
    runner.park()


def _time_round(live: _Live, times: dict[str, list[float]], rounds: int, steps_per_rep: int,
                park: bool = False) -> None:
  """One round: every live arm visited forward then backward; appends each arm's mean visit to times."""
  # Rotate the starting arm from round to round, so that every arm takes the round's ends (the
  # visits next to the harness's own work between rounds) equally often, not only the baseline.
  order = list(live.runners)
  order = order[rounds % len(order):] + order[:rounds % len(order)]
  visits: dict[str, list[float]] = {n: [] for n in order}
  for name in order + order[::-1]:  # ABBA: both visits of every arm average to the same position
    if name not in live.runners:
      continue
    try:
      visits[name].append(_visit(live.runners[name], steps_per_rep, park))
    except Exception as e:
      live.fail(name, e, f" during round {rounds}")
      times.pop(name)
  for name in live.runners:
    times[name].append(sum(visits[name]) / len(visits[name]))


def _arm_results(arms: list[Arm], times: dict[str, list[float]], errors: dict[str, str],
                 level: float) -> dict[str, dict]:
  """arms.NAME of the report: each arm's stats, paired with the baseline's; "error" for an arm with no times."""
  results: dict[str, dict] = {}
  base = arms[0].name
  for arm in arms:
    if times.get(arm.name):
      results[arm.name] = arm_stats(times[arm.name])
      if arm.name != base and times.get(base):
        results[arm.name].update(paired(times[base], times[arm.name], level))
    else:
      results[arm.name] = {"median_s": None, "spread": None, "reps": [], "error": errors.get(arm.name, "no reps")}
  return results


def run(arms: list[Arm], reps: int, warmup: int = 2, log=None, prepare=None, steps_per_rep: int = 1,
        target_ci: float | None = None, max_seconds: float | None = None,
        clock: Callable[[], float] = time.perf_counter, level: float = LEVEL, timer: str = "wall",
        park: bool | None = None) -> dict[str, Any]:
  """The report: {"arms", "ratios", "verdict", "rounds", "stop", "level", "ci_method", "timer"}.

  arms.NAME is {"median_s", "spread", "reps"} (reps: the per-round times), plus for every arm after
  the first {"ratio", "ratio_ci", "half_width", "rounds", "round_ratios"}; a failed arm has "error".
  prepare(arm) -> runner with .step(n) -> seconds per step (and .park() / .unpark() when park); the default compiles
  the arm's train step, timed on TIMERS[timer]. park (default: default_park): every arm's state waits in host memory
  while the other arms run, and is moved back untimed before its own visit. Every visit times steps_per_rep back-to-back steps. At least `reps` rounds run; with
  target_ci, rounds are then added until every arm's half-width is <= target_ci or max_seconds
  (counted from the first timed round on `clock`) have passed. stop.reason says which: "rounds",
  "target", "time" or "failed".
  """
  log = log or (lambda msg: print(msg, file=sys.stderr))
  prepare = prepare or (lambda arm: prepare_arm(arm, TIMERS[timer]))
  park = default_park(len(arms)) if park is None else park
  live = _prepare_all(arms, prepare, warmup, log, park)
  times: dict[str, list[float]] = {n: [] for n in live.runners}
  rounds, reason, widest = 0, "failed", None
  t0 = clock()
  while live.runners:
    _time_round(live, times, rounds, steps_per_rep, park)
    rounds += 1
    if not live.runners:
      break
    if rounds < reps:
      continue
    if arms[0].name not in live.runners:  # no baseline, no ratios: nothing to add rounds for
      reason = "failed"
      break
    if target_ci is None or len(times) < 2:
      reason = "rounds"
      break
    widest = _widest(times, level)
    if widest is not None and widest <= target_ci:
      reason = "target"
      break
    if max_seconds is not None and clock() - t0 >= max_seconds:
      reason = "time"
      break
  elapsed = clock() - t0
  results = _arm_results(arms, times, live.errors, level)
  if target_ci is not None and len(times) >= 2 and arms[0].name in times:
    widest = _widest(times, level)
  stop = {"reason": reason, "rounds": rounds, "elapsed_s": elapsed, "target_ci": target_ci,
          "max_seconds": max_seconds, "half_width": widest}
  return {"arms": results, "ratios": ratios(results), "verdict": verdict(results, level), "rounds": rounds,
          "stop": stop, "level": level, "ci_method": CI_METHOD, "timer": timer, "park": park}


def default_park(arms: int) -> bool:
  """Park the idle arms' states in host memory when several arms share an accelerator in one process: each arm holds
  its own parameters and optimizer moments, and two of a model that fits once need not fit together (on a 16 GiB
  TPU v5e two qwen3-0.6b AdamW states do not). On CPU devices the host is the device: nothing to gain."""
  import jax
  return arms > 1 and jax.process_count() == 1 and jax.devices()[0].platform != "cpu"


def stop_line(report: dict[str, Any]) -> str:
  """One sentence on why the rounds stopped."""
  s = report["stop"]
  n, t = s["rounds"], s["elapsed_s"]
  hw = "n/a" if s["half_width"] is None else f"{s['half_width']:.2%}"
  if s["reason"] == "target":
    return f"target reached: half-width {hw} <= {s['target_ci']:.2%} after {n} rounds ({t:.1f} s)"
  if s["reason"] == "time":
    return (f"time budget reached: {s['max_seconds']:g} s ran out after {n} rounds; half-width {hw} "
            f"> target {s['target_ci']:.2%}")
  if s["reason"] == "failed":
    return f"stopped after {n} rounds: the baseline arm failed" if n else "no rounds ran: arms failed"
  return f"{n} rounds ({t:.1f} s)"


def render(report: dict[str, Any]) -> str:
  lines = [f"  {'arm':<20} {'median s' if report.get('timer', 'wall') == 'wall' else 'median cpu s':>10} {'spread':>8} {'ratio':>7} {'95% interval':>16} {'rounds':>6}  verdict"]
  for name, a in report["arms"].items():
    if a.get("error"):
      lines.append(f"  {name:<20} {'failed':>10}  {a['error']}")
      continue
    v = report["verdict"].get(name)
    if v is None:
      ratio, ci, word = "1.000", "", "baseline"
    elif v["ratio"] is None:
      ratio, ci, word = "", "", v["verdict"]
    else:
      ratio = f"{v['ratio']:.3f}"
      ci = "" if v["ratio_ci"] is None else f"[{v['ratio_ci'][0]:.3f}, {v['ratio_ci'][1]:.3f}]"
      word = f"{v['verdict']} (vs {v['vs']})"
    lines.append(f"  {name:<20} {a['median_s']:>10.4f} {a['spread']:>8.1%} {ratio:>7} {ci:>16} {len(a['reps']):>6}  {word}")
  lines.append(f"  {stop_line(report)}; interval: {report['ci_method']}")
  return "\n".join(lines)


def plot(report: dict[str, Any], path: str, title: str = ""):
  """Left: per-round step time per arm (dots) and its median (bar). Right: per-round ratio to the
  baseline (dots) with the median (line) and the 95% interval (band). Returns the saved Figure."""
  import textwrap

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [n for n, a in report["arms"].items() if a.get("reps")]
  compared = [n for n in names if report["arms"][n].get("round_ratios")]
  fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(9.0, 4.2), dpi=120, layout="constrained",
                                   gridspec_kw={"width_ratios": [1, 1.6]})
  for i, n in enumerate(names):
    a = report["arms"][n]
    ms = [t * 1e3 for t in a["reps"]]
    ax_t.bar(i, a["median_s"] * 1e3, color="#9ecae1", width=0.6)
    ax_t.scatter([i] * len(ms), ms, color="#08519c", s=10, zorder=3)
  ax_t.set_xticks(range(len(names)), names, rotation=20, ha="right")
  ax_t.set_ylabel("step time (ms)")
  ax_t.set_title("per-round step time, bar = median", fontsize=9)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, n in enumerate(compared):
    a, c = report["arms"][n], colors[i % len(colors)]
    rr = a["round_ratios"]
    ax_r.scatter(range(1, len(rr) + 1), rr, s=10, color=c, label=n)
    ax_r.axhline(a["ratio"], color=c, lw=1.2)
    if a.get("ratio_ci"):
      ax_r.axhspan(*a["ratio_ci"], color=c, alpha=0.18, lw=0)
  ax_r.axhline(1.0, color="black", lw=0.8, ls="--")
  ax_r.set_xlabel("round")
  base = next(iter(report["arms"]), "")
  ax_r.set_ylabel(f"step time / {base}")
  ax_r.set_title("per-round ratio, line = median, band = 95% interval", fontsize=9)
  if compared:
    ax_r.legend(fontsize=8, loc="best")
  if not title:
    words = "; ".join(f"{n}: {v['verdict']}" for n, v in report.get("verdict", {}).items())
    title = f"meshlm bench, {report.get('rounds', 0)} rounds vs {base}" + (f": {words}" if words else "")
  # Wrap to the figure's width (about 0.55 em per character at this size), so the title is never clipped.
  width_chars = int(fig.get_figwidth() * 72 / (11 * 0.55))
  fig.suptitle(textwrap.fill(title, width_chars, break_on_hyphens=False), fontsize=11)
  fig.savefig(path)
  plt.close(fig)
  return fig
