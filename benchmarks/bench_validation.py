"""Validates `meshlm bench`'s paired interval on this machine: an A/A test and an injected slowdown.

  .venv/bin/python benchmarks/bench_validation.py [--runs 10] [--max-seconds 60] [--target-ci 0.01]
      [--slowdown 0.03] [--timer wall|cpu] [--out runs/bench-validation] [key=value ...]

One process compiles llama2-tiny's train step once (cpu_devices=4, mesh.fsdp=4, global batch 16,
float32) and gives three arms their own state (the step donates it):
- `a`: the step (the baseline);
- `a2`: the same step again, an A/A twin of `a`;
- `slow`: the same step, then a calibrated extra computation (a chain of small matmuls on one
  device, run after the step has finished, so its cost adds to the step's).
Each of the --runs runs first calibrates the extra work to --slowdown of the step time, measured
in that run (interleaved step and extra timings), then runs `bench.harness.run` on the three arms
in ABBA rounds (a a2 slow slow a2 a) with --target-ci, bounded by --max-seconds. A run passes the
A/A check when a2's interval covers 1, and the slowdown check when `slow` is called "slower".
The issue asks for at least 9 of 10 on each. The injected slowdown actually realized in a run
is the extra work's median cost, timed inside the `slow` arm's visits, over `a`'s median step. Prints a markdown table for docs/analysis.md and
writes every report to --out/validation.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from meshlm.bench.harness import TIMERS

BASE = ["model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=4",
        "train.compute_dtype=float32", "train.param_dtype=float32"]


TIMER = TIMERS["wall"]  # --timer sets it


class Step:
  """One arm: the compiled step with its own state and batch (layout None: the harness shares it with no arm)."""
  layout = shardings = None

  def __init__(self, call, state, batch):
    from meshlm.bench.harness import StateSlot
    self.call, self.batch, self.slot = call, batch, StateSlot(lambda: state, state)

  def run_one(self):
    import jax
    self.slot.state, metrics = self.call(self.slot.state, self.batch)  # donated: rebind
    jax.block_until_ready((self.slot.state, metrics))

  def step(self, n: int = 1) -> float:
    t0 = TIMER()
    for _ in range(n):
      self.run_one()
    return (TIMER() - t0) / n


class Extra:
  """k chained [256, 256] matmuls on one device; k is a runtime argument (one compile)."""

  def __init__(self):
    import jax
    import jax.numpy as jnp
    dev = jax.devices()[0]
    self.x = jax.device_put(jnp.ones((256, 256), jnp.float32) / 256, dev)
    self.w = jax.device_put(jnp.eye(256, dtype=jnp.float32) * 0.999, dev)
    self.fn = jax.jit(lambda x, w, k: jax.lax.fori_loop(0, k, lambda i, y: jnp.tanh(y @ w), x))
    self.k = 0
    self.run(1)

  def run(self, k: int) -> float:
    import jax
    t0 = TIMER()
    jax.block_until_ready(self.fn(self.x, self.w, k))
    return TIMER() - t0


class Slowed(Step):
  """The step, then the extra work once the step has finished. Records what the extra work cost."""

  def __init__(self, call, state, batch, extra: Extra):
    super().__init__(call, state, batch)
    self.extra, self.extra_s = extra, []

  def run_one(self):
    super().run_one()
    self.extra_s.append(self.extra.run(self.extra.k))


def calibrate(base: Step, extra: Extra, fraction: float, reps: int = 4) -> dict:
  """Sets extra.k so that the extra work costs `fraction` of a step, from interleaved timings of
  the step and the extra work, in two passes (the second at the first pass's k, which removes the
  call overhead's share from the estimate)."""
  k = 32
  for _ in range(2):
    steps, extras = [], []
    for _ in range(reps):
      steps.append(base.step())
      extras.append(extra.run(k))
    t_step = statistics.median(steps)
    k = max(1, round(k * fraction * t_step / statistics.median(extras)))
  extra.k = k
  return {"k": k, "step_s": t_step}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=10)
  ap.add_argument("--max-seconds", type=float, default=60.0)
  ap.add_argument("--target-ci", type=float, default=0.01)
  ap.add_argument("--min-rounds", type=int, default=6)
  ap.add_argument("--slowdown", type=float, default=0.03)
  ap.add_argument("--out", default="runs/bench-validation")
  ap.add_argument("--timer", choices=sorted(TIMERS), default="wall", help="what a visit measures (see meshlm bench)")
  ap.add_argument("overrides", nargs="*", help="extra key=value after the base config")
  a = ap.parse_args()
  global TIMER
  TIMER = TIMERS[a.timer]
  os.makedirs(a.out, exist_ok=True)

  from meshlm.analysis.arms import Arm, build_arms, prepare_devices
  (arm,) = build_arms([*BASE, *a.overrides], ["a:"])
  prepare_devices([arm])
  import jax

  from meshlm.bench.harness import plot, run, synthetic_batch
  from meshlm.train.step import build_train_step
  t0 = time.perf_counter()
  step = build_train_step(arm.cfg)
  batch = step.put_batch(synthetic_batch(step.global_batch, arm.cfg.train.seq_len, arm.cfg.model.vocab_size))
  states = [step.init_state(jax.random.key(arm.cfg.train.seed)) for _ in range(3)]
  with jax.set_mesh(step.mesh):
    compiled = step.fn.lower(states[0], batch).compile()
  extra = Extra()
  runners = {"a": Step(compiled, states[0], batch), "a2": Step(compiled, states[1], batch),
             "slow": Slowed(compiled, states[2], batch, extra)}
  print(f"compiled in {time.perf_counter() - t0:.1f} s; global batch {step.global_batch}", file=sys.stderr)

  results = []
  for i in range(a.runs):
    cal = calibrate(runners["a"], extra, a.slowdown)
    runners["slow"].extra_s.clear()
    report = run([Arm(n, [], None) for n in runners], reps=a.min_rounds, warmup=1,
                 prepare=lambda arm: runners[arm.name], log=lambda m: None,
                 target_ci=a.target_ci, max_seconds=a.max_seconds, timer=a.timer)
    aa, sl = report["arms"]["a2"], report["arms"]["slow"]
    # The injected slowdown realized in this run: the extra work's median cost over a's median step.
    cal["realized"] = statistics.median(runners["slow"].extra_s) / report["arms"]["a"]["median_s"]
    row = {"run": i + 1, "calibration": cal, "report": report,
           "aa_covers_1": aa["ratio_ci"] is not None and aa["ratio_ci"][0] <= 1.0 <= aa["ratio_ci"][1],
           "slow_detected": report["verdict"]["slow"]["verdict"] == "slower"}
    results.append(row)
    print(f"run {i + 1}: step {cal['step_s'] * 1e3:.1f} ms, extra k={cal['k']} realized {cal['realized']:.2%}; "
          f"{report['rounds']} rounds, stop {report['stop']['reason']}; "
          f"a2 {aa['ratio']:.4f} {aa['ratio_ci']}; slow {sl['ratio']:.4f} {sl['ratio_ci']} "
          f"{report['verdict']['slow']['verdict']}", file=sys.stderr, flush=True)
    if i == 0:
      plot(report, os.path.join(a.out, "run1.png"),
           title=f"bench validation run 1: a2 = A/A twin of a, slow = a + {cal['realized']:.1%} injected work")
    with open(os.path.join(a.out, "validation.json"), "w") as f:
      json.dump(results, f, indent=1)

  print(f"Command: `.venv/bin/python benchmarks/bench_validation.py --runs {a.runs} --max-seconds {a.max_seconds:g} "
        f"--target-ci {a.target_ci:g} --slowdown {a.slowdown:g} --timer {a.timer}{' ' + ' '.join(a.overrides) if a.overrides else ''}`  ")
  print(f"Config: {' '.join(BASE + a.overrides)} (global batch {step.global_batch}); "
        f"{os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f}.\n")
  print(f"| run | step ({a.timer} ms) | injected (measured) | rounds | stop | A/A ratio [95% interval] | covers 1 | "
        "slow ratio [95% interval] | verdict |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for r in results:
    rep, cal = r["report"], r["calibration"]
    aa, sl = rep["arms"]["a2"], rep["arms"]["slow"]
    ci = lambda x: "n/a" if x["ratio_ci"] is None else f"{x['ratio']:.4f} [{x['ratio_ci'][0]:.4f}, {x['ratio_ci'][1]:.4f}]"
    print(f"| {r['run']} | {cal['step_s'] * 1e3:.1f} | {cal['realized']:.2%} | {rep['rounds']} | {rep['stop']['reason']} | "
          f"{ci(aa)} | {'yes' if r['aa_covers_1'] else 'NO'} | {ci(sl)} | {rep['verdict']['slow']['verdict']} |")
  n = len(results)
  print(f"\nA/A: the interval covers 1 in {sum(r['aa_covers_1'] for r in results)} of {n} runs. "
        f"Injected slowdown: detected slower in {sum(r['slow_detected'] for r in results)} of {n} runs.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
