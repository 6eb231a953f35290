"""The bench harness: the paired ratio and its interval, the verdict, ABBA rounds, --target-ci,
failure isolation, the plot and the CLI input checks."""
import json
import os
import random
import statistics
import time

import pytest

from meshlm.analysis.arms import Arm, build_arms
from meshlm.bench.harness import TIMERS, StateSlot, _Runner, plot, render, run
from meshlm.bench.stats import arm_stats, median_ci, order_stat_rank, paired, ratios, verdict, verdict_word
from meshlm.errors import ConfigError


def test_arm_stats_median_and_spread():
  s = arm_stats([0.30, 0.10, 0.20, 0.25, 0.15])
  assert s["median_s"] == 0.20
  assert s["spread"] == pytest.approx((0.30 - 0.10) / 0.20)
  assert s["reps"] == [0.30, 0.10, 0.20, 0.25, 0.15]


# --- the interval ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(5, 0), (6, 1), (10, 2), (15, 4), (20, 6), (30, 10), (50, 18), (100, 40), (1500, 712)])
def test_order_statistic_rank_matches_the_binomial_tables(n, k):
  # Published 95% ranks for the median (e.g. Conover, Practical Nonparametric Statistics, table A3).
  assert order_stat_rank(n) == k


def test_median_ci_on_known_data():
  values = list(range(1, 21))
  random.Random(0).shuffle(values)
  assert median_ci(values) == (6, 15)  # n = 20: the 6th and 15th order statistics
  assert median_ci([3.0, 1.0, 2.0, 5.0, 4.0]) is None  # 5 values cannot give 95%
  assert median_ci([3.0, 1.0, 2.0, 6.0, 4.0, 5.0]) == (1.0, 6.0)


def _coverage(k_shift: int, n: int = 15, trials: int = 3000) -> float:
  """How often the interval covers the true median of a skewed distribution (exponential, median ln 2)."""
  import math
  rng = random.Random(1234)
  hit = 0
  for _ in range(trials):
    xs = sorted(rng.expovariate(1.0) for _ in range(n))
    k = order_stat_rank(n) + k_shift
    hit += xs[k - 1] <= math.log(2) <= xs[n - k]
  return hit / trials


def test_median_ci_covers_at_its_exact_rate_and_a_narrower_one_does_not():
  # n = 15: [x_(4), x_(12)] covers with probability 1 - 2 P(Bin(15, 1/2) <= 3) = 0.9648.
  assert _coverage(0) == pytest.approx(0.9648, abs=0.012)
  # Negative control: one rank narrower covers only 1 - 2 P(B <= 4) = 0.8815, below 95%.
  assert _coverage(+1) < 0.92


def test_paired_ratio_is_the_median_of_per_round_ratios():
  base = [1.0, 2.0, 4.0, 1.0, 2.0, 4.0, 1.0, 2.0, 4.0, 1.0]  # the machine drifts 4x between rounds
  r = [1.01, 1.03, 1.02, 1.05, 1.04, 0.99, 1.02, 1.03, 1.01, 1.02]
  arm = [b * x for b, x in zip(base, r)]
  p = paired(base, arm)
  assert p["rounds"] == 10 and p["round_ratios"] == pytest.approx(r)
  assert p["ratio"] == pytest.approx(statistics.median(r))
  s = sorted(r)
  assert p["ratio_ci"] == pytest.approx([s[1], s[8]])  # n = 10: 2nd and 9th
  assert p["half_width"] == pytest.approx((s[8] - s[1]) / 2)
  # The ratio of medians (what an unpaired bench reports) is not the paired estimate here.
  assert statistics.median(arm) / statistics.median(base) != pytest.approx(p["ratio"], abs=1e-3)


# --- the verdict ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ci,word", [
    ([1.0, 1.02], "no difference detected at ±1.0%"),  # an end at exactly 1 includes 1
    ([1.0 + 1e-9, 1.02], "slower"),
    ([0.98, 1.0], "no difference detected at ±1.0%"),
    ([0.98, 1.0 - 1e-9], "faster"),
    ([0.97, 1.05], "no difference detected at ±4.0%"),
])
def test_verdict_at_the_boundaries(ci, word):
  assert verdict_word(ci, (ci[1] - ci[0]) / 2) == word


def test_verdict_without_an_interval_or_a_baseline():
  assert verdict_word(None, None) == "too few rounds for a 95% interval (need 6)"
  arms = {"a": {"median_s": None, "spread": None, "reps": [], "error": "x"}, "b": {**arm_stats([1.0]), "ratio": None}}
  assert verdict(arms)["b"]["verdict"] == "failed"
  assert ratios(arms) == {}


# --- the harness, with fake arms and a test-owned clock -------------------------------------------

class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


class _Slot:
  """A fake state slot: where its state is (None: not made yet; "device" or "host"), shared by the runners given it."""

  copies = 0

  def __init__(self, on_device: set | None = None):
    self.where, self.on_device = None, on_device if on_device is not None else set()

  def ready(self, shardings=None):
    self.where = "device"
    self.on_device.add(self)

  def park(self):
    if self.where == "device":
      self.where = "host"
      self.on_device.discard(self)


class _Fake:
  """A runner whose step returns the next scripted time (1.0 when the script runs out) and advances
  the shared fake clock by it. layout: arms with equal layouts share a state (None: none)."""

  def __init__(self, name, order, times, fail_at=None, clock=None, layout=None, on_device=None):
    self.name, self.order, self.times, self.fail_at, self.calls, self.clock = name, order, list(times), fail_at, 0, clock
    self.layout, self.slot, self.shardings = layout, _Slot(on_device), None

  def step(self, n=1):
    self.calls += 1
    if self.fail_at is not None and self.calls > self.fail_at:
      raise RuntimeError(f"{self.name} ran out of memory\nsecond line")
    self.order.append(self.name)
    t = self.times.pop(0) if self.times else 1.0
    if self.clock is not None:
      self.clock.t += t * n
    return t


def _arms(*names):
  return [Arm(n, [], None) for n in names]


def _run(fakes, reps, **kw):
  return run(_arms(*fakes), reps=reps, prepare=lambda arm: fakes[arm.name], log=lambda m: None, **kw)


def test_rounds_are_abba_after_warmup_and_the_json_has_the_contract():
  order = []
  # Warm-up (9s, not counted), then per round two visits per arm; B is 10% slower in every round.
  fakes = {"A": _Fake("A", order, [9, 9] + [1.0, 1.0, 2.0, 2.0] * 3),
           "B": _Fake("B", order, [9, 9] + [1.1, 1.1, 2.2, 2.2] * 3)}
  report = _run(fakes, reps=6, warmup=2)
  assert order[:4] == ["A", "A", "B", "B"]  # warm-up after both compiled
  # Each round: forward, then backward; the next round starts one arm later.
  assert order[4:] == ["A", "B", "B", "A", "B", "A", "A", "B"] * 3
  assert report["rounds"] == 6 and report["stop"]["reason"] == "rounds"
  a, b = report["arms"]["A"], report["arms"]["B"]
  assert set(a) == {"median_s", "spread", "reps"}
  assert set(b) == {"median_s", "spread", "reps", "ratio", "ratio_ci", "half_width", "rounds", "round_ratios"}
  assert a["reps"] == [1.0, 2.0] * 3  # one time per round: the mean of its two visits
  assert b["round_ratios"] == pytest.approx([1.1] * 6)
  assert b["ratio_ci"] == pytest.approx([1.1, 1.1]) and b["rounds"] == 6 and b["half_width"] == pytest.approx(0)
  assert report["ratios"]["A"] == 1.0 and report["ratios"]["B"] == pytest.approx(1.1)
  assert report["verdict"]["B"]["verdict"] == "slower"
  json.dumps(report)  # serializable as is


def test_three_arms_visit_abccba_rotated():
  order = []
  fakes = {n: _Fake(n, order, []) for n in "ABC"}
  _run(fakes, reps=4, warmup=0)
  assert order == list("ABCCBA" "BCAACB" "CABBAC" "ABCCBA")


def test_rotation_cancels_an_effect_at_the_ends_of_a_round():
  # Identical arms; the first visit of every round costs 10% more (say, the harness's bookkeeping
  # between rounds disturbs it). Rotation gives that cost to A and B in turn.
  visits = {"n": 0}

  class Boundary(_Fake):
    def step(self, n=1):
      first = visits["n"] % 4 == 0  # 2 arms: 4 visits a round
      visits["n"] += 1
      return 1.1 if first else 1.0

  report = _run({"A": Boundary("A", [], []), "B": Boundary("B", [], [])}, reps=10, warmup=0)
  b = report["arms"]["B"]
  assert sorted(set(round(r, 6) for r in b["round_ratios"])) == [round(1 / 1.05, 6), 1.05]
  assert b["ratio_ci"][0] < 1.0 < b["ratio_ci"][1]
  assert report["verdict"]["B"]["verdict"].startswith("no difference")
  # Without rotation, A takes every first visit, B reads 1/1.05 in every round and is called "faster"
  # (checked by removing the rotation line: this test then fails).


def test_abba_cancels_a_linear_drift_that_plain_alternation_does_not():
  # The machine slows by 1% per visit; the arms are identical. ABBA gives ratio exactly 1.
  clock = _Clock()

  class Drift(_Fake):
    visits = 0

    def step(self, n=1):
      self.visits += 1
      return 1.0 + 0.01 * self.visits

  shared = Drift("A", [], [])
  fakes = {"A": shared, "B": shared}
  report = _run(fakes, reps=8, warmup=0, clock=clock)
  assert report["arms"]["B"]["ratio_ci"] == pytest.approx([1.0, 1.0])
  assert report["verdict"]["B"]["verdict"].startswith("no difference")
  # Negative control: A then B only (no backward half) would see B as slower in every round.
  abab = [(1.0 + 0.01 * (2 * i + 2)) / (1.0 + 0.01 * (2 * i + 1)) for i in range(8)]
  assert min(abab) > 1.0


def test_second_arm_with_the_larger_spread():
  # issue 9: the verdict must weigh the second arm's noise. B's own noise is +-20% round to round,
  # the baseline's 1%; B's median is 5% above. The interval must include 1.
  b_noise = [1.25, 0.85, 1.20, 0.90, 1.18, 0.86, 1.24, 0.92, 1.05, 1.21, 0.88, 1.06]
  a_times = [1.0, 1.01, 0.99, 1.0, 1.01, 0.99, 1.0, 1.01, 0.99, 1.0, 1.01, 0.99]
  fakes = {"A": _Fake("A", [], [t for t in a_times for _ in (0, 1)]),
           "B": _Fake("B", [], [t for t in b_noise for _ in (0, 1)])}
  report = _run(fakes, reps=12, warmup=0)
  a, b = report["arms"]["A"], report["arms"]["B"]
  assert b["spread"] > 10 * a["spread"]
  assert b["ratio"] > 1.04 and b["ratio_ci"][0] < 1.0 < b["ratio_ci"][1]
  assert report["verdict"]["B"]["verdict"].startswith("no difference detected at ±")
  # Control: a rule that looked only at the baseline's spread would have called B slower.
  assert b["median_s"] / a["median_s"] - 1 > a["spread"]


def test_shared_drift_with_large_spreads_is_still_resolved_by_pairing():
  # Both arms swing 2x with the machine, B is 3% slower in every round: spreads ~100%, interval tight.
  machine = [1.0, 2.0, 1.5, 1.2, 1.9, 1.1, 1.7, 1.3]
  fakes = {"A": _Fake("A", [], [m for m in machine for _ in (0, 1)]),
           "B": _Fake("B", [], [1.03 * m for m in machine for _ in (0, 1)])}
  report = _run(fakes, reps=8, warmup=0)
  assert report["arms"]["A"]["spread"] > 0.5 and report["arms"]["B"]["spread"] > 0.5
  assert report["arms"]["B"]["ratio_ci"] == pytest.approx([1.03, 1.03])
  assert report["verdict"]["B"]["verdict"] == "slower"


def _vdc(i: int) -> float:
  """Van der Corput sequence: spreads evenly over (0, 1) at every prefix length."""
  x, d = 0.0, 0.5
  while i:
    x += d * (i & 1)
    i >>= 1
    d /= 2
  return x


def test_target_ci_stops_when_the_half_width_is_reached():
  clock = _Clock()
  noise = [1.0 + 0.04 * (_vdc(i + 1) - 0.5) for i in range(400)]  # ratios spread over +-2%
  fakes = {"A": _Fake("A", [], [], clock=clock), "B": _Fake("B", [], [x for x in noise for _ in (0, 1)], clock=clock)}
  report = _run(fakes, reps=6, warmup=0, target_ci=0.005, max_seconds=1e6, clock=clock)
  n = report["rounds"]
  assert report["stop"]["reason"] == "target"
  assert report["arms"]["B"]["half_width"] <= 0.005 == report["stop"]["target_ci"]
  assert report["stop"]["half_width"] == report["arms"]["B"]["half_width"]
  # It stopped at the first round that reached the target, not later.
  assert paired([1.0] * (n - 1), noise[:n - 1])["half_width"] > 0.005
  assert 6 < n < 400
  assert "target reached: half-width" in render(report)


def test_target_ci_stops_when_the_time_budget_runs_out():
  clock = _Clock()
  noise = [1.0 + 0.2 * (_vdc(i + 1) - 0.5) for i in range(400)]  # +-10%: 0.1% is out of reach
  fakes = {"A": _Fake("A", [], [], clock=clock), "B": _Fake("B", [], [x for x in noise for _ in (0, 1)], clock=clock)}
  report = _run(fakes, reps=6, warmup=0, target_ci=0.001, max_seconds=30.0, clock=clock)
  # A round is four visits of about 1 s on the fake clock: 28 s after 7 rounds, 32 s after 8.
  assert report["stop"]["reason"] == "time" and report["rounds"] == 8
  assert report["stop"]["elapsed_s"] == pytest.approx(sum(2 + 2 * x for x in noise[:8]))
  assert report["arms"]["B"]["half_width"] > 0.001
  assert "time budget reached: 30 s ran out after 8 rounds" in render(report)


def test_target_ci_runs_at_least_reps_rounds():
  clock = _Clock()
  fakes = {"A": _Fake("A", [], [], clock=clock), "B": _Fake("B", [], [], clock=clock)}  # identical: hw 0
  report = _run(fakes, reps=9, warmup=0, target_ci=0.01, max_seconds=1.0, clock=clock)
  assert report["rounds"] == 9 and report["stop"]["reason"] == "target"


def test_a_visit_is_timed_on_the_runners_timer_and_rebinds_the_donated_state():
  import jax.numpy as jnp
  ticks = iter([10.0, 16.0])  # the test's timer: 6 s over the visit
  calls = []

  def call(state, batch):
    calls.append(state)
    return state + 1, {"loss": state}

  r = _Runner("x", call, StateSlot(lambda: jnp.zeros(())), None, timer=lambda: next(ticks))
  r.slot.ready()
  assert r.step(3) == pytest.approx(2.0)  # seconds per step
  assert [int(c) for c in calls] == [0, 1, 2] and int(r.state) == 3
  assert TIMERS["wall"] is not TIMERS["cpu"]


def test_the_report_names_its_timer():
  fakes = {"A": _Fake("A", [], []), "B": _Fake("B", [], [])}
  report = _run(fakes, reps=6, warmup=0, timer="cpu")
  assert report["timer"] == "cpu" and "median cpu s" in render(report)
  assert _run(fakes, reps=6, warmup=0)["timer"] == "wall"


def test_a_failing_arm_is_reported_and_hides_nothing():
  order = []

  def prepare(arm):
    if arm.name == "oom":
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while lowering\ndetails")
    return {"A": _Fake("A", order, [1.0] * 20), "late": _Fake("late", order, [1.0] * 20, fail_at=3)}[arm.name]

  report = run(_arms("A", "oom", "late"), reps=4, warmup=1, prepare=prepare, log=lambda m: None)
  assert report["arms"]["oom"]["error"] == "RuntimeError: RESOURCE_EXHAUSTED: out of memory while lowering"
  assert report["arms"]["late"]["error"] == "RuntimeError: late ran out of memory"
  assert report["arms"]["A"]["reps"] == [1.0] * 4
  assert report["verdict"]["oom"]["verdict"] == "failed" and report["verdict"]["late"]["verdict"] == "failed"
  assert "failed" in render(report)


def test_a_failed_baseline_still_times_the_others_without_ratios():
  def prepare(arm):
    if arm.name == "A":
      raise RuntimeError("boom")
    return _Fake(arm.name, [], [])

  report = run(_arms("A", "B"), reps=3, warmup=0, prepare=prepare, log=lambda m: None, target_ci=0.01)
  assert report["rounds"] == 3 and report["stop"]["reason"] == "failed"
  assert report["arms"]["B"]["reps"] == [1.0] * 3 and "ratio" not in report["arms"]["B"]
  assert report["verdict"]["B"]["verdict"] == "failed"


# --- the plot -------------------------------------------------------------------------------------

def _draw(fig):
  """Lays the (closed) figure out again on an Agg canvas, as savefig did, and returns the renderer."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  return canvas.get_renderer()


def _inside(fig, artist) -> bool:
  r = fig.canvas.get_renderer()
  box, page = artist.get_window_extent(r), fig.bbox
  return box.x0 >= page.x0 - 0.5 and box.x1 <= page.x1 + 0.5 and box.y0 >= page.y0 - 0.5 and box.y1 <= page.y1 + 0.5


@pytest.fixture(scope="module")
def small_report():
  fakes = {"auto": _Fake("auto", [], []),
           "explicit-with-a-long-arm-name": _Fake("e", [], [1.0 + 0.01 * (i % 5) for i in range(40)])}
  return _run(fakes, reps=10, warmup=0)


def test_plot_writes_a_png_with_every_title_inside_the_figure(tmp_path, small_report):
  path = tmp_path / "bench.png"
  long = ("meshlm bench model=llama2-tiny cpu_devices=4 mesh.fsdp=4 train.per_device_batch_size=4, "
          "explicit-with-a-long-arm-name against auto: no difference detected at ±1.2% over 40 rounds")
  for title in ("", long):
    fig = plot(small_report, str(path), title=title)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shown = fig._suptitle.get_text()
    if title:
      assert "\n" in shown and "".join(shown.split()) == "".join(title.split())  # wrapped, nothing cut
    assert shown.startswith("meshlm bench")
    _draw(fig)
    texts = [fig._suptitle] + [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)
                                if t.get_text()]
    assert all(_inside(fig, t) for t in texts), [t.get_text() for t in texts if not _inside(fig, t)]
  # Control: the same title unwrapped runs off the figure, so the check above can fail.
  fig.suptitle(long)
  _draw(fig)
  assert not _inside(fig, fig._suptitle)


def test_plot_with_a_failed_arm(tmp_path):
  report = {"arms": {"a": arm_stats([0.1, 0.2]), "b": {"median_s": None, "spread": None, "reps": [], "error": "x"}},
            "ratios": {}, "verdict": {"b": {"verdict": "failed"}}, "rounds": 2}
  plot(report, str(tmp_path / "b.png"))
  assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the command line -----------------------------------------------------------------------------

# Each key that changes the compiled program without changing what it computes (issue 61 item 3), as an arm against
# the base: (arm, the platform its summary is read on, the summary field it moves, the arm's value there, the base's).
# llama3-8b at seq 8192: splash on TPU (head dim 128: fused, 1024 blocks), flash on CPU.
PROGRAM_ARMS = [
    ("flash:flash_block=256", "cpu", ("flash_block",), 256, 512),
    ("rope:rope_swap=matmul", "cpu", ("rope_swap",), "matmul", "roll"),
    ("cast:layer_cast=astype", "tpu", ("layer_cast",), "astype", "bits"),
    ("remat:remat_attention=save", "tpu", ("remat_attention",), "save", "recompute"),
    ("scatter:scatter_leading=all", "cpu", ("scatter_leading",), "all", "none"),
    ("backward:splash_backward=split", "tpu", ("splash_backward",), "split", "fused"),
    ("fwd:sa_block_q=512,sa_block_kv=256,sa_block_kv_compute=128", "tpu", ("splash_blocks", "128/128", "fwd"),
     [512, 256, 128], [1024, 1024, 1024]),
    ("dkv:sa_block_q_dkv=512,sa_block_kv_dkv=256,sa_block_kv_dkv_compute=128", "tpu",
     ("splash_blocks", "128/128", "dkv"), [512, 256, 128], [1024, 1024, 1024]),
    ("dq:splash_backward=split,sa_block_q_dq=512,sa_block_kv_dq=256", "tpu", ("splash_blocks", "128/128", "dq"),
     [512, 256], None),
]


def test_every_program_key_is_an_arm_and_in_the_reports():
  """flash_block, rope_swap, layer_cast, remat_attention, scatter_leading, splash_backward and sa_block_* each make
  an arm (`meshlm bench` and `compare --arm name:key=value`), which the report's config summary shows resolved as it
  compiles (analysis/census.config_summary, its keys line), beside the base arm's value."""
  from meshlm.analysis.census import config_summary
  from meshlm.analysis.keys import keys_line
  base = ["model=llama3-8b", "train.seq_len=8192"]
  arms = build_arms(base, ["base:"] + [a for a, *_ in PROGRAM_ARMS])
  for arm, (spec, platform, path, want, was) in zip(arms[1:], PROGRAM_ARMS):
    got, ref = config_summary(arm.cfg, platform), config_summary(arms[0].cfg, platform)
    for k in path:
      got, ref = got[k], ref[k]
    assert (got, ref) == (want, was), (spec, got, ref)
  line = keys_line(config_summary(arms[-1].cfg, "tpu"))
  assert "splash_backward=split" in line and "splash 128/128: fwd 1024/1024/1024 dkv 1024/1024/1024 dq 512/256" in line
  assert "rope_swap=roll" in keys_line(config_summary(arms[0].cfg, "cpu"))

def test_bad_arms_fail_before_compiling():
  with pytest.raises(ConfigError, match="--arm x: duplicate arm name"):
    build_arms(["model=llama2-tiny"], ["x:shard_mode=auto", "x:shard_mode=explicit"])
  with pytest.raises(ConfigError, match="--arm y: bogus: unknown key"):
    build_arms(["model=llama2-tiny"], ["x:shard_mode=auto", "y:bogus=1"])
  with pytest.raises(ConfigError, match="expected NAME:key=value"):
    build_arms([], ["no-colon"])
  with pytest.raises(ConfigError, match="same cpu_devices"):
    build_arms([], ["a:cpu_devices=2", "b:cpu_devices=4"])


@pytest.mark.parametrize("args,message", [
    (["--reps", "0"], "--reps: must be at least 1"),
    (["--target-ci", "0"], "--target-ci: must be in (0, 1], got 0"),
    (["--target-ci", "1%"], "--target-ci: expected a number, got '1%'"),
    (["--target-ci", "0.01", "--max-seconds", "-5"], "--max-seconds: must be in (0, inf], got -5"),
    (["--max-seconds", "60"], "--max-seconds: only bounds --target-ci"),
    (["--timer", "gpu"], "--timer: expected wall or cpu, got 'gpu'"),
    (["--frobnicate"], "--frobnicate: unknown option"),
])
def test_bench_cli_input_errors(capsys, args, message):
  from meshlm.cli import main
  assert main(["bench", "model=llama2-tiny", "--arm", "a:shard_mode=auto", *args]) == 2
  assert message in capsys.readouterr().err


def test_bench_cli_too_few_reps_fails_before_compiling(capsys, monkeypatch):
  """Two arms and --reps 3 (a ratio's 95% interval needs 6): refused in one line, nothing run; one arm or
  --reps 6 passes the check (negative control: the same run is reached)."""
  from meshlm.bench import harness
  from meshlm.cli import main
  ran = []
  monkeypatch.setattr(harness, "run", lambda *a, **k: ran.append(a) or (_ for _ in ()).throw(SystemExit(7)))
  two = ["bench", "model=llama2-tiny", "--arm", "a:shard_mode=auto", "--arm", "b:shard_mode=explicit"]
  assert main([*two, "--reps", "3"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["meshlm: error: --reps 3: comparing 2 arms needs at least 6 rounds for a 95% interval on each "
                 "ratio; use --reps 6 or more, or --target-ci F"], err
  assert ran == []
  for args in ([*two, "--reps", "6"], [*two[:4], "--reps", "3"]):
    with pytest.raises(SystemExit):
      main(args)
  assert len(ran) == 2


def test_bench_cli_plot_folder_must_exist(capsys, tmp_path):
  from meshlm.cli import main
  missing = os.path.join(str(tmp_path), "nope", "x.png")
  assert main(["bench", "--arm", "a:shard_mode=auto", "--plot", missing]) == 2
  assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_end_to_end(capsys, tmp_path):
  """The real step, two arms, through the CLI: JSON shape and the plot (one layer of llama2-tiny's two: the
  harness times whatever step it is given)."""
  from meshlm.cli import main
  png = tmp_path / "b.png"
  rc = main(["bench", "model=llama2-tiny", "model.num_layers=1", "cpu_devices=4", "mesh.fsdp=4",
             "train.per_device_batch_size=1", "train.seq_len=16", "--arm", "auto:shard_mode=auto", "--arm", "explicit:shard_mode=explicit",
             "--reps", "6", "--warmup", "1", "--json", "--plot", str(png)])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert list(report["arms"]) == ["auto", "explicit"] and report["rounds"] == 6
  auto, explicit = report["arms"]["auto"], report["arms"]["explicit"]
  assert set(auto) == {"median_s", "spread", "reps"} and len(auto["reps"]) == 6 and auto["median_s"] > 0
  assert explicit["rounds"] == 6 and len(explicit["ratio_ci"]) == 2
  assert explicit["ratio_ci"][0] <= explicit["ratio"] <= explicit["ratio_ci"][1]
  assert report["ratios"]["auto"] == 1.0 and png.exists()
  assert report["states"] == [["auto", "explicit"]] and report["pairs"] == {"explicit": "shared"}


# --- one state for the arms of one layout (share), parking the others (park) -----------------------

class _Tracked(_Fake):
  """A fake runner that checks its state is on the device when it steps, and records how many states are."""

  def __init__(self, name, order, on_device: set, peak: list, layout=None):
    super().__init__(name, order, [], layout=layout, on_device=on_device)
    self.peak = peak

  def step(self, n=1):
    assert self.slot in self.slot.on_device, f"{self.name} stepped with its state parked"
    self.peak.append(len(self.slot.on_device))
    return super().step(n)


@pytest.mark.parametrize("share,park", [(True, True), (True, False), (False, True), (False, False)])
def test_arms_of_one_layout_step_one_state_and_the_others_park(share, park):
  order, on_device, peak = [], set(), []
  fakes = {n: _Tracked(n, order, on_device, peak, layout) for n, layout in (("A", "x"), ("B", "x"), ("C", "y"))}
  report = _run(fakes, reps=6, warmup=1, park=park, share=share)
  assert report["park"] is park and report["share"] is share and report["rounds"] == 6
  if share:  # A and B step one slot (B's own is never made); C has its own
    assert fakes["B"].slot is fakes["A"].slot is not fakes["C"].slot
    assert report["states"] == [["A", "B"], ["C"]]
    assert report["pairs"] == {"B": "shared", "C": "parked" if park else "separate"}
  else:  # the control: a state per arm
    assert report["states"] == [["A"], ["B"], ["C"]]
    assert report["pairs"] == {"B": "parked" if park else "separate", "C": "parked" if park else "separate"}
  # park: one state on the device at any step; without, every state stays there once made.
  assert max(peak) == (1 if park else len(report["states"]))
  text = render(report)
  assert report["pairs"]["C"] in text.splitlines()[3]
  assert ("2 states" if share else "3 states") in text and ("A + B" in text) is share


def test_a_step_that_fails_after_donating_leaves_a_fresh_state_for_the_arms_that_share_it():
  import jax.numpy as jnp
  made = []

  def call(state, batch):
    state.delete()  # what a donating executable that fails part-way leaves behind
    raise RuntimeError("RESOURCE_EXHAUSTED")

  slot = StateSlot(lambda: made.append(1) or jnp.zeros(()))
  slot.ready()
  with pytest.raises(RuntimeError):
    _Runner("x", call, slot, None).step()
  assert slot.state is None
  slot.ready()
  assert len(made) == 2 and float(slot.state) == 0.0


def test_default_park_counts_states_not_arms(monkeypatch):
  """On CPU nothing parks; arms that share one state never park (the count is of states)."""
  from meshlm.bench import harness
  order, on_device, peak = [], set(), []
  fakes = {n: _Tracked(n, order, on_device, peak, "x") for n in "AB"}
  assert _run(fakes, reps=6, warmup=0)["park"] is False
  assert harness.default_park(1) is False and harness.default_park(2) is False  # the host is the device


def _live_bytes() -> int:
  import jax
  return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


@pytest.fixture(scope="module")
def two_modes():
  """llama2-tiny's one-layer step compiled under explicit and under auto: one mesh, one state layout."""
  from meshlm import load_config
  from meshlm.bench.harness import compile_arm
  base = ("model=llama2-tiny", "model.num_layers=1", "train.seq_len=16", "train.per_device_batch_size=1",
          "mesh.fsdp=2", "mesh.data=-1")
  return {m: compile_arm(Arm(m, [], load_config(*base, f"shard_mode={m}")), init_state=False)
          for m in ("explicit", "auto")}


@pytest.mark.parametrize("share", [True, False])
def test_two_arms_of_one_layout_hold_one_state(two_modes, share):
  """The real runners: explicit and auto step one state (counted in live buffers at every visit's start and end:
  one state's bytes more than before the run, not two), and every step of both arms advanced it. The control
  (share off, today's path) holds two."""
  import numpy as np
  from meshlm.bench.harness import StateLayout, new_runner
  explicit, auto = two_modes["explicit"], two_modes["auto"]
  layout = StateLayout.of(explicit.compiled)
  assert layout == StateLayout.of(auto.compiled)  # the meshes' axis types differ, the buffers do not
  state_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype, _ in layout.inputs)
  before, samples, runners = _live_bytes(), [], []

  def timer():
    samples.append(_live_bytes() - before)
    return time.perf_counter()

  def prepare(arm):
    runners.append(new_runner(arm.name, two_modes[arm.name], timer))
    return runners[-1]

  report = run(_arms("explicit", "auto"), reps=2, warmup=1, prepare=prepare, log=lambda m: None, share=share,
               park=False)
  assert report["arms"]["auto"]["rounds"] == 2 and report["pairs"]["auto"] == ("shared" if share else "separate")
  visits = 1 + 2 * 2  # per arm: the warm-up, then two visits a round
  assert report["state_copies"] == 0  # handing the state over relabels its buffers, never copies them
  if share:
    assert runners[0].slot is runners[1].slot and int(runners[0].state.step) == 2 * visits
    assert max(samples) < 1.5 * state_bytes
  else:
    assert [int(r.state.step) for r in runners] == [visits, visits]
    assert 2 * state_bytes <= max(samples) < 2.5 * state_bytes


def test_state_layouts_compare_placement_dtype_and_tree():
  """StateLayout on tiny programs: auto and explicit meshes with one spec are one layout; another spec, another dtype
  or another tree is not."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from meshlm.bench.harness import StateLayout

  def layout(axis_type, spec, dtype=jnp.float32, tree=lambda x: {"w": x}):
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(axis_type,), devices=jax.devices()[:2])
    sh = NamedSharding(mesh, spec)
    state = tree(jax.ShapeDtypeStruct((4, 2), dtype, sharding=sh))
    f = jax.jit(lambda s, b: (jax.tree.map(lambda x: x + 1, s), b), donate_argnums=(0,), out_shardings=(sh, None))
    with jax.set_mesh(mesh):
      return StateLayout.of(f.lower(state, jnp.zeros(())).compile())

  base = layout(AxisType.Explicit, P("fsdp"))
  assert base == layout(AxisType.Auto, P("fsdp"))
  assert base != layout(AxisType.Explicit, P(None, "fsdp"))
  assert base != layout(AxisType.Explicit, P("fsdp"), jnp.bfloat16)
  assert base != layout(AxisType.Explicit, P("fsdp"), tree=lambda x: [x])


def test_parked_state_comes_back_the_same(two_modes):
  # The real runner: park moves the state to numpy, ready puts it back onto its shardings; the steps after are
  # unchanged.
  import jax
  import numpy as np
  from meshlm.bench.harness import new_runner
  plain, parked = (new_runner("x", two_modes["explicit"]) for _ in range(2))
  for r in (plain, parked):
    r.slot.ready()
  plain.step(2)
  parked.step(1)
  shardings = jax.tree.map(lambda a: a.sharding, parked.state)
  parked.slot.park()
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(parked.state))
  parked.slot.ready()
  assert jax.tree.map(lambda a: a.sharding, parked.state) == shardings
  parked.step(1)
  for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(parked.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_chip_driver_runs_valid_configs_under_timeout(tmp_path):
  """benchmarks/bench_chip.py's runs (what the lead runs on the chip): each a `meshlm bench` of chip.py's model with
  the explicit and auto arms, whose configs validate here, under `timeout` within the budget."""
  import subprocess
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parent.parent
  sys.path.insert(0, str(root / "benchmarks"))
  import bench_chip
  for run in bench_chip.SETS["v5e"]:
    cmd = bench_chip.command(run, "python3")
    assert cmd[:4] == ["python3", "-m", "meshlm.cli", "bench"] and cmd[-1] == "--json"
    arms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--arm"]
    assert arms == ["explicit:shard_mode=explicit", "auto:shard_mode=auto"]
    build_arms(list(run.overrides), arms)  # every key valid, before any chip time is spent
  out = subprocess.run([sys.executable, str(root / "benchmarks/bench_chip.py"), str(tmp_path / "out"), "--dry-run",
                        "--budget", "200"], capture_output=True, text=True, check=True)
  caps = [line.split()[3] for line in out.stderr.splitlines()]
  assert [line.split()[:3] for line in out.stderr.splitlines()] == [["timeout", "-k", "10"]] * 3
  assert caps == ["120", "120", "200"]  # the last one's cap is what is left of the budget (nothing ran)
  assert not (tmp_path / "out").exists()
