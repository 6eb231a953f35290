"""`meshlm rl`: rollouts -> rewards -> GRPO updates, through the training loop's core (train/loop.py).

Each RL step samples rl.prompts_per_step x rl.num_generations completions with the current parameters
(the sampler and the trainer share them: one process, one mesh, no copy), scores them, and makes
rl.num_iterations updates on that batch. The loop core brings checkpoints, exact resume, SIGTERM saves,
metrics.jsonl/TensorBoard and the progress bar; the RL trainer brings `fetch` (a rollout from the latest
state) and `position` (the prompt iterator's state). Batches depend on the latest parameters, so the
loop runs without queueing a step ahead.

Sampling randomness is a function of (train.seed, step, row), and the prompt order of (data.seed, epoch),
so a resumed run draws what the straight run drew.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings

import jax
import numpy as np

from meshlm.config import Config
from meshlm.console import printable
from meshlm.errors import ConfigError
from meshlm.fsutil import write_text
from meshlm.models.params import merge_state
from meshlm.parallel.mesh import make_mesh
from meshlm.rl import loss as L
from meshlm.rl import rollout as R
from meshlm.rl.rewards import RewardFailed, Rewards, TrainerState
from meshlm.rl.step import build_rl_step, check_rl, flip_metrics, scorer
from meshlm.train import loop as LP
from meshlm.train.metrics import MetricsWriter


class RewardWarning(UserWarning):
  """A reward raised or returned NaN on some of a step's completions."""


class ClipWindowWarning(UserWarning):
  """The first iteration's ratio is outside the clip window before any update (the train/sample gap)."""


class EmptyStepWarning(UserWarning):
  """No completion token of a step's rollout is in the loss: the step trains on nothing."""


# The CLI prints meshlm's own warnings as one line.
RewardWarning.__module__ = ClipWindowWarning.__module__ = EmptyStepWarning.__module__ = "meshlm.rl"

# The train step's shapes that rl_config derives from the RL keys: a resume compares those keys, not these.
DERIVED = ("train.seq_len", "train.per_device_batch_size", "train.sample_tokens")
COMPLETIONS = "completions.jsonl"  # run_dir's record of the evaluations' prompts, completions and rewards
SHOW = 2  # evaluation completions printed to the console, each eval
LOGGED = "_logged"  # a rollout's host metrics: what the rewards logged (log_metric), merged into the step's record
# The keys train/loop.py's Loop._report writes into every record besides the step's metrics: a reward's log_metric
# may name none of them (nor any metric of the step).
RECORD_KEYS = ("step", "loss", "grad_norm", "step_time_s", "tokens_per_s", "nonfinite", "time_to_first_step_s",
               "nonfinite_in_a_row", "nonfinite_total")


@dataclasses.dataclass
class RLResult:
  rewards: list[float]  # mean reward of each step's rollouts, this invocation
  losses: list[float]
  evals: dict[int, float]  # step -> greedy mean reward (rl.eval_every)
  state: object
  start_step: int
  stop_reason: str
  checkpoint: str | None
  signal: int | None
  run_dir: str
  records: list[dict]  # every step's metrics


def rl_config(cfg: Config, prompts: list[R.Prompt], devices: int) -> Config:
  """cfg with the train step's shapes set from the RL keys: train.seq_len (row_len) and the per-device
  batch (prompts x G rows over the devices)."""
  rl = cfg.rl
  rows = rl.prompts_per_step * rl.num_generations
  if rows % devices:
    raise ConfigError(f"rl.prompts_per_step={rl.prompts_per_step} x rl.num_generations={rl.num_generations} = {rows} "
                      f"rows do not split over {devices} devices; make the product a multiple of {devices}")
  # Rows past model.max_position are cut there, down to a length the step takes (the schema has already refused a
  # max_position below one such length: no train.seq_len could be valid).
  T = min(R.row_len(cfg, prompts), cfg.model.max_position)
  T -= T % R.row_multiple(cfg)
  train = cfg.train.model_copy(update={"seq_len": T, "per_device_batch_size": rows // devices, "sample_tokens": 0})
  return cfg.model_copy(update={"train": train})


def stop_tokens(cfg: Config, tokenizer) -> list[int]:
  from meshlm.models.generate import stop_ids
  ids = stop_ids(cfg, None)
  return ids or [int(tokenizer.eos_id)]


def step_seeds(seed: int, step: int, rows: int, stream: int = 0x5EED) -> list[int]:
  return [int(s) for s in np.random.default_rng([seed, stream, step]).integers(0, 2**31 - 1, rows)]


EVAL_STREAM = 0xE7A1  # the sampled evaluation's seeds: their own stream, so the rollouts draw as without it


def _nanmean(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.mean(x[~np.isnan(x)])) if np.any(~np.isnan(x)) else float("nan")


def _nanstd(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.std(x[~np.isnan(x)])) if np.any(~np.isnan(x)) else float("nan")


def _json_value(v: float):
  return None if isinstance(v, float) and not np.isfinite(v) else v


class Trainer:
  """One RL run's pieces: the step, the rollouts, the rewards and the prompt order."""

  def __init__(self, cfg: Config, mesh=None):
    from meshlm.train.data.tokenizers import make_tokenizer
    check_rl(cfg)
    self.tokenizer = make_tokenizer(cfg)
    self.rewards = Rewards.from_config(cfg.rl)  # an unknown or unimportable reward fails before loading prompts
    self.prompts = R.load_prompts(cfg, self.tokenizer)
    self.eval_set = R.eval_prompts(cfg, self.tokenizer, self.prompts) if cfg.rl.eval_every else []
    self.mesh = make_mesh(cfg) if mesh is None else mesh
    self.cfg = cfg = rl_config(cfg, self.prompts, self.mesh.size)
    self.step = build_rl_step(cfg, self.mesh)
    self.stops = stop_tokens(cfg, self.tokenizer)
    self.iterator = R.PromptIterator(len(self.prompts), cfg.rl.prompts_per_step, cfg.data.seed)
    self.score = scorer(cfg, self.step) if cfg.rl.sampler_is != "none" or cfg.rl.beta > 0 else None
    self.ref = None
    self.host_metrics: dict[int, dict] = {}
    self.say = lambda *a, **k: None  # the console (process 0), set by run()
    self.window_warned = False
    self.last = None  # the last rollout's host side: prompts, texts, rewards (Scored), truncated [B]

  def params_of(self, state):
    return merge_state(state.params, state.model_state)

  def _texts(self, gen) -> list[str]:
    return [self.tokenizer.decode([t for t in toks if t not in self.stops]) for toks in gen.token_lists()]

  def trainer_state(self, step: int) -> TrainerState:
    """TRL's trainer_state at RL step `step` (before its updates): the updates done and the prompts drawn so far."""
    cfg, rl = self.cfg, self.cfg.rl
    n = max(len(self.prompts), 1)
    return TrainerState(global_step=step * rl.num_iterations, max_steps=cfg.train.steps * rl.num_iterations,
                        epoch=step * rl.prompts_per_step / n,
                        num_train_epochs=-(-cfg.train.steps * rl.prompts_per_step // n),
                        is_world_process_zero=jax.process_index() == 0, is_local_process_zero=True)

  def _score(self, prompts: list[R.Prompt], gen, texts: list[str], step: int = 0):
    rows_in = [dict(p.row, _completion_tokens=int(n)) for p, n in zip(prompts, gen.lengths)]
    chat = prompts[0].messages is not None  # one form per file (load_prompts)
    return self.rewards([p.text for p in prompts], texts, rows_in, gen.token_lists(),
                        [p.messages for p in prompts] if chat else None, state=self.trainer_state(step))

  def rollout(self, state, i: int) -> dict:
    """The device batch of step i, from the current parameters; its host metrics into host_metrics[i]."""
    cfg, rl = self.cfg, self.cfg.rl
    idx = self.iterator.next()
    prompts = [self.prompts[j] for j in idx]
    rows = len(idx) * rl.num_generations
    params = self.params_of(state)
    t0 = time.perf_counter()
    gen = R.sample(cfg, params, [p.ids for p in prompts], step_seeds(cfg.train.seed, i, rows), self.mesh, self.stops)
    t_sample = time.perf_counter() - t0
    texts = self._texts(gen)
    group = [p for p in prompts for _ in range(rl.num_generations)]
    scored = self._score(group, gen, texts, i)  # a reward failing on every completion stops the run here
    total = np.asarray(scored.total, np.float64)  # the metrics' (NaN: excluded); the advantages take float32
    cut = R.truncated(gen, self.stops)
    self.last = {"prompts": group, "texts": texts, "scored": scored, "truncated": cut}
    batch = R.to_batch(cfg, [p.ids for p in prompts], gen, cfg.train.seq_len, self.stops)
    if not np.any(batch["loss_mask"]):
      why = (f"all {rows} completions were cut at rl.max_new_tokens={rl.max_new_tokens} and "
             "rl.mask_truncated_completions=true masks them" if rl.mask_truncated_completions and np.all(cut) else
             f"no completion has a token (lengths {sorted(set(int(n) for n in gen.lengths))})")
      warnings.warn(f"step {i}: {why}, so this step trains on nothing (loss 0, grad_norm 0, the ratio and gap "
                    "statistics null)", EmptyStepWarning)
    adv = L.advantages if np.all(np.isfinite(total)) else L.advantages_excluding_nan  # NaN: rl.failed_reward=exclude
    batch["advantages"] = np.asarray(adv(total.astype(np.float32), rl.num_generations, rl.scale_rewards), np.float32)
    if rl.log_completions:
      self.log_rollout(i, group, texts, scored, cut, batch["advantages"])
    dev = self.step.put_batch(batch)
    if self.score is not None:
      with jax.set_mesh(self.mesh):
        if rl.sampler_is != "none":
          dev["old_logp"] = self.score(params, dev)
        if rl.beta > 0:
          dev["ref_logp"] = self.score(self.ref, dev)
    n_new = int(np.sum(gen.lengths))
    grouped = np.reshape(total, (-1, rl.num_generations))
    m = {"reward_mean": _nanmean(total), "reward_std": _nanstd(total),
         "completion_len": float(np.mean(gen.lengths)), "truncated_frac": float(np.mean(cut)),
         "sample_time_s": t_sample, "sample_tokens_per_s": n_new / t_sample,
         "groups_degenerate": float(np.mean([np.ptp(g[~np.isnan(g)]) == 0 if np.any(~np.isnan(g)) else True
                                             for g in grouped]))}
    if self.rewards.failed == "exclude":
      m["rewards_excluded"] = float(np.sum(np.isnan(total)))
    if len(self.rewards.names) > 1:
      for n, v in scored.each.items():
        m[f"reward/{n}_mean"] = _nanmean(v)
        m[f"reward/{n}_std"] = _nanstd(v)
    m["reward_errors"] = float(sum(self.rewards.errors.values()))
    m["reward_nan"] = float(sum(self.rewards.nans.values()))
    m["reward_none"] = float(sum(self.rewards.nones.values()))
    bad = {n: f for n, f in scored.failures.items() if f.total}
    if bad:
      scored_as = "scored 0" if self.rewards.failed == "zero" else "left out (rl.failed_reward=exclude)"
      parts = [f"{n}: {f.raised} raised, {f.nan + f.other} returned nan or no number of {rows}, first {f.first}"
               if f.raised and f.nan + f.other else
               f"{n}: {f.raised} of {rows} raised, first {f.first}" if f.raised else
               f"{n}: {f.nan + f.other} of {rows} {f.first}" for n, f in bad.items()]
      warnings.warn(f"step {i}: {'; '.join(parts)}; {scored_as}", RewardWarning)
    m[LOGGED] = dict(scored.metrics)
    if rl.eval_every and i % rl.eval_every == 0:
      evaluated = self.evaluate(state, i)
      m[LOGGED].update(evaluated.pop(LOGGED))
      m.update(evaluated)
    self.host_metrics[i] = m
    return dev

  def evaluate(self, state, step: int) -> dict[str, float]:
    """The eval set's mean reward greedy (eval_reward) and sampled once per prompt with the rollouts' temperature,
    top-k and top-p (eval_reward_sampled); every completion into run_dir/completions.jsonl, the first SHOW to the
    console. No training, and its seeds are a stream of their own. What the rewards log (log_metric) comes back
    under LOGGED as eval_<name> and eval_<name>_sampled."""
    from meshlm.models.generate import generate
    cfg, rl = self.cfg, self.cfg.rl
    ps, params = self.eval_set, self.params_of(state)
    out, lines, logged = {}, [], {}
    for mode, kw in (("greedy", dict(temperature=0.0)),
                     ("sampled", dict(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                      seed=step_seeds(cfg.train.seed, step, len(ps), EVAL_STREAM)))):
      gen = generate(R.sampler_config(cfg), params, [p.ids for p in ps], max_new_tokens=rl.max_new_tokens,
                     stop_tokens=self.stops, mesh=self.mesh, **kw)
      texts = self._texts(gen)
      sc = self._score(ps, gen, texts, step)
      out["eval_reward" if mode == "greedy" else "eval_reward_sampled"] = _nanmean(sc.total)
      logged.update({f"eval_{k}" + ("_sampled" if mode == "sampled" else ""): v for k, v in sc.metrics.items()})
      for j, (p, t) in enumerate(zip(ps, texts)):
        lines.append({"step": step, "mode": mode, "prompt": p.text, "completion": t,
                      "reward": _json_value(float(sc.total[j])),
                      "rewards": {n: _json_value(float(v[j])) for n, v in sc.each.items()},
                      "truncated": bool(R.truncated(gen, self.stops)[j]), **_extra(sc, j)})
    self._append_completions(lines)
    for r in lines[:SHOW]:
      reward = "nan" if r["reward"] is None else f"{r['reward']:.3f}"
      self.say(f"eval step {step} ({r['mode']}): {printable(r['prompt'])!r} -> {printable(r['completion'])!r}  "
               f"reward {reward}", markup=False, highlight=False)
    return {**out, LOGGED: logged}

  def _append_completions(self, lines: list[dict]) -> None:
    if jax.process_index() == 0 and self.cfg.run_dir:
      with open(os.path.join(self.cfg.run_dir, COMPLETIONS), "a", encoding="utf-8") as f:
        # default=str: a log_extra value JSON has no form for (a parsed expression) is written as its str
        f.writelines(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in lines)

  def log_rollout(self, step: int, prompts: list[R.Prompt], texts: list[str], scored, cut, adv) -> None:
    """The first rl.log_completions rows of step's rollout into run_dir/completions.jsonl (mode "rollout": TRL's
    log_completions), with each row's rewards (null: none), advantage, whether it was truncated, and the columns the
    rewards logged for it (log_extra: "extra")."""
    n = min(self.cfg.rl.log_completions, len(texts))
    self._append_completions([
        {"step": step, "mode": "rollout", "prompt": prompts[j].text, "completion": texts[j],
         "reward": _json_value(float(scored.total[j])),
         "rewards": {k: _json_value(float(v[j])) for k, v in scored.each.items()}, "advantage": float(adv[j]),
         "truncated": bool(cut[j]), **_extra(scored, j)} for j in range(n)])

  def updates(self, state, batch, step: int | None = None):
    """rl.num_iterations updates on one batch: the ratio and gap statistics of the first (before any
    update of this batch), the loss of the last."""
    t0 = time.perf_counter()
    first = None
    for _ in range(self.cfg.rl.num_iterations):
      state, m = self.step(state, batch)
      first = m if first is None else first
    m = dict(m)  # the last iteration's loss and grad norm; the first's view of the rollout
    keep = ("ratio", "logp_gap", "sampler_is") + flip_metrics(self.cfg)
    m.update({k: v for k, v in first.items() if k.startswith(keep)})
    jax.block_until_ready(m)
    self.check_window(m, step)
    return state, m, time.perf_counter() - t0

  def check_window(self, m: dict, step: int | None) -> None:
    """Warns once per run when most of the first iteration's ratios are already outside the clip window: before
    any update the ratio is the train/sample gap alone (old = the sampler's log-probs), and a window narrower than
    that gap (GSPO's 3e-4 / 4e-4 under bfloat16) clips nearly every token from the first step on."""
    rl = self.cfg.rl
    if self.window_warned or rl.policy_loss != "clip" or rl.sampler_is != "none":
      return
    out = float(m["ratio_outside_window"])
    if out > WINDOW_WARN:
      hi = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
      self.window_warned = True
      warnings.warn(
          f"step {step}: before any update, {out:.0%} of the completion tokens' ratios (the train/sample gap: "
          f"logp_gap_mean {float(m['logp_gap_mean']):.2g}, ratio in [{float(m['ratio_min']):.6g}, "
          f"{float(m['ratio_max']):.6g}]) are outside the clip window [1 - {rl.epsilon:g}, 1 + {hi:g}], so the "
          "clipped tokens get no gradient (clip_frac near 1, grad_norm near 0); widen rl.epsilon/rl.epsilon_high, "
          "compute in float32 (train.compute_dtype=float32), or set rl.sampler_is (the ratio then starts at 1 and "
          "the gap goes into the importance weight)", ClipWindowWarning)


WINDOW_WARN = 0.5  # the share of first-iteration ratios outside the window that ClipWindowWarning speaks up at


def _extra(scored, j: int) -> dict:
  """Completion j's log_extra columns, as a completions.jsonl row's "extra" (none: no key)."""
  return {"extra": {k: v[j] for k, v in scored.extra.items()}} if scored.extra else {}


def with_logged(record: dict, logged: dict[str, float], step: int) -> dict:
  """A step's record with what its rewards logged (log_metric) under their own names, as TRL logs them; a name the
  record has (meshlm's own metric) or the loop writes (RECORD_KEYS) stops the run, naming it."""
  clash = sorted(k for k in logged if k in record or k in RECORD_KEYS)
  if clash:
    raise RewardFailed(f"step {step}: a reward's log_metric named {clash[0]!r}, a metric meshlm logs itself; give it "
                       "another name")
  return {**record, **logged}


def run(cfg: Config, *, console=None, show_progress: bool = True, start_time: float | None = None,
        on_step=None) -> RLResult:
  """Runs cfg's RL to train.steps (resuming from run_dir's latest checkpoint); see the module docstring."""
  from meshlm.console import make_console
  from meshlm.train.checkpoint import Checkpointer
  from meshlm.train.run_dir import leave_as_found
  t_start = time.perf_counter() if start_time is None else start_time
  console = console or make_console()
  say = console.print if jax.process_index() == 0 else (lambda *a, **k: None)
  with leave_as_found(cfg) as cfg:
    LP.prepare_run_dir(cfg)
    tr = Trainer(cfg)
    tr.say = say
    cfg = tr.cfg
    ckpt = Checkpointer(cfg, warn=lambda m: console.print(f"[yellow]warning:[/] {m}"))
    try:
      return _run(tr, ckpt, console, say, show_progress, t_start, on_step)
    finally:
      ckpt.close()


def _run(tr: Trainer, ckpt, console, say, show_progress, t_start, on_step) -> RLResult:
  cfg = tr.cfg
  step = tr.step
  state, start, rng, counters, data_state = LP.restore_or_init(cfg, step, ckpt, say, ignore=DERIVED)
  if data_state is not None:
    tr.iterator.set_state(data_state["prompts"])
    tr.rewards.errors.update(data_state.get("reward_errors", {}))
    tr.rewards.nans.update(data_state.get("reward_nan", {}))
    tr.rewards.nones.update(data_state.get("reward_none", {}))
  if cfg.rl.beta > 0:
    # The reference is the starting policy: the loaded (or initial) parameters, also on resume.
    ref_state = step.init_state(jax.random.key(cfg.train.seed)) if start else state
    if start and cfg.checkpoint.load_params_from:
      from meshlm.train.checkpoint import load_params
      ref_state = ref_state._replace(params=load_params(cfg, cfg.checkpoint.load_params_from, step.abstract_state().params,
                                                        step.state_shardings().params, step.mesh))
    tr.ref = jax.tree.map(lambda a: a.copy(), tr.params_of(ref_state))
  os.makedirs(cfg.run_dir, exist_ok=True)
  LP._trim_metrics(cfg.run_dir, start)
  if start < cfg.train.steps:  # the evaluations of steps run again are written again (a run at its end keeps its last)
    LP._trim_metrics(cfg.run_dir, start, COMPLETIONS, counts_from=0)
  # The first rollout comes before the run's records (config.yaml, metrics.jsonl, tensorboard/): a reward that fails
  # on every completion stops the run here, and leave_as_found removes the directories it made, as before any step.
  pending = {start: tr.rollout(state, start)} if start < cfg.train.steps else {}
  if start < cfg.train.steps:
    LP.write_config(cfg)
  records: list[dict] = []
  writer = MetricsWriter(cfg.run_dir) if jax.process_index() == 0 else LP._NullWriter()

  class Recorder:
    def write(self, record):
      # JSON has no NaN or Infinity: a value a step leaves undefined (the ratio_min of no token, the mean reward
      # of none scored) is null.
      record = {k: _json_value(v) for k, v in record.items()}
      records.append(record)
      writer.write(record)

    def close(self):
      writer.close()

  holder = {"state": state}
  train_time = {}

  def step_fn(state, batch):
    i = min(tr.host_metrics)  # the rollout this batch came from (state.step counts updates: num_iterations each)
    state, m, dt = tr.updates(state, batch, i)
    holder["state"] = state
    host = tr.host_metrics.pop(i)
    logged = host.pop(LOGGED, {})
    total = host["sample_time_s"] + dt
    extra = {**host, "train_time_s": dt, "sample_share": host["sample_time_s"] / total}
    train_time[i] = dt
    return state, with_logged({**m, **extra}, logged, i)

  def progress(m):
    return f"reward {m['reward_mean']:.3f}" + (f"  eval {m['eval_reward']:.3f}" if "eval_reward" in m else "")

  loop = LP.Loop(cfg, step_fn, ckpt, console, say, Recorder(), step.global_batch * cfg.train.seq_len, show_progress,
                 t_start, on_step, queue_ahead=False, progress_extra=progress)
  out = loop.run(state, start, rng, counters, fetch=lambda i: pending.pop(i, None) or tr.rollout(holder["state"], i),
                 position=lambda: {"prompts": tr.iterator.get_state(), "reward_errors": dict(tr.rewards.errors),
                                   "reward_nan": dict(tr.rewards.nans), "reward_none": dict(tr.rewards.nones)})
  if out.nonfinite_msg:
    ckpt.wait()
    raise LP.NonFiniteStop(out.nonfinite_msg)
  # A record's eval_reward was measured before its update: after step - 1 updates (eval.json's keys count updates).
  evals = {r["step"] - 1: r["eval_reward"] for r in records if "eval_reward" in r}
  if out.stop_reason == "done" and cfg.rl.eval_every and records:
    # (what its rewards log has no step record to go into: eval.json keeps the greedy reward alone)
    evals[cfg.train.steps] = tr.evaluate(out.state, cfg.train.steps)["eval_reward"]
    if jax.process_index() == 0:
      # The greedy evaluations of the whole run (after the last step too), beside metrics.jsonl.
      path = os.path.join(cfg.run_dir, "eval.json")
      old = json.load(open(path)) if os.path.exists(path) else {}
      old.update({str(k): v for k, v in evals.items()})
      write_text(path, json.dumps(dict(sorted(old.items(), key=lambda kv: int(kv[0]))), indent=1) + "\n")
  return RLResult([r["reward_mean"] for r in records], out.losses, evals, out.state, start, out.stop_reason, out.saved,
                  out.signal, cfg.run_dir, records)

