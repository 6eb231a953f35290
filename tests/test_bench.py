"""The bench harness: statistics, verdict, interleaving, failure isolation, CLI input checks."""
import json
import os

import pytest

from meshlm.analysis.arms import Arm, build_arms
from meshlm.bench.harness import plot, render, run
from meshlm.bench.stats import arm_stats, ratios, verdict
from meshlm.config import ConfigError


def test_arm_stats_median_and_spread():
  s = arm_stats([0.30, 0.10, 0.20, 0.25, 0.15])
  assert s["median_s"] == 0.20
  assert s["spread"] == pytest.approx((0.30 - 0.10) / 0.20)
  assert s["reps"] == [0.30, 0.10, 0.20, 0.25, 0.15]


def test_verdict_is_inside_noise_unless_the_difference_exceeds_the_larger_spread():
  arms = {"a": arm_stats([1.00, 1.02, 0.98]), "b": arm_stats([0.97, 0.975, 0.965]),
          "c": arm_stats([0.80, 0.81, 0.79]), "d": arm_stats([1.30, 1.31, 1.29])}
  r = ratios(arms)
  assert r["a"] == 1.0 and r["c"] == pytest.approx(0.80)
  v = verdict(arms)
  assert set(v) == {"b", "c", "d"}
  assert v["b"]["verdict"] == "inside noise"  # -3% against a 4% spread on a
  assert v["b"]["noise"] == pytest.approx(0.04)
  assert v["c"]["verdict"] == "faster" and v["c"]["difference"] == pytest.approx(-0.20)
  assert v["d"]["verdict"] == "slower"


class _Fake:
  def __init__(self, name, order, times, fail_at=None):
    self.name, self.order, self.times, self.fail_at, self.calls = name, order, list(times), fail_at, 0

  def step(self, n=1):
    self.calls += 1
    if self.fail_at is not None and self.calls > self.fail_at:
      raise RuntimeError(f"{self.name} ran out of memory\nsecond line")
    self.order.append(self.name)
    return self.times.pop(0) if self.times else 1.0


def _arms(*names):
  return [Arm(n, [], None) for n in names]


def test_run_interleaves_after_warmup_and_reports_json_shape():
  order = []
  fakes = {"A": _Fake("A", order, [9, 9, 1.0, 2.0, 3.0]), "B": _Fake("B", order, [9, 9, 2.0, 2.0, 2.0])}
  report = run(_arms("A", "B"), reps=3, warmup=2, prepare=lambda arm: fakes[arm.name], log=lambda m: None)
  # Warm-up runs per arm at compile time, then the timed reps alternate A B A B A B.
  assert order == ["A", "A", "B", "B", "A", "B", "A", "B", "A", "B"]
  assert set(report) == {"arms", "ratios", "verdict"}
  assert report["arms"]["A"] == {"median_s": 2.0, "spread": 1.0, "reps": [1.0, 2.0, 3.0]}
  assert report["ratios"] == {"A": 1.0, "B": 1.0}
  assert report["verdict"]["B"]["verdict"] == "inside noise"
  json.dumps(report)  # serializable as is


def test_a_failing_arm_is_reported_and_hides_nothing():
  order = []

  def prepare(arm):
    if arm.name == "oom":
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while lowering\ndetails")
    return {"A": _Fake("A", order, [1.0] * 9), "late": _Fake("late", order, [1.0] * 9, fail_at=3)}[arm.name]

  report = run(_arms("A", "oom", "late"), reps=4, warmup=1, prepare=prepare, log=lambda m: None)
  assert report["arms"]["oom"]["error"] == "RuntimeError: RESOURCE_EXHAUSTED: out of memory while lowering"
  assert report["arms"]["late"]["error"] == "RuntimeError: late ran out of memory"
  assert report["arms"]["A"]["reps"] == [1.0] * 4
  assert report["verdict"]["oom"]["verdict"] == "failed"
  assert "failed" in render(report)


def test_plot_writes_a_png(tmp_path):
  report = {"arms": {"a": arm_stats([0.1, 0.2]), "b": {"median_s": None, "spread": None, "reps": [], "error": "x"}},
            "ratios": {}, "verdict": {}}
  path = tmp_path / "bench.png"
  plot(report, str(path))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arms_fail_before_compiling():
  with pytest.raises(ConfigError, match="--arm x: duplicate arm name"):
    build_arms(["model=llama2-tiny"], ["x:shard_mode=auto", "x:shard_mode=explicit"])
  with pytest.raises(ConfigError, match="--arm y: bogus: unknown key"):
    build_arms(["model=llama2-tiny"], ["x:shard_mode=auto", "y:bogus=1"])
  with pytest.raises(ConfigError, match="expected NAME:key=value"):
    build_arms([], ["no-colon"])
  with pytest.raises(ConfigError, match="same cpu_devices"):
    build_arms([], ["a:cpu_devices=2", "b:cpu_devices=4"])


def test_bench_cli_input_errors(capsys, tmp_path):
  from meshlm.cli import main
  assert main(["bench", "model=llama2-tiny", "--arm", "a:shard_mode=auto", "--reps", "0"]) == 2
  assert "--reps: must be at least 1" in capsys.readouterr().err
  missing = os.path.join(str(tmp_path), "nope", "x.png")
  assert main(["bench", "--arm", "a:shard_mode=auto", "--plot", missing]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert main(["bench", "--arm", "a:shard_mode=auto", "--frobnicate"]) == 2
  assert "--frobnicate: unknown option" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_end_to_end(capsys, tmp_path):
  """The real step, two arms, through the CLI: JSON shape and the plot."""
  from meshlm.cli import main
  png = tmp_path / "b.png"
  rc = main(["bench", "model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1",
             "train.seq_len=16", "--arm", "auto:shard_mode=auto", "--arm", "explicit:shard_mode=explicit",
             "--reps", "2", "--warmup", "1", "--json", "--plot", str(png)])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert list(report["arms"]) == ["auto", "explicit"]
  for a in report["arms"].values():
    assert set(a) == {"median_s", "spread", "reps"} and len(a["reps"]) == 2 and a["median_s"] > 0
  assert report["ratios"]["auto"] == 1.0 and png.exists()
