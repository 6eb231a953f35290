"""The reward curve of a `meshlm rl` run, from its metrics.jsonl, as a PNG, plus a summary line.

    python benchmarks/rl_curve.py RUN_DIR --png docs/rl-reward-curve.png [--warm-start-eval X]

Plots each step's mean rollout reward (sampled, temperature rl.temperature) with a 10-step running mean,
and the greedy evaluation reward (rl.eval_every) where the run logged it. Prints the warm-start's greedy
reward (step 0's evaluation), the last one, the sampling tokens/s and the share of each step spent
sampling (median over the steps after the first, which compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics


def load(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(ln) for ln in f if ln.strip()]


def evaluations(records: list[dict], final_eval: float | None = None) -> list[tuple[int, float]]:
  """(updates done, greedy eval reward): a record's `step` counts its update (from 1) and its eval_reward was
  measured before it, after step - 1 updates; the final evaluation comes after the last record's update."""
  evals = [(r["step"] - 1, r["eval_reward"]) for r in records if "eval_reward" in r]
  if final_eval is not None:
    evals.append((records[-1]["step"], final_eval))
  return evals


def summary(records: list[dict], final_eval: float | None = None) -> dict:
  evals = evaluations(records, final_eval)
  later = records[1:] or records
  return {"steps": len(records), "evals": evals,
          "reward_first10": statistics.mean(r["reward_mean"] for r in records[:10]),
          "reward_last10": statistics.mean(r["reward_mean"] for r in records[-10:]),
          "sample_tokens_per_s_median": statistics.median(r["sample_tokens_per_s"] for r in later),
          "sample_share_median": statistics.median(r["sample_share"] for r in later),
          "sample_time_s_median": statistics.median(r["sample_time_s"] for r in later),
          "train_time_s_median": statistics.median(r["train_time_s"] for r in later)}


def plot(records: list[dict], png: str, title: str, final_eval: float | None = None) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [r["step"] for r in records]
  rew = [r["reward_mean"] for r in records]
  run = [statistics.mean(rew[max(0, i - 9):i + 1]) for i in range(len(rew))]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, rew, color="0.75", lw=1, label="rollout reward (mean of the step's samples)")
  ax.plot(steps, run, color="C0", lw=2, label="10-step running mean")
  ev = evaluations(records, final_eval)
  if ev:
    ax.plot([s for s, _ in ev], [v for _, v in ev], "o-", color="C3", label="greedy eval reward")
  ax.set_xlabel("RL step")
  ax.set_ylabel("reward")
  ax.set_ylim(0, 1)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
  fig.savefig(png, dpi=110)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("run_dir")
  ap.add_argument("--png", default=None)
  ap.add_argument("--title", default="GRPO on the toy reversal task")
  ap.add_argument("--final-eval", type=float, default=None, help="the greedy eval after the last step")
  a = ap.parse_args()
  records = load(a.run_dir)
  ev_path = os.path.join(a.run_dir, "eval.json")
  if a.final_eval is None and os.path.exists(ev_path):
    ev = json.load(open(ev_path))
    last = max(int(k) for k in ev)
    a.final_eval = ev[str(last)] if last >= records[-1]["step"] else None  # eval.json's keys count updates
  s = summary(records, a.final_eval)
  print(json.dumps(s, indent=1))
  if a.png:
    plot(records, a.png, a.title, a.final_eval)
    print(a.png)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
