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

Arms whose compiled programs take the same state layout (StateLayout: the state tree's shapes, dtypes, shardings and
memory layouts, read from the executables) step one donated state in turn, so the device holds one state whatever
the number of arms, and a visit times exactly what a training step does. Arms with another layout (another mesh,
another dtype) hold their own states; on an accelerator the idle ones wait in host memory (park).
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


@dataclasses.dataclass(eq=False)
class StateLayout:
  """What a compiled step takes and returns as its state (argument 0 in, output 0 out): the tree and, per leaf, the
  shape, dtype, sharding and memory layout the executable was compiled for. Two arms whose layouts are equal can step
  one donated state in turn: each returns the state exactly as the other takes it, so no call copies or reshards it.
  Shardings compare by what they place where (`is_equivalent_to`), not by their mesh's axis types: explicit and auto
  steps of one mesh take the same buffers."""
  tree: Any  # the state's PyTreeDef
  inputs: tuple  # per leaf (shape, dtype, jax Format: layout + sharding)
  outputs: tuple

  @classmethod
  def of(cls, compiled) -> "StateLayout":
    import jax
    (state_in, _), _ = compiled.in_avals
    (fmt_in, _), _ = compiled.input_formats
    state_out, fmt_out = compiled.out_info[0], compiled.output_formats[0]
    tree = jax.tree.structure(state_in)
    if jax.tree.structure(state_out) != tree:
      tree = None  # the step returns another tree than it takes: no arm can step its state after it
    return cls(tree, _leaves(state_in, fmt_in), _leaves(state_out, fmt_out))

  def __eq__(self, other) -> bool:
    if not isinstance(other, StateLayout) or self.tree is None or self.tree != other.tree:
      return False
    # Each arm's output must be the other's input, both ways (and so each its own: A B B A steps A after A).
    return all(map(_same_leaf, self.outputs, other.inputs)) and all(map(_same_leaf, other.outputs, self.inputs)) \
        and all(map(_same_leaf, self.inputs, other.inputs))


def _leaves(avals, formats) -> tuple:
  import jax
  return tuple((a.shape, a.dtype, f) for a, f in zip(jax.tree.leaves(avals), jax.tree.leaves(formats)))


def _same_leaf(a: tuple, b: tuple) -> bool:
  (shape_a, dtype_a, fmt_a), (shape_b, dtype_b, fmt_b) = a, b
  return (shape_a == shape_b and dtype_a == dtype_b and fmt_a.layout == fmt_b.layout
          and fmt_a.sharding.is_equivalent_to(fmt_b.sharding, len(shape_a)))


@dataclasses.dataclass(eq=False)
class StateSlot:
  """One train state, stepped by every arm whose program takes its layout. Made on first use (`ready`), so a state
  that a later arm shares is never allocated twice; `park` moves it to host memory and `ready` brings it back."""
  make: Callable[[], Any]  # -> a fresh state on its shardings (TrainStep.init_state)
  state: Any = None
  shardings: Any = None  # the tree of shardings it was last placed on (None: as made)
  parked: bool = False  # it waits in host memory
  copies: int = 0  # times `ready` had to copy a state on the device to relabel it (0 when sharing works as meant)

  @property
  def on_device(self) -> bool:
    return self.state is not None and not self.parked

  def ready(self, shardings: Any = None) -> None:
    """The state on the device: made now if it has none, moved back if parked; on `shardings` (the stepping arm's
    own) when given. A slot's arms have equivalent shardings, so on the device that only relabels the same buffers:
    each call then takes exactly the shardings it was compiled for, as a training step's state does, and dispatches
    as fast."""
    import jax
    if self.state is None:
      self.state, self.shardings, self.parked = self.make(), None, False
    want = self.shardings if shardings is None else shardings
    if self.parked:
      self.state, self.shardings, self.parked = jax.device_put(self.state, want), want, False
    elif want is not self.shardings:
      before = _buffer(self.state)
      self.state, self.shardings = jax.device_put(self.state, want), want
      self.copies += _buffer(self.state) != before

  def park(self) -> None:
    """Moves the state (parameters and optimizer moments) to host memory, so that another state fits on the device."""
    import jax
    if self.on_device:
      if self.shardings is None:
        self.shardings = jax.tree.map(lambda a: a.sharding, self.state)
      self.state, self.parked = jax.device_get(self.state), True

  def drop_if_lost(self) -> None:
    """After a failed step: a state whose buffers the step consumed (donated) is made again on the next `ready`."""
    import jax
    if self.on_device and any(a.is_deleted() for a in jax.tree.leaves(self.state)):
      self.state = None


def _buffer(state) -> int:
  """The device address of the state's first shard of its first leaf: whether a device_put moved it."""
  import jax
  return jax.tree.leaves(state)[0].addressable_shards[0].data.unsafe_buffer_pointer()


@dataclasses.dataclass(eq=False)
class _Runner:
  name: str
  call: Any  # the compiled step: (state, batch) -> (state, metrics), donating the state
  slot: StateSlot  # the state it steps: its own, or one that other arms of its layout step too (run: share)
  batch: Any
  timer: Callable[[], float] = time.perf_counter
  layout: Any = None  # StateLayout of `call`; None shares with no arm
  shardings: Any = None  # the state's input shardings of `call` (the slot is readied onto them)

  @property
  def state(self):
    return self.slot.state

  @state.setter
  def state(self, value) -> None:
    self.slot.state = value

  def step(self, n: int = 1) -> float:
    """Seconds per step on self.timer, averaged over n back-to-back steps (one visit). The state must be ready."""
    import jax
    try:
      t0 = self.timer()
      for _ in range(n):
        self.slot.state, metrics = self.call(self.slot.state, self.batch)  # the step donates its state: rebind
      jax.block_until_ready((self.slot.state, metrics))
      return (self.timer() - t0) / n
    except Exception:
      self.slot.drop_if_lost()  # the arms that share it get a fresh one
      raise


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
  step: Any = None  # the TrainStep: new_runner makes another state and batch from it


def compile_arm(arm: Arm, timer: Callable[[], float] = time.perf_counter, init_state: bool = True) -> CompiledArm:
  """Builds the arm's train step and lowers and compiles it from abstract inputs; its runner holds the fixed batch and
  its own state slot, the state made now (init_state) or on the runner's first visit (what `run` does, so that an arm
  that shares another's state never allocates its own)."""
  import jax
  from meshlm.train.step import build_train_step
  step = build_train_step(arm.cfg)
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = step.lower()
  t1, c1 = time.perf_counter(), time.process_time()
  with jax.set_mesh(step.mesh):
    compiled = lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  c = CompiledArm(None, lowered, compiled, t1 - t0, t2 - t1, c1 - c0, c2 - c1, step)
  c.runner = new_runner(arm.name, c, timer)
  if init_state:
    c.runner.slot.ready()
  return c


def new_runner(name: str, c: CompiledArm, timer: Callable[[], float] = time.perf_counter) -> _Runner:
  """A runner of c's executable with its own (not yet made) state slot and the fixed synthetic batch."""
  import jax
  step = c.step
  batch = step.put_batch(synthetic_batch(step.global_batch, step.cfg.train.seq_len, step.cfg.model.vocab_size))
  slot = StateSlot(lambda: step.init_state(jax.random.key(step.cfg.train.seed)))
  (state_shardings, _), _ = c.compiled.input_shardings
  return _Runner(name, c.compiled, slot, batch, timer, StateLayout.of(c.compiled), state_shardings)


def prepare_arm(arm: Arm, timer: Callable[[], float] = time.perf_counter) -> _Runner:
  """The default runner: the arm's compiled train step, the fixed batch and a state slot made on first use."""
  return compile_arm(arm, timer, init_state=False).runner


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
  """The arms still running and why the others stopped: `fail` moves an arm from one to the other. groups: the arms
  that step each state (one list per state, in arm order), as prepared."""
  runners: dict[str, Any]
  errors: dict[str, str]
  log: Callable[[str], None]
  groups: list[list[str]] = dataclasses.field(default_factory=list)

  def fail(self, name: str, e: BaseException, when: str) -> None:
    self.errors[name] = _reason(e)
    gone = self.runners.pop(name, None)
    if gone is not None and all(r.slot is not gone.slot for r in self.runners.values()):
      gone.slot.state = None  # no live arm steps it any more: free it
    self.log(f"bench: arm {name} failed{when}: {self.errors[name]}")

  def slots(self) -> list:
    """The states the live arms step, each once."""
    out: list = []
    for r in self.runners.values():
      if all(r.slot is not s for s in out):
        out.append(r.slot)
    return out


def _prepare_all(arms: list[Arm], prepare, log: Callable[[str], None], share: bool = True) -> _Live:
  """Every arm's runner, compiled; an arm that fails is reported and the others still run. With share, an arm whose
  program takes the state layout of an earlier arm's steps that arm's state (its own slot, never made, is dropped)."""
  live = _Live({}, {}, log)
  for arm in arms:
    log(f"bench: compiling {arm.name}")
    try:
      runner = prepare(arm)
    except Exception as e:  # report the arm and the reason; the other arms still run
      live.fail(arm.name, e, "")
      continue
    group = None
    if share and runner.layout is not None:
      group = next((g for g in live.groups if live.runners[g[0]].layout == runner.layout), None)
    if group is None:
      live.groups.append([arm.name])
    else:
      runner.slot = live.runners[group[0]].slot
      group.append(arm.name)
    live.runners[arm.name] = runner
  return live


def _warm_up(live: _Live, warmup: int, park: bool) -> None:
  """`warmup` untimed visits per arm, after every arm has compiled, so no arm's first timed round follows a long
  compile; each state is made on its first visit."""
  for name in list(live.runners):
    try:
      for _ in range(warmup):
        _visit(live, name, 1, park)
    except Exception as e:
      live.fail(name, e, " during warm-up")


def _visit(live: _Live, name: str, steps: int, park: bool) -> float:
  """The arm's runner.step(steps), its state made ready first; with park, every other state waits in host memory
  while it runs (the arms that share its state move nothing). Neither the making nor a move is timed."""
  runner = live.runners[name]
  if park:
    for slot in live.slots():
      if slot is not runner.slot:
        slot.park()
  runner.slot.ready(runner.shardings)
  return runner.step(steps)


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
      visits[name].append(_visit(live, name, steps_per_rep, park))
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
        park: bool | None = None, share: bool = True) -> dict[str, Any]:
  """The report: {"arms", "ratios", "verdict", "rounds", "stop", "level", "ci_method", "timer", "share", "states",
  "pairs", "park", "state_copies"}.

  arms.NAME is {"median_s", "spread", "reps"} (reps: the per-round times), plus for every arm after
  the first {"ratio", "ratio_ci", "half_width", "rounds", "round_ratios"}; a failed arm has "error".
  prepare(arm) -> runner with .step(n) -> seconds per step, .slot (its state: .ready(shardings), .park(), .copies),
  .shardings (what its slot is readied onto) and .layout (compared with ==; None shares with nothing); the default
  compiles the arm's train step, timed on TIMERS[timer].
  share: arms with equal layouts step one state in turn. states: the arms of each state held; pairs.NAME, for every arm
  after the first: "shared" (it steps the baseline's state), "parked" (its own, and every state but the running arm's
  waits in host memory) or "separate" (its own, every state on the device); state_copies: how often handing a shared
  state to the next arm copied it on the device (0 unless the backend cannot relabel buffers). park (default:
  default_park of the number of states): the idle states wait in host memory, moved back untimed before a visit. Every visit times steps_per_rep
  back-to-back steps. At least `reps` rounds run; with
  target_ci, rounds are then added until every arm's half-width is <= target_ci or max_seconds
  (counted from the first timed round on `clock`) have passed. stop.reason says which: "rounds",
  "target", "time" or "failed".
  """
  log = log or (lambda msg: print(msg, file=sys.stderr))
  prepare = prepare or (lambda arm: prepare_arm(arm, TIMERS[timer]))
  live = _prepare_all(arms, prepare, log, share)
  park = default_park(len(live.groups)) if park is None else park
  groups, slots = [list(g) for g in live.groups], live.slots()
  _warm_up(live, warmup, park)
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
          "stop": stop, "level": level, "ci_method": CI_METHOD, "timer": timer, "share": share, "states": groups,
          "pairs": pairs(arms, groups, park), "park": park, "state_copies": sum(s.copies for s in slots)}


def pairs(arms: list[Arm], groups: list[list[str]], park: bool) -> dict[str, str | None]:
  """How each arm after the first ran against the baseline: "shared", "parked" or "separate" (run's docstring);
  None when either never compiled."""
  group_of = {name: i for i, g in enumerate(groups) for name in g}
  base = group_of.get(arms[0].name)
  out: dict[str, str | None] = {}
  for arm in arms[1:]:
    g = group_of.get(arm.name)
    out[arm.name] = None if g is None or base is None else "shared" if g == base else "parked" if park else "separate"
  return out


def default_park(states: int) -> bool:
  """Park the idle states in host memory when several share an accelerator in one process: each holds its parameters
  and optimizer moments, and two of a model that fits once need not fit together (on a 16 GiB TPU v5e two qwen3-0.6b
  AdamW states do not). On CPU devices the host is the device: nothing to gain. Arms that share one state need none."""
  import jax
  return states > 1 and jax.process_count() == 1 and jax.devices()[0].platform != "cpu"


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


def states_line(report: dict[str, Any]) -> str:
  """One sentence on the states the arms stepped: one shared, or several (parked or all on the device)."""
  groups = report["states"]
  held = "; ".join(" + ".join(g) for g in groups)
  copied = f", copied {report['state_copies']} times on a hand-over" if report["state_copies"] else ""
  if len(groups) == 1:
    return f"one state ({held}{copied})"
  how = "idle ones parked in host memory" if report["park"] else "all on the device"
  return f"{len(groups)} states, {how} ({held}{copied})"


def render(report: dict[str, Any]) -> str:
  timer = "median s" if report.get("timer", "wall") == "wall" else "median cpu s"
  lines = [f"  {'arm':<20} {timer:>10} {'spread':>8} {'ratio':>7} {'95% interval':>16} {'rounds':>6} {'state':>8}  "
           "verdict"]
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
    state = report["pairs"].get(name) or ""  # how it ran against the baseline
    lines.append(f"  {name:<20} {a['median_s']:>10.4f} {a['spread']:>8.1%} {ratio:>7} {ci:>16} {len(a['reps']):>6} "
                 f"{state:>8}  {word}")
  lines.append(f"  {stop_line(report)}; {states_line(report)}; interval: {report['ci_method']}")
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
