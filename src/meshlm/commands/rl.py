"""`meshlm rl [key=value ...]`: GRPO on rl.prompts (rl/trainer.py); the same command with the same run_dir
resumes from its latest checkpoint. model=RUN_DIR starts from a `meshlm train` run's parameters."""
from __future__ import annotations

import signal
import sys

USAGE = "meshlm rl model=RUN_OR_PRESET rl.prompts=PROMPTS.jsonl [key=value ...]"


def main(args: list[str], start: float) -> int:
  from meshlm.commands.resolve import load_config
  from meshlm.parallel import set_cpu_devices
  cfg = load_config(*args)
  set_cpu_devices(cfg.cpu_devices)
  from meshlm.parallel.distributed import init_distributed
  init_distributed(cfg)
  from meshlm.parallel.mesh import make_mesh
  make_mesh(cfg)
  from meshlm.console import make_console, report_stop
  from meshlm.rl.step import check_rl
  from meshlm.rl.trainer import run
  from meshlm.train.loop import param_counts
  from meshlm.rl.rewards import Rewards
  from meshlm.rl.rollout import eval_prompts, load_prompts
  from meshlm.train.data.tokenizers import make_tokenizer
  # Before the banner: the model, the rewards and the prompts are refused in one line each.
  check_rl(cfg)
  Rewards.from_config(cfg.rl)
  tokenizer = make_tokenizer(cfg)
  prompts = load_prompts(cfg, tokenizer)
  if cfg.rl.eval_every:
    eval_prompts(cfg, tokenizer, prompts)
  trainable, frozen = param_counts(cfg)
  console = make_console()
  rl = cfg.rl
  console.print(f"[bold]meshlm rl[/] {cfg.model_name}  prompts={rl.prompts}  G={rl.num_generations}  "
                f"reward={','.join(rl.reward)}  router_replay={rl.router_replay}  compute={cfg.train.compute_dtype}  "
                f"trainable={trainable:,}  "
                f"frozen={frozen:,}")
  try:
    result = run(cfg, console=console, start_time=start)
  except KeyboardInterrupt:
    print("\nmeshlm: SIGINT before the first step; nothing was saved", file=sys.stderr)
    return 128 + signal.SIGINT
  code = report_stop(console, result, cfg.train.steps, result.run_dir)
  if code is not None:
    return code
  if not result.rewards:
    console.print(f"nothing to do: {result.run_dir} is already at step {result.start_step} of {cfg.train.steps}")
    return 0
  r = result.rewards
  head, tail = sum(r[:5]) / len(r[:5]), sum(r[-5:]) / len(r[-5:])
  console.print(f"mean reward {head:.3f} (first {len(r[:5])} steps) -> {tail:.3f} (last {len(r[-5:])}) in {len(r)} "
                f"steps; run_dir={result.run_dir}")
  if result.evals:
    first, last = min(result.evals), max(result.evals)
    console.print(f"greedy eval reward {result.evals[first]:.3f} (step {first}) -> {result.evals[last]:.3f} "
                  f"(step {last})")
  return 0
