"""`meshlm rl` on a small qwen3-moe (float32): rollouts, the RL step, replay, the frozen router, resume.

- Replay is exact: with rl.router_replay=true the training forward's expert ids equal the sampler's for
  every fed token and MoE layer, bit for bit, and the first iteration's ratio is 1 within the train/sample
  log-prob gap (GAP_TOL) at every step, with top_p=0.9 and temperature 0.7 (the trainer scores under the
  sampler's truncation); the negative control scoring without the truncation shows the kept-mass bias (mean
  ratio well below 1).
- With replay off, a perturbed router makes the trainer route otherwise and the step reports the flips;
  the unperturbed router reports none. With replay on, the RL loss's forward takes the sampler's routes: none flips.
- 20 RL steps leave the frozen router bit-unchanged; the census of the RL step has no router weight-
  gradient dot (and has them when nothing is frozen: control).
- SIGTERM after step 9 saves checkpoint 10; 10 + 10 steps (the resume) equal 20 straight, in rewards,
  losses and parameters.
- Explicit and auto sharding give the same RL losses within 1e-5 on fsdp=4.
- Bad input: one line, exit 2.
"""
import json
import os
import re
import signal
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import cli
from meshlm.commands.resolve import load_config
from meshlm.models.params import split_state
from meshlm.nn.head_loss import materialized_logprobs
from meshlm.rl import rollout as R
from meshlm.rl import step as RS
from meshlm.rl import toy
from meshlm.rl import trainer as TR
from meshlm.rl.rewards import Rewards

SMALL = ("model=qwen3-moe-tiny", "train.compute_dtype=float32", "model.embed_dim=64", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "model.parts.moe.mlp_dim=32",
         "model.vocab_size=257", "model.max_position=64", "train.seq_len=32")
RL = ("rl.prompts_per_step=2", "rl.num_generations=4", "rl.max_new_tokens=8", "rl.temperature=0.7", "rl.top_p=0.9",
      "rl.reward=[meshlm.rl.toy:reverse_reward]", "train.learning_rate=1e-2", "train.warmup_steps=0",
      "checkpoint.every=10")
REPLAY = ("rl.router_replay=true", r"train.freeze=['.*\.router']")
ROUTER = "layers.moe.moe.router"
# Every parameter but the final norm frozen: the RL loss (scoring under top-p, the ratio, the replayed ids in the
# forward) and its backward down to the logits run in full, while the backward through the layers compiles no more
# (a third of the compile). That backward is the train step's, explicit = auto for qwen3-moe-tiny in
# tests/test_conformance.py; through a replayed routing, the MoE layer's under both modes is
# tests/test_router_replay.py's test_sharded_replay_gives_the_unsharded_ids. train.freeze is a list: it replaces
# REPLAY's router freeze, which it includes.
FINAL_NORM_ONLY = r"train.freeze=['layers\..*', 'embed', 'lm_head']"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  d = tmp_path_factory.mktemp("toy")
  path, _ = toy.write(str(d), 40, 0, 3, 6)
  return path


REWARDS = """
def spread(prompts, completions, **columns):
    # TRL's batched form: distinct values in every group of 4 consecutive rows (3 is invertible mod 5), so no
    # group is degenerate whatever the sampler drew
    return [(3 * i) % 5 / 4 for i in range(len(completions))]

def chars(prompt, completion, row):
    # of the completion's characters: step means vary as the samples do
    return sum(map(ord, completion)) % 97 / 97

def raises(prompt, completion, row):
    return row["no_such_field"]

def half_nan(prompts, completions, **columns):
    return [float("nan") if i % 2 else 1.0 + i for i in range(len(completions))]

def quarter_none(prompts, completions, **columns):
    # TRL's "no reward for this one" on rows 0 and 4
    return [None if i % 4 == 0 else (3 * i) % 5 / 4 for i in range(len(completions))]

async def logging_spread(completions, trainer_state, log_metric, log_extra, **kwargs):
    # TRL's extras, async: the step into a metric, a metric of the completions, a column of their first characters
    log_metric("max_steps", trainer_state.max_steps)
    log_metric("global_step", trainer_state.global_step)
    log_metric("mean_chars", sum(map(len, completions)) / len(completions))
    log_extra("first_char", [c[:1] for c in completions])
    return [(3 * i) % 5 / 4 for i in range(len(completions))]
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
  """A user's reward file (rl.reward=PATH.py:fn). spread + chars: the totals of a group's 4 rows are distinct by
  construction (two of them equal would need chars to differ by a multiple of 97/4 within [0, 96/97]), so every
  step has non-zero advantages, whichever tokens an ulp-level difference makes the sampler draw."""
  path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
  path.write_text(REWARDS)
  return str(path)


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
  """An eval set of its own (rl.eval_prompts=PATH): 8 prompts, as many rows as a rollout (the sampled eval then
  reuses the rollouts' compiled sampler)."""
  d = tmp_path_factory.mktemp("eval")
  path, _ = toy.write(str(d), 8, 5, 3, 6)
  return path


def _cfg(prompts, *extra, devices=1):
  return load_config(*SMALL, *RL, f"rl.prompts={prompts}", f"cpu_devices={devices}", *extra)


@pytest.fixture(scope="module")
def runs(prompts, reward_file, eval_file, tmp_path_factory):
  """20 RL steps straight, and 10 + 10 with a resume (router replay on, router frozen), evaluating every 10 steps
  on an eval set of its own; the rewards are non-degenerate by construction (reward_file)."""
  import io
  from meshlm.console import make_console
  root = tmp_path_factory.mktemp("runs")
  # At RL's 1e-2 these rewards' signal collapses the policy within 9 steps: past top_p on one token, the kept set
  # is that token alone, q = 1 there and no position has a gradient left (grad_norm 0.0 from step 9 on).
  keys = (*REPLAY, "train.steps=20", "train.learning_rate=1e-3", f"rl.reward=[{reward_file}:spread,{reward_file}:chars]",
          "rl.eval_every=10", f"rl.eval_prompts={eval_file}")
  out = io.StringIO()
  straight = TR.run(_cfg(prompts, *keys, f"run_dir={root}/a"), show_progress=False, console=make_console(file=out))
  # SIGTERM once step 9's metrics are read: the loop saves checkpoint 10 and stops, as on a preemption.
  term = lambda i: os.kill(os.getpid(), signal.SIGTERM) if i == 9 else None  # noqa: E731
  first = TR.run(_cfg(prompts, *keys, f"run_dir={root}/b"), show_progress=False, on_step=term)
  resumed = TR.run(_cfg(prompts, *keys, f"run_dir={root}/b"), show_progress=False)
  records = [json.loads(ln) for ln in open(f"{root}/b/metrics.jsonl")]
  straight.console_text, straight.keys = out.getvalue(), keys
  return straight, (first, resumed), records


# The sampler's log-probs (decode, one token at a time against the KV cache) and the trainer's (one forward of the
# row) are one float32 computation done in two orders. Measured over the 20 steps here: logp_gap_max up to 2.1e-6
# and |ratio - 1| up to 2.1e-6 (4-5 float32 ulps of log-probs near -4; logp_gap_mean 3.9e-7). 16 ulps of a log-prob
# of magnitude 8 (1.5e-5, 7x the measured gap) keeps that from failing on another machine's rounding, while the
# errors this test is for move the ratio by 1e-3 and more (a flipped routing: test_replay_off_...; the scoring
# without the sampler's truncation: 3%, test_untruncated_scoring_...).
GAP_TOL = 16 * float(np.spacing(np.float32(8.0)))


def test_first_iteration_ratio_is_one_under_top_p_at_every_step(runs):
  straight, _, _ = runs
  assert len(straight.records) == 20
  for r in straight.records:
    # The first iteration's ratio is exp(logp - sampler_logp) (rl.sampler_is off), so each token's |ratio - 1| is at
    # most expm1 of the step's largest gap (plus exp's float32 rounding at 1); the gap itself is bounded by GAP_TOL.
    bound = np.expm1(r["logp_gap_max"]) + 2 * np.finfo(np.float32).eps
    assert max(abs(r["ratio_mean"] - 1), abs(r["ratio_max"] - 1), abs(r["ratio_min"] - 1)) <= bound, r
    assert r["logp_gap_max"] <= GAP_TOL
    assert r["router_flips_any_layer"] == 0.0  # replayed
  # every step had a gradient (its rewards are non-degenerate by construction)
  assert all(r["grad_norm"] > 0 and r["groups_degenerate"] == 0 for r in straight.records)


def test_frozen_router_is_bit_unchanged_after_20_steps(runs, prompts):
  straight, _, _ = runs
  step = RS.build_rl_step(TR.rl_config(_cfg(prompts, *REPLAY), R.load_prompts(_cfg(prompts), _byte()), 1))
  init = step.init_state(jax.random.key(0))  # train.seed 0: the run's initial parameters
  paths = jax.tree.leaves(RS.ST.param_paths(step.cfg))
  moved = {p: not np.array_equal(np.asarray(a), np.asarray(b))
           for p, a, b in zip(paths, jax.tree.leaves(init.params), jax.tree.leaves(straight.state.params))}
  assert moved[ROUTER] is False
  assert moved["layers.moe.moe.up"] and moved["layers.moe.attn.q"]  # control: the rest trained


def test_sigterm_saves_and_ten_plus_ten_steps_equal_twenty(runs):
  straight, (first, resumed), records = runs
  assert first.stop_reason == "preempted" and first.signal == signal.SIGTERM and first.checkpoint.endswith("/10")
  assert resumed.start_step == 10 and [r["step"] for r in records] == list(range(1, 21))
  assert [r["reward_mean"] for r in records] == straight.rewards
  assert [r["loss"] for r in records] == [r["loss"] for r in straight.records]
  assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in straight.records]
  for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Control: the rewards and gradient norms are not constant, so equal lists say something.
  assert len(set(straight.rewards)) > 1 and len({r["grad_norm"] for r in straight.records}) > 1


def test_a_resume_may_change_the_evaluation_and_names_a_changed_rl_key(runs, prompts):
  """rl.eval_every and rl.eval_prompts may change on resume (as train.log_every): run b, done at step 20, has
  nothing to do. A changed rl.num_generations is refused naming that key, not the train.per_device_batch_size the
  trainer derives from it (RL's train.seq_len and per-device batch follow the rl.* keys, which are compared)."""
  from meshlm.errors import ConfigError
  straight, (_, resumed), _ = runs
  b = resumed.run_dir
  before = open(os.path.join(b, "completions.jsonl")).read()
  again = TR.run(_cfg(prompts, *straight.keys, "rl.eval_every=5", "rl.eval_prompts=4", f"run_dir={b}"),
                 show_progress=False)
  assert again.start_step == 20 and again.records == []
  assert open(os.path.join(b, "completions.jsonl")).read() == before  # nothing run again: the last eval kept
  with pytest.raises(ConfigError, match=r"\(rl.num_generations is 2 here but 4 there\); put it back") as e:
    TR.run(_cfg(prompts, *straight.keys, "rl.num_generations=2", f"run_dir={b}"), show_progress=False)
  assert "per_device_batch_size" not in str(e.value)


def test_evaluations_write_their_completions_and_resume_exactly(runs, eval_file):
  """rl.eval_every=10 with rl.eval_prompts=PATH: at steps 0, 10 and after the last, the eval set's greedy and
  sampled completions with their rewards go to run_dir/completions.jsonl, and the first few to the console. The
  resumed run (its second half re-evaluates step 10, the stopped first half never reached it) writes what the
  straight run wrote, line for line: the sampled eval draws from a stream of its own."""
  straight, (first, resumed), records = runs
  lines = [json.loads(ln) for ln in open(os.path.join(straight.run_dir, "completions.jsonl"))]
  evals = [json.loads(ln)["prompt"] for ln in open(eval_file)]
  assert [(r["step"], r["mode"]) for r in lines] == [(s, m) for s in (0, 10, 20) for m in ("greedy", "sampled")
                                                     for _ in evals]
  assert [r["prompt"] for r in lines[:8]] == evals and set(lines[0]) >= {"completion", "reward", "rewards"}
  assert set(lines[0]["rewards"]) == {"spread", "chars"}
  at = {(r["step"], r["mode"]): [] for r in lines}
  for r in lines:
    at[r["step"], r["mode"]].append(r["reward"])
  rec = {r["step"] - 1: r for r in straight.records}  # a record's evaluation comes before its update
  for s in (0, 10):
    assert rec[s]["eval_reward"] == pytest.approx(np.mean(at[s, "greedy"]), abs=1e-12)
    assert rec[s]["eval_reward_sampled"] == pytest.approx(np.mean(at[s, "sampled"]), abs=1e-12)
  assert straight.evals[20] == pytest.approx(np.mean(at[20, "greedy"]), abs=1e-12)
  # Sampled is not greedy (control: the two modes are two evaluations).
  assert [r["completion"] for r in lines[:8]] != [r["completion"] for r in lines[8:16]]
  assert "eval step 0 (greedy): 'rev " in straight.console_text
  again = [json.loads(ln) for ln in open(os.path.join(resumed.run_dir, "completions.jsonl"))]
  assert again == lines


def _forward(cfg, params, batch, replay):
  """(logits, {replayed input: the trainer's own choices [n, B, T, k]}) of the training forward over the batch,
  its recorded choices forced with replay."""
  from meshlm.models import decoder
  from meshlm.models.model import resolve
  from meshlm.train.step import layer_inputs_of
  M = resolve(cfg)
  logits, side = decoder.forward(M, params, batch["inputs"], batch["positions"], batch["segment_ids"],
                                 return_side=True, layer_inputs=layer_inputs_of(M, batch) if replay else None)
  return logits, {name: side[s] for s, name in M.replays.items()}


def _byte():
  from meshlm.train.data.tokenizers import ByteTokenizer
  return ByteTokenizer()


@pytest.fixture(scope="module")
def rollout(prompts):
  """A Trainer (replay on) and one rollout from its initial state."""
  tr = TR.Trainer(_cfg(prompts, *REPLAY))
  state = tr.step.init_state(jax.random.key(0))
  batch = tr.rollout(state, 0)
  return tr, state, batch


@pytest.fixture(scope="module")
def replayed(rollout):
  """(logits, the trainer's expert ids [L, B, T, k]) of the training forward over the rollout, its recorded ids
  forced: one program for the two tests that read it (each jitted its own: a forward compile more)."""
  tr, state, batch = rollout
  with jax.set_mesh(tr.mesh):
    logits, side = jax.jit(lambda p, b: _forward(tr.cfg, p, b, True))(tr.params_of(state), batch)
  return logits, np.asarray(side["forced_expert_ids"])


def test_trainer_expert_ids_equal_the_samplers_bit_for_bit(rollout, replayed):
  tr, state, batch = rollout
  with jax.set_mesh(tr.mesh):
    live = replayed[1]  # [L, B, T, k]
    free = np.asarray(jax.jit(lambda p, b: _forward(tr.cfg, p, b, False)[1]["forced_expert_ids"])(
        tr.params_of(state), batch))
  rec = np.moveaxis(np.asarray(batch["forced_expert_ids"]), 2, 0)
  fed = rec[..., 0] >= 0
  assert fed.sum() > 100 and fed[..., 0].all()
  np.testing.assert_array_equal(live[fed], rec[fed])
  # The unforced training forward routes as the sampler did too (same params, float32).
  np.testing.assert_array_equal(free[fed], rec[fed])


def test_untruncated_scoring_shows_the_kept_mass_bias(rollout, replayed):
  """The control: the trainer scores with the temperature only (rl.score_truncated=false), so each ratio
  is the kept mass of top-p (< 1), while the truncated scoring gives 1."""
  tr, state, batch = rollout
  logits = replayed[0]
  mask = np.asarray(batch["loss_mask"]) > 0
  samp = np.asarray(batch["sampler_logp"])
  score = lambda c: materialized_logprobs(logits, batch["targets"], temperature=c.rl.temperature,  # noqa: E731
                                         keep_fn=RS.keep_fn(c))[0]
  ratio = lambda c: np.exp(np.asarray(score(c)) - samp)[mask]  # noqa: E731
  kept = ratio(tr.cfg)
  untrunc = ratio(tr.cfg.model_copy(update={"rl": tr.cfg.rl.model_copy(update={"score_truncated": False})}))
  assert abs(kept.mean() - 1) <= 1e-5
  assert untrunc.mean() < 0.97 and np.all(untrunc <= 1 + 1e-5)


@pytest.fixture(scope="module")
def perturbed(rollout):
  """A rollout sampled with a perturbed router (the trainer's own router routes many of its tokens otherwise)."""
  tr, state, _ = rollout
  noisy = jax.tree.map(lambda a: a, tr.params_of(state))
  r = noisy["layers"]["moe"]["moe"]["router"]
  noisy["layers"]["moe"]["moe"]["router"] = r + 0.5 * jax.random.normal(jax.random.key(1), r.shape) * jnp.std(r)
  return tr.rollout(state._replace(params=split_state(tr.cfg, noisy)[0]), 1)


def _loss_metrics(tr, cfg):
  rows = cfg.rl.prompts_per_step * cfg.rl.num_generations
  return jax.jit(lambda p, b: RS.rl_loss(cfg, p, b, jnp.sum(b["loss_mask"]), num_rows=rows)[1])


@pytest.mark.parametrize("impl", ["materialized", "blockwise"])
def test_replay_on_forces_the_samplers_routes_in_the_rl_loss(rollout, perturbed, impl):
  """The RL loss with rl.router_replay=true over a rollout sampled with a perturbed router: its forward is given the
  sampler's expert ids, so the trainer's routes are the sampler's and no route flips in any layer, whichever way
  the head runs (loss_impl: auto picks blockwise at real sizes). Dropping the forced ids from the loss's forward
  flips most of them: the control below, the same loss with replay off, reports those flips."""
  from meshlm.models.logprobs import loss_path
  tr, state, _ = rollout
  cfg = tr.cfg.model_copy(update={"loss_impl": impl})
  assert cfg.rl.router_replay and loss_path(cfg, *perturbed["inputs"].shape) == impl
  with jax.set_mesh(tr.mesh):
    m = _loss_metrics(tr, cfg)(tr.params_of(state), perturbed)
  flips = [float(m[f"router_flips_layer{i}"]) for i in range(3)] + [float(m["router_flips_any_layer"])]
  assert flips == [0.0] * 4, flips


def test_replay_off_reports_the_router_flips_of_a_perturbed_router(rollout, perturbed):
  """The RL loss with rl.router_replay=false (forward only: the metrics are the loss's) on a rollout
  sampled with a perturbed router reports flips in every MoE layer; sampled with the trainer's own
  router it reports none."""
  tr, state, batch = rollout
  off = tr.cfg.model_copy(update={"rl": tr.cfg.rl.model_copy(update={"router_replay": False})})
  metrics = _loss_metrics(tr, off)
  params = tr.params_of(state)
  with jax.set_mesh(tr.mesh):
    m = metrics(params, perturbed)
    same = metrics(params, batch)
  flips = [float(m[f"router_flips_layer{i}"]) for i in range(3)]
  assert min(flips) > 0.01 and float(m["router_flips_any_layer"]) > max(flips)
  assert abs(float(m["ratio_mean"]) - 1) > 1e-3
  # The rates, counted here from the trainer's own routing: per layer the sampler's (token, slot) choices the
  # trainer did not make over tokens x k; any layer, the tokens with such a flip over the tokens.
  with jax.set_mesh(tr.mesh):
    live = np.asarray(jax.jit(lambda p, b: _forward(off, p, b, False)[1]["forced_expert_ids"])(params, perturbed))  # [L, B, T, k]
  rec = np.moveaxis(np.asarray(perturbed["forced_expert_ids"]), 2, 0)  # [L, B, T, k]
  valid = (rec[..., 0] >= 0) & (np.asarray(perturbed["segment_ids"])[None] > 0)  # [L, B, T]
  missing = (rec[..., :, None] != live[..., None, :]).all(-1) & valid[..., None]  # [L, B, T, k]
  k = rec.shape[-1]
  np.testing.assert_allclose(flips, missing.sum((1, 2, 3)) / (valid.sum((1, 2)) * k), rtol=1e-6)
  assert float(m["router_flips_any_layer"]) == pytest.approx(
      (missing.any((0, 3)) & valid[0]).sum() / valid[0].sum(), rel=1e-6)
  # Control: over tokens, not tokens x k, the rates are k times these, so the check above can fail.
  assert not np.allclose(flips, missing.sum((1, 2, 3)) / valid.sum((1, 2)), rtol=0.1)
  # Control: sampled by the trainer's own router, nothing flips and the ratio is 1.
  assert float(same["router_flips_any_layer"]) == 0.0 and abs(float(same["ratio_mean"]) - 1) <= 1e-5


def test_sampler_is_and_the_kl_reference_score_the_rollout_with_the_trainer(prompts, reward_file):
  """rl.sampler_is=token and rl.beta > 0: the trainer scores the rollout (old policy, and the reference,
  here the same parameters) with the sampler's truncation, so at the first update the IS weight and
  the ratio are 1 and the KL is 0, up to the train/sample gap. The rewards are non-degenerate by construction
  (reward_file's spread), so the gradient is not 0 whichever tokens were drawn (with the toy reward, an
  untrained model's rewards were all 0 on some CPUs: loss 0, grad_norm 0). Only the final norm trains
  (FINAL_NORM_ONLY): what is checked is the scoring and the first update's weights, ratio and KL."""
  tr = TR.Trainer(_cfg(prompts, *REPLAY, FINAL_NORM_ONLY, "rl.sampler_is=token", "rl.beta=0.1",
                       f"rl.reward={reward_file}:spread"))
  state = tr.step.init_state(jax.random.key(0))
  tr.ref = jax.tree.map(jnp.copy, tr.params_of(state))
  batch = tr.rollout(state, 0)
  mask = np.asarray(batch["loss_mask"]) > 0
  old, samp = np.asarray(batch["old_logp"]), np.asarray(batch["sampler_logp"])
  assert mask.sum() > 50 and np.max(np.abs(old - samp)[mask]) <= 1e-5 and np.any(old[mask] != samp[mask])
  np.testing.assert_array_equal(np.asarray(batch["ref_logp"]), old)
  assert tr.host_metrics[0]["groups_degenerate"] == 0
  _, m, _ = tr.updates(state, batch)
  assert abs(float(m["sampler_is_mean"]) - 1) <= 1e-5 and abs(float(m["ratio_mean"]) - 1) <= 1e-5
  assert float(m["sampler_is_clipped_frac"]) == 0  # the weights are 1: nothing past the cap
  assert abs(float(m["kl"])) <= 1e-6 and np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0


def test_census_of_the_rl_step_has_no_router_weight_gradient_dot(prompts):
  from meshlm.analysis.census import executed_counts, stablehlo_counts
  ps = R.load_prompts(_cfg(prompts), _byte())

  def router_dots(*extra):
    step = RS.build_rl_step(TR.rl_config(_cfg(prompts, "rl.router_replay=true", *extra), ps, 1))
    _, _, mod = stablehlo_counts(step.lower().as_text(debug_info=True))
    return executed_counts(mod)["weight_grad_dots"]
  frozen, trained = router_dots(r"train.freeze=['.*\.router']"), router_dots()
  # The experts' down gradient runs in the fused GLU-down backward (a custom VJP), under the down kernel's scope.
  down = frozen["layers/mlp/moe/experts/down"]
  assert not [k for k in frozen if "router" in k] and down > 0 and frozen["layers/mlp/moe/experts/gate_up"] > 0
  # Control: a trained router has its weight-gradient dot in each of the 3 scanned MoE layers; nothing else changes.
  assert trained.pop("layers/mlp/moe/router") == 3 and trained == frozen


def test_explicit_and_auto_losses_agree_on_fsdp4(prompts, rollout):
  """Two layers (a dense one, one MoE) and the final norm alone trained (FINAL_NORM_ONLY) to keep the two
  compiles cheap; the rollout's batch with its first MoE layer's ids and made-up advantages (the untrained
  model's rewards are all 0)."""
  _, _, batch = rollout
  host = jax.tree.map(np.asarray, batch)
  host["forced_expert_ids"] = host["forced_expert_ids"][:, :, :1]
  host["advantages"] = np.linspace(-1.0, 1.5, host["advantages"].shape[0]).astype(np.float32)
  out = {}
  for mode in ("explicit", "auto"):
    tr_cfg = TR.rl_config(_cfg(prompts, *REPLAY, FINAL_NORM_ONLY, "model.num_layers=2", "mesh.fsdp=4",
                               f"shard_mode={mode}", devices=4), R.load_prompts(_cfg(prompts), _byte()), 4)
    step = RS.build_rl_step(tr_cfg)
    state = step.init_state(jax.random.key(0))
    got = []
    b = step.put_batch(host)
    for _ in range(2):
      state, m = step(state, b)
      got += [float(m["loss"]), float(m["grad_norm"])]
    out[mode] = np.array(got)
  assert min(np.abs(out["explicit"])) > 1e-4
  np.testing.assert_allclose(out["explicit"], out["auto"], atol=1e-5, rtol=1e-5)


def test_a_raising_reward_scores_zero_and_is_counted():
  rl = load_config("rl.reward=[exact_match,numeric_match]", "rl.reward_weights=[1.0,0.5]").rl
  rw = Rewards.from_config(rl)
  sc = rw(["p", "p", "p"], ["12", "x", "12"], [{"answer": "12"}, {"answer": "12"}, {}])
  # the third row has no answer: both rewards raise there, score 0 and are counted
  assert sc.total == [1.5, 0.0, 0.0] and sc.each["numeric_match"] == [1.0, 0.0, 0.0]
  assert rw.errors == {"exact_match": 1, "numeric_match": 1} and rw.nans == {"exact_match": 0, "numeric_match": 0}
  assert sc.failures["exact_match"].first == "raised KeyError: 'answer'"


@pytest.mark.parametrize("case, msg", [
    ("empty", "rl.prompts=.*: empty"),
    ("long", "line 2's prompt is 70 tokens, longer than model.max_position - rl.max_new_tokens = 64 - 8 = 56"),
    ("groups", "rl.num_generations=1: GRPO normalizes"),
    ("unknown", "rl.reward=exactly: unknown reward"),
    ("import", "rl.reward=no_such_module_xyz:f: cannot import it"),
    ("dense", r"rl.router_replay=true: llama2-tiny \(model family .llama. here\) has no layer whose choices a replay"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, prompts, case, msg):
  import re
  path = tmp_path / "p.jsonl"
  path.write_text("" if case == "empty" else '{"prompt": "rev ab="}\n' + json.dumps({"prompt": "x" * 70}) + "\n")
  args = [*SMALL, *RL, f"rl.prompts={path}", f"run_dir={tmp_path}/run", "cpu_devices=1"]
  args += {"groups": ["rl.num_generations=1"], "unknown": ["rl.reward=[exactly]"],
           "import": ["rl.reward=no_such_module_xyz:f"], "empty": [], "long": [],  # import: one reward, no brackets
           "dense": ["model=llama2-tiny", "rl.router_replay=true"]}[case]
  if case in ("unknown", "import", "dense", "groups"):
    args[args.index(f"rl.prompts={path}")] = f"rl.prompts={prompts}"
  if case == "dense":  # llama has no moe part, so it would refuse the MoE width SMALL sets (model.parts.moe)
    args = [a for a in args if not a.startswith("model.parts.moe.")]
  code = cli.main(["rl", *args])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and re.search(msg, err[0]), err
  assert not (tmp_path / "run").exists()


def test_rows_of_a_gdn_hybrid_on_context_shards_are_whole_chunks(prompts):
  """The RL step's row length T (the longest prompt + rl.max_new_tokens, rounded up) is one the train step takes:
  on mesh.context, a Gated DeltaNet hybrid runs whole chunks per shard, so T is a multiple of context x
  model.parts.gdn.chunk_size. Before, T was only a multiple of 8, and `meshlm rl` stopped at its first rollout with a
  pydantic traceback (the sampler re-validates its config). Control: the rounding is only where a step needs it."""
  from meshlm.config import Config
  lengths = {}
  for model, ctx in (("qwen3-next-tiny", 2), ("qwen3-next-tiny", 1), ("qwen3-moe-tiny", 2)):
    cfg = load_config(f"model={model}", "train.compute_dtype=float32", "train.seq_len=128", *RL,
                      f"rl.prompts={prompts}", f"cpu_devices={ctx}", f"mesh.context={ctx}")
    rl_cfg = TR.rl_config(cfg, R.load_prompts(cfg, _byte()), ctx)
    Config.model_validate_json(rl_cfg.model_dump_json())  # what generate's sampler does: no error
    lengths[model, ctx] = rl_cfg.train.seq_len
  assert lengths["qwen3-next-tiny", 2] % (2 * 64) == 0 and lengths["qwen3-next-tiny", 2] <= 128
  assert lengths["qwen3-next-tiny", 1] == lengths["qwen3-moe-tiny", 2] < 128
  assert lengths["qwen3-next-tiny", 1] % 8 == 0


def test_scoring_takes_the_model_state_deepseek_v3s_routing_bias(prompts):
  """rl.sampler_is and rl.beta score a rollout before any update (rl/step.scorer) with the whole model tree, the
  model-state leaves merged in, as the sampler takes it. Before, the scorer's shardings had the parameters only,
  and `meshlm rl` on DeepSeek-V3 with either key died at its first rollout. With a routing bias that moves the
  routing (drawn at random), the scored old log-probs are the sampler's own (the same params, the same truncated
  distribution), and the reference policy's equal them at step 0. Control: scored without the bias, they move."""
  cfg = load_config("model=deepseek-v3-tiny", "model.num_layers=2", "model.embed_dim=64", "model.vocab_size=257",
                    "model.max_position=64", "train.seq_len=32", "train.compute_dtype=float32", *RL,
                    f"rl.prompts={prompts}", "cpu_devices=1", "rl.sampler_is=token", "rl.beta=0.1")
  tr = TR.Trainer(cfg)
  state = tr.step.init_state(jax.random.key(0))
  bias = state.model_state["layers"]["moe"]["moe"]["router_bias"]
  skew = jax.random.normal(jax.random.key(3), bias.shape, bias.dtype)
  state = state._replace(model_state={"layers": {"moe": {"moe": {"router_bias": skew}}}})
  tr.ref = tr.params_of(state)  # the run's reference is its starting policy (trainer._run sets it)
  batch = tr.rollout(state, 0)
  mask = np.asarray(batch["loss_mask"]) > 0
  old, ref, samp = (np.asarray(batch[k])[mask] for k in ("old_logp", "ref_logp", "sampler_logp"))
  assert mask.sum() > 20
  np.testing.assert_allclose(old, samp, rtol=0, atol=1e-5)
  np.testing.assert_array_equal(ref, old)
  unbiased = jax.tree.map(lambda a: a, tr.params_of(state))
  unbiased["layers"]["moe"]["moe"]["router_bias"] = jnp.zeros_like(skew)
  with jax.set_mesh(tr.mesh):
    direct = np.asarray(tr.score(tr.params_of(state), batch))[mask]
    moved = np.asarray(tr.score(unbiased, batch))[mask]
  np.testing.assert_array_equal(old, direct)  # the batch holds the scorer's values, not the sampler's copy
  assert np.max(np.abs(moved - samp)) > 1e-3
  # Replayed ids bypass the routing bias (a bias picks experts, never weighs them): the model's forward with forced
  # ids, tests/test_router_bias.py's test_replayed_ids_bypass_the_bias_in_the_model (with its control, unforced);
  # the RL loss forcing them and counting flips, test_replay_off_reports_the_router_flips_of_a_perturbed_router and
  # the runs' ratio of 1 with no flips.


# --- the modes of issue 33 through the trainer and the RL step, on rollouts made by hand -----------------------

DENSE = ("model=llama2-tiny", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
         "model.mlp_dim=64", "model.num_layers=1", "model.vocab_size=257", "model.max_position=64", "train.seq_len=32",
         "train.compute_dtype=float32", "rl.prompts_per_step=2", "rl.num_generations=4", "rl.max_new_tokens=8",
         "train.learning_rate=1e-2", "train.warmup_steps=0")
EOS = 256  # the byte tokenizer's: the trainer's stop token
# Row b's completion length, and whether it ends with EOS: rows 0, 4 and 6 are cut by rl.max_new_tokens (truncated);
# row 2 fills rl.max_new_tokens and ends with EOS (not truncated).
LENGTHS, ENDS = [8, 3, 8, 5, 8, 2, 8, 6], [False, True, True, True, False, True, False, True]
TRUNCATED = [0, 4, 6]


def made_sampler(seed=0, lengths=LENGTHS, ends=ENDS):
  """A stand-in for rl/rollout.sample: completions of `lengths` letters a-h (EOS last where `ends`), and sampler
  log-probs drawn in [-6, -5] (the untrained model's are near log(1/257) = -5.55): the rollouts are fixed by
  construction, not by which tokens an ulp-level difference makes the sampler draw."""
  LENGTHS, ENDS = lengths, ends  # noqa: N806

  def sample(cfg, params, prompt_ids, seeds, mesh, stops):
    B, N = len(prompt_ids) * cfg.rl.num_generations, cfg.rl.max_new_tokens
    rng = np.random.default_rng(seed)
    tokens = rng.integers(97, 105, (B, N)).astype(np.int32)
    live = np.arange(N)[None] < np.asarray(LENGTHS)[:, None]
    for b, (n, end) in enumerate(zip(LENGTHS, ENDS)):
      tokens[b, n - 1] = EOS if end else tokens[b, n - 1]
    tokens[~live] = 0
    slp = (rng.uniform(-6.0, -5.0, (B, N)) * live).astype(np.float32)
    return R.G.Generation(tokens, slp, np.asarray(LENGTHS, np.int32), {}, {}, slp)
  return sample


def _spread(n):
  return np.array([(3 * i) % 5 / 4 for i in range(n)])


def ref_group_advantages(r, G):
  g = np.asarray(r, np.float64).reshape(-1, G)
  return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def trl_loss(logp, ent, b, rl, micro):
  """One update's loss by TRL's rule (trl/trainer/grpo_trainer.py at f2cd577: _compute_loss, and the vLLM IS
  weights of _generate_and_score_completions), in float64, over micro-batches of rows m, micro + m, ... (the train
  step's split): the ratio over old_logp; cispo or the clip with delta; times the entropy mask (the micro-batch's
  quantile), times the IS weight; plus beta * k3 (times the ratio for k3_ratio); bnpo / token_mean."""
  f = lambda k: np.asarray(b[k], np.float64)  # noqa: E731
  mask, old, samp, adv = f("loss_mask"), f("old_logp"), f("sampler_logp"), f("advantages")[:, None]
  logp, ent = np.asarray(logp, np.float64), np.asarray(ent, np.float64)
  lr = (logp - old) * mask
  if rl.ratio_level == "sequence":
    lr = np.broadcast_to(lr.sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1), lr.shape)
  c1 = np.exp(lr)
  hi = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
  if rl.policy_loss == "cispo":
    per = -np.minimum(c1, rl.cispo_cap) * adv * logp
  else:
    c1d = c1 if rl.delta is None else np.minimum(c1, rl.delta)
    per = -np.minimum(c1d * adv, np.clip(c1, 1 - rl.epsilon, 1 + hi) * adv)
  w = np.ones_like(per)
  if rl.sampler_is != "none":
    d = (old - samp) * mask
    w = np.exp(d if rl.sampler_is.startswith("token") else np.broadcast_to(d.sum(1, keepdims=True), d.shape))
    lo = -np.inf if rl.sampler_is_min is None else rl.sampler_is_min
    w = np.where((w >= lo) & (w <= rl.sampler_is_cap), w, 0.0) if rl.sampler_is.endswith("mask") else \
        np.clip(w, lo, rl.sampler_is_cap)
  x = f("ref_logp") - logp if rl.beta > 0 else 0.0
  kl = (np.exp(x) - x - 1) * (c1 if rl.kl_estimator == "k3_ratio" else 1.0)
  total = 0.0
  for m in range(micro):
    rows = slice(m, None, micro)
    pm, mm = per[rows], mask[rows]
    if rl.top_entropy_quantile < 1:
      vals = ent[rows][mm > 0]
      pm = pm * ((ent[rows] * mm >= np.quantile(vals, 1 - rl.top_entropy_quantile)) & (mm > 0))
    pm = pm * w[rows] + rl.beta * (kl[rows] if rl.beta > 0 else 0.0)
    total += np.sum(pm * mm) / (max(mm.sum(), 1) * micro if rl.loss_agg == "bnpo" else max(mask.sum(), 1))
  return total


_SCORERS: dict = {}


def _scored(tr, params, batch):
  """(logp, entropy) of the batch's targets under params: the trainer's scoring, as the RL loss scores (one
  program per trainer, however many parameter sets it scores)."""
  if id(tr) not in _SCORERS:
    _SCORERS[id(tr)] = (tr, jax.jit(lambda p, b: RS.scores(tr.cfg, p, b, False)[:2]))
  with jax.set_mesh(tr.mesh):
    lp, ent = _SCORERS[id(tr)][1](params, batch)
  return np.asarray(lp), np.asarray(ent)


def _rl(tr, **update):
  return tr.cfg.rl.model_copy(update=update)


LOSS_TOL = 1e-5  # the step's float32 loss against the float64 rule: measured up to 4e-7 here (values ~0.1-1)


@pytest.fixture(scope="module")
def made_clip(prompts, reward_file):
  """Config A, on 2 devices (fsdp): the clip objective with delta, k3_ratio KL to another policy, the top half by
  entropy, truncated completions masked, bnpo over 2 micro-batches; rl.sampler_is off, so the ratio divides by the
  sampler's log-probs, which the stand-in draws apart from the trainer's (ratios from 0.4 to 2.7)."""
  mp = pytest.MonkeyPatch()
  mp.setattr(R, "sample", made_sampler())
  try:
    cfg = load_config(*DENSE, f"rl.prompts={prompts}", "cpu_devices=2", "mesh.fsdp=2", f"rl.reward={reward_file}:spread",
                      "rl.delta=1.5", "rl.beta=0.1", "rl.kl_estimator=k3_ratio", "rl.top_entropy_quantile=0.5",
                      "rl.mask_truncated_completions=true", "rl.loss_agg=bnpo", "train.micro_batches=2")
    tr = TR.Trainer(cfg)
    state = tr.step.init_state(jax.random.key(0))
    tr.ref = tr.params_of(tr.step.init_state(jax.random.key(1)))  # another policy: the KL is not 0
    batch = tr.rollout(state, 0)
  finally:
    mp.undo()
  return tr, state, batch


def test_made_rollout_masks_truncated_rows_and_groups_its_advantages(made_clip):
  """rl.mask_truncated_completions: the completions cut by rl.max_new_tokens without EOS have an all-0 loss mask,
  the rest (row 2 fills rl.max_new_tokens but ends with EOS) their length; truncated_frac counts them. The
  advantages are each prompt's group's (rows g*G + j), from the per-step reward's values. Controls: the whole batch
  as one group, and the batch built without the flag, differ."""
  tr, state, batch = made_clip
  mask = np.asarray(batch["loss_mask"])
  assert [int(x) for x in mask.sum(1)] == [0 if b in TRUNCATED else n for b, n in enumerate(LENGTHS)]
  assert tr.host_metrics[0]["truncated_frac"] == len(TRUNCATED) / len(LENGTHS)
  adv = np.asarray(batch["advantages"])
  np.testing.assert_allclose(adv, ref_group_advantages(_spread(8), 4), rtol=0, atol=1e-6)
  assert not np.allclose(adv, ref_group_advantages(_spread(8), 8), atol=1e-3)
  plain = R.to_batch(tr.cfg.model_copy(update={"rl": _rl(tr, mask_truncated_completions=False)}),
                     [p.ids for p in tr.last["prompts"][::4]], made_sampler()(tr.cfg, None, [[0]] * 2, None, None, None),
                     tr.cfg.train.seq_len, tr.stops)
  assert [int(x) for x in plain["loss_mask"].sum(1)] == LENGTHS


def test_made_rollout_blockwise_step_equals_the_materialized_one(made_clip):
  """The RL step of the test below (two devices, two micro-batches, the entropy mask, the KL to another policy)
  with the head run blockwise (loss_impl=blockwise: the branch auto picks at real sizes) gives the materialized
  step's loss, gradient norm and statistics, float32 within reassociation; the check below holds the
  materialized step to TRL's rule (and runs after this one: its update donates the fixture's state)."""
  tr, state, batch = made_clip
  fresh = lambda: jax.tree.map(jnp.copy, state)  # noqa: E731 (the steps donate their state)
  step = RS.build_rl_step(tr.step.cfg.model_copy(update={"loss_impl": "blockwise"}), tr.step.mesh)
  _, ref = tr.step(fresh(), batch)
  _, got = step(fresh(), batch)
  for name in ("loss", "grad_norm", "ratio_min", "ratio_max", "entropy", "entropy_kept_frac", "kl"):
    assert float(got[name]) == pytest.approx(float(ref[name]), rel=2e-5, abs=1e-6), name
  assert float(ref["grad_norm"]) > 0 and float(ref["kl"]) != 0  # something to compare


def test_made_rollout_clip_delta_k3_ratio_entropy_bnpo_equal_trls_rule(made_clip):
  """The step's loss (two micro-batches, two devices) equals TRL's rule in float64 on the step's own log-probs and
  entropies. Negative controls, each a break of one mode, fail the same check: the whole batch's token mean for
  bnpo, no entropy mask, no delta, plain k3, the truncated rows kept, and the ratio taken over the trainer's own
  scoring of the rollout."""
  tr, state, batch = made_clip
  rl = tr.cfg.rl
  logp, ent = _scored(tr, tr.params_of(state), batch)
  host = {k: np.asarray(v) for k, v in batch.items()}
  ratio = np.exp(logp - host["old_logp"])[host["loss_mask"] > 0]
  assert ratio.min() < 0.8 and ratio.max() > 1.5  # the clip and delta both bind
  with pytest.warns(TR.ClipWindowWarning, match="outside the clip window"):
    _, m, _ = tr.updates(state, batch, 0)  # most ratios start outside [0.8, 1.2]: the warning speaks
  got = float(m["loss"])
  want = trl_loss(logp, ent, host, rl, 2)
  assert abs(got - want) <= LOSS_TOL * max(1, abs(want)), (got, want)
  assert float(m["entropy_kept_frac"]) == pytest.approx(0.5, abs=0.1)
  # The extremes are the whole batch's over both micro-batches (not their sum: ratio_min 2 x 0.4 would pass no check).
  gap = np.abs(logp - host["sampler_logp"])[host["loss_mask"] > 0]
  for name, want_x in (("ratio_min", ratio.min()), ("ratio_max", ratio.max()), ("logp_gap_max", gap.max())):
    assert float(m[name]) == pytest.approx(want_x, rel=1e-5), name
  wrong = {"bnpo as token_mean": (dict(loss_agg="token_mean"), host), "no entropy mask":
           (dict(top_entropy_quantile=1.0), host), "no delta": (dict(delta=None), host),
           "plain k3": (dict(kl_estimator="k3"), host),
           "truncated kept": ({}, dict(host, loss_mask=host["loss_mask"] + _truncated_mask(host))),
           "ratio over the trainer's scoring": ({}, dict(host, old_logp=logp))}
  for name, (upd, h) in wrong.items():
    w = trl_loss(logp, ent, h, rl.model_copy(update=upd), 1 if upd.get("loss_agg") == "token_mean" else 2)
    assert abs(got - w) > 10 * LOSS_TOL * max(1, abs(w)), name


def _truncated_mask(host):
  """The loss mask the truncated rows would have without rl.mask_truncated_completions (their completion tokens)."""
  out = np.zeros_like(host["loss_mask"])
  for b in TRUNCATED:
    seg = np.asarray(host["segment_ids"])[b]
    n = int(seg.sum())  # prompt + completion - 1 positions; the completion's 8 are the last
    out[b, n - LENGTHS[b]:n] = 1.0
  return out


@pytest.fixture(scope="module")
def made_cispo(prompts, reward_file):
  """Config B, one device: CISPO with a cap that binds once the policy moves, and token_mask importance sampling
  with a lower bound (rl.sampler_is scores the rollout before the update: its ratio starts at 1, and the
  stand-in's sampler log-probs, drawn apart from the trainer's, put IS ratios on both sides of the bounds)."""
  mp = pytest.MonkeyPatch()
  mp.setattr(R, "sample", made_sampler(1))
  try:
    cfg = load_config(*DENSE, f"rl.prompts={prompts}", "cpu_devices=1", f"rl.reward={reward_file}:spread",
                      "rl.policy_loss=cispo", "rl.cispo_cap=1.002", "rl.sampler_is=token_mask",
                      "rl.sampler_is_min=0.8", "rl.sampler_is_cap=1.25")
    tr = TR.Trainer(cfg)
    state = tr.step.init_state(jax.random.key(0))
    batch = tr.rollout(state, 0)
  finally:
    mp.undo()
  return tr, state, batch


def test_made_rollout_cispo_and_masked_sampler_is_equal_trls_rule(made_cispo):
  """Two updates on one rollout: each step's loss equals TRL's rule on the step's own log-probs (at the first the
  ratio is 1; at the second the policy has moved and the cispo cap binds), and sampler_is_masked_frac is the share
  of tokens whose IS ratio is outside [0.8, 1.25]. Negative controls: the ratio over the sampler's log-probs
  instead of the trainer's scoring (old), IS with no bounds, IS truncated where mask is asked for, and the clip
  objective instead of cispo, each fail the same check; no ClipWindowWarning (the ratio starts at 1)."""
  import warnings as W
  tr, state, batch = made_cispo
  rl = tr.cfg.rl
  host = {k: np.asarray(v) for k, v in batch.items()}
  mask = host["loss_mask"] > 0
  logp0, ent0 = _scored(tr, tr.params_of(state), batch)
  np.testing.assert_allclose(host["old_logp"][mask], logp0[mask], rtol=0, atol=1e-6)  # old: the trainer's scoring
  is_ratio = np.exp(host["old_logp"] - host["sampler_logp"])[mask]
  assert (is_ratio < 0.8).any() and (is_ratio > 1.25).any() and ((is_ratio >= 0.8) & (is_ratio <= 1.25)).any()
  with W.catch_warnings():
    W.simplefilter("error", TR.ClipWindowWarning)
    state1, m1, _ = tr.updates(state, batch, 0)
  logp1, ent1 = _scored(tr, tr.params_of(state1), batch)
  _, m2 = tr.step(state1, batch)
  assert np.exp(logp1 - host["old_logp"])[mask].max() > rl.cispo_cap  # the cap binds at the second update
  assert float(m1["sampler_is_masked_frac"]) == pytest.approx(np.mean((is_ratio < 0.8) | (is_ratio > 1.25)), abs=1e-6)
  for got, lp, ent in ((float(m1["loss"]), logp0, ent0), (float(m2["loss"]), logp1, ent1)):
    want = trl_loss(lp, ent, host, rl, 1)
    assert abs(got - want) <= LOSS_TOL * max(1, abs(want)), (got, want)
    wrong = {"ratio over the sampler": (rl, dict(host, old_logp=host["sampler_logp"])),
             "IS without bounds": (rl.model_copy(update={"sampler_is_cap": 1e9, "sampler_is_min": None}), host),
             "IS truncated": (rl.model_copy(update={"sampler_is": "token_truncate"}), host),
             "clip objective": (rl.model_copy(update={"policy_loss": "clip"}), host)}
    for name, (r, h) in wrong.items():
      w = trl_loss(lp, ent, h, r, 1)
      assert abs(got - w) > 10 * LOSS_TOL * max(1, abs(w)), name


def test_rewards_that_fail_through_the_trainer(made_cispo, reward_file):
  """A reward that raises on every completion stops the rollout with its first exception (RewardFailed, exit 2 on
  the CLI); under rl.failed_reward=exclude a reward that returns NaN on some rows leaves them out of their groups
  (advantage 0, rewards_excluded), the rest normalized over what remains."""
  from meshlm.rl.rewards import RewardFailed
  tr, _, _ = made_cispo
  state = tr.step.init_state(jax.random.key(0))  # the fixture's was donated to its updates
  mp = pytest.MonkeyPatch()
  mp.setattr(R, "sample", made_sampler(1))
  saved = tr.rewards
  try:
    tr.rewards = Rewards.from_config(_rl(tr, reward=[f"{reward_file}:raises"]))
    with pytest.raises(RewardFailed, match=r"user_rewards.py:raises failed on every one of the step's 8 completions; "
                                           r"the first raised KeyError: 'no_such_field'; it was called with f\(prompt: str, "
                                           r"completion: str, row: dict\), once per completion$"):
      tr.rollout(state, 1)
    tr.rewards = Rewards.from_config(_rl(tr, reward=[f"{reward_file}:half_nan"], failed_reward="exclude"))
    with pytest.warns(TR.RewardWarning, match="half_nan: 4 of 8 returned nan; left out"):
      batch = tr.rollout(state, 2)
  finally:
    tr.rewards = saved
    mp.undo()
  adv = np.asarray(batch["advantages"])
  r = np.array([np.nan if i % 2 else 1.0 + i for i in range(8)])
  want = np.zeros(8)
  for g in range(2):  # each group's two scorable rows, normalized by their own mean and std
    v = r[4 * g:4 * g + 4:2]
    want[4 * g:4 * g + 4:2] = (v - v.mean()) / (v.std(ddof=1) + 1e-4)
  np.testing.assert_allclose(adv, want, atol=1e-6)
  assert tr.host_metrics[2]["rewards_excluded"] == 4 and tr.host_metrics[2]["reward_mean"] == pytest.approx(4.0)


def test_a_step_that_trains_on_nothing_warns_and_writes_valid_json(prompts, reward_file, tmp_path, monkeypatch):
  """Every completion cut at rl.max_new_tokens and masked (rl.mask_truncated_completions): the step trains on nothing
  (loss 0, grad_norm 0), warns saying why, and metrics.jsonl stays JSON: the ratio and gap statistics of no token
  are null, not Infinity (json.loads refuses a bare Infinity here, as strict readers do)."""
  monkeypatch.setattr(R, "sample", made_sampler(0, [8] * 8, [False] * 8))
  cfg = load_config(*DENSE, f"rl.prompts={prompts}", "cpu_devices=1", f"rl.reward={reward_file}:spread",
                    "rl.mask_truncated_completions=true", "train.steps=1", f"run_dir={tmp_path}/r")
  with pytest.warns(TR.EmptyStepWarning, match=r"step 0: all 8 completions were cut at rl.max_new_tokens=8 and rl."
                                                r"mask_truncated_completions=true masks them, so this step trains on"):
    TR.run(cfg, show_progress=False)

  def strict(c):
    raise ValueError(f"not JSON: {c}")
  lines = open(f"{tmp_path}/r/metrics.jsonl").read().splitlines()
  (rec,) = [json.loads(ln, parse_constant=strict) for ln in lines]
  assert rec["loss"] == 0.0 and rec["grad_norm"] == 0.0 and rec["truncated_frac"] == 1.0
  assert rec["ratio_min"] is None and rec["ratio_max"] is None and rec["logp_gap_max"] == 0.0
  # Control: the reader does refuse a bare Infinity.
  with pytest.raises(ValueError, match="not JSON: Infinity"):
    json.loads('{"ratio_min": Infinity}', parse_constant=strict)


def test_a_run_whose_reward_fails_at_step_0_leaves_run_dir_as_found(prompts, reward_file, tmp_path, monkeypatch):
  """A reward that raises on every call stops the run at its first rollout, before any step: the run leaves no
  config.yaml, metrics.jsonl or tensorboard/ behind, and the directories it made are gone (the README's promise for a
  run that fails before its first step). Control: a run_dir that existed (empty) before stays, empty."""
  from meshlm.rl.rewards import RewardFailed
  monkeypatch.setattr(R, "sample", made_sampler(0))
  for run_dir, existed in ((tmp_path / "new" / "run", False), (tmp_path / "old", True)):
    if existed:
      run_dir.mkdir()
    cfg = load_config(*DENSE, f"rl.prompts={prompts}", "cpu_devices=1", f"rl.reward={reward_file}:raises",
                      "train.steps=1", f"run_dir={run_dir}")
    with pytest.raises(RewardFailed, match="failed on every one of the step's 8 completions"):
      TR.run(cfg, show_progress=False)
    assert run_dir.is_dir() == existed and (not existed or list(run_dir.iterdir()) == [])
  assert list(tmp_path.iterdir()) == [tmp_path / "old"]


def test_log_completions_writes_the_rollouts_rows_and_none_rewards_are_counted(prompts, reward_file, tmp_path,
                                                                              monkeypatch):
  """rl.log_completions=3: each step's first 3 rollout rows go to completions.jsonl (mode rollout) with their prompt,
  decoded completion, rewards, advantage and truncation; a reward's None (TRL's "no reward") scores 0 under the
  default rl.failed_reward=zero and is counted in reward_none, over the run. Control: rl.log_completions=0 (the
  default) writes no file."""
  monkeypatch.setattr(R, "sample", made_sampler(0))
  for n in (3, 0):
    run_dir = tmp_path / str(n)
    run_dir.mkdir()
    tr = TR.Trainer(load_config(*DENSE, f"rl.prompts={prompts}", "cpu_devices=1", f"rl.log_completions={n}",
                                f"rl.reward={reward_file}:quarter_none", f"run_dir={run_dir}"))
    state = tr.step.init_state(jax.random.key(0))
    batches = [tr.rollout(state, i) for i in range(2)]
    path = run_dir / TR.COMPLETIONS
    if n == 0:
      assert not path.exists()
      continue
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["step"], r["mode"]) for r in lines] == [(0, "rollout")] * 3 + [(1, "rollout")] * 3
    texts, group = tr.last["texts"], tr.last["prompts"]  # step 1's
    assert [r["completion"] for r in lines[3:]] == texts[:3]
    assert [r["prompt"] for r in lines[3:]] == [p.text for p in group[:3]]
    assert [r["truncated"] for r in lines[3:]] == [b in TRUNCATED for b in range(3)]
    assert [r["reward"] for r in lines[3:]] == [0.0, 0.75, 0.25]  # row 0: None, scored 0
    np.testing.assert_allclose([r["advantage"] for r in lines[3:]], np.asarray(batches[1]["advantages"])[:3], atol=1e-6)
    assert tr.host_metrics[0]["reward_none"] == 2 and tr.host_metrics[1]["reward_none"] == 4  # over the run


# --- rewards: from the user's files, TRL's batched form, failures ------------------------------------------------

def test_a_reward_imports_from_the_working_directory_or_a_file_path(tmp_path, monkeypatch):
  """rl.reward=module:fn finds a module in the working directory (the console script's sys.path does not hold it:
  issue 31's ModuleNotFoundError), and rl.reward=path/to/file.py:fn loads that file. Control: from another
  directory the module is not found, in one line that says where it looked."""
  import sys
  from meshlm.errors import ConfigError
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
  monkeypatch.delitem(sys.modules, "myreward", raising=False)
  (tmp_path / "myreward.py").write_text("def frac_a(prompt, completion, row):\n  return completion.count('a') / 4\n")
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  with pytest.raises(ConfigError, match=r"^rl.reward=myreward:frac_a: cannot import it \(ModuleNotFoundError: .*"
                                        r"working directory"):
    Rewards.from_config(load_config("rl.reward=myreward:frac_a").rl)
  monkeypatch.chdir(tmp_path)
  for spec in ("myreward:frac_a", "./myreward.py:frac_a", f"{tmp_path}/myreward.py:frac_a"):
    rw = Rewards.from_config(load_config(f"rl.reward={spec}").rl)
    assert rw(["p"], ["aab"], [{}]).total == [0.5] and rw.names == ["frac_a"]
  for spec, msg in (("nofile.py:f", "nofile.py: no such file"), ("./myreward.py:nope", "has no nope"),
                    ("myreward:nope", "has no nope")):
    with pytest.raises(ConfigError, match=f"^rl.reward={spec}: .*{msg}"):
      Rewards.from_config(load_config(f"rl.reward={spec}").rl)


def test_trls_batched_signature_is_called_once_with_the_columns(reward_file):
  """A function with a `completions` parameter is called once per step with lists (TRL's reward_func(prompts=,
  completions=, completion_ids=, **columns)); without **kwargs it gets the names it asks for. None is TRL's "no
  reward": NaN, never a failure. Wrong lengths and non-lists stop the run with what was returned."""
  from meshlm.rl import rewards as RW
  calls = []

  def per_step(completions, answer):
    calls.append((list(completions), list(answer)))
    return [float(c == a) if a != "skip" else None for c, a in zip(completions, answer)]
  rw = RW.Rewards(["per_step"], [per_step], [1.0], failed="exclude")
  sc = rw(["p1", "p2", "p3"], ["x", "y", "z"], [{"answer": "x"}, {"answer": "n"}, {"answer": "skip", "other": 1}],
          [[1], [2], [3]])
  assert calls == [(["x", "y", "z"], ["x", "n", "skip"])]
  assert sc.total[:2] == [1.0, 0.0] and np.isnan(sc.total[2]) and sc.failures["per_step"].total == 0
  assert RW.is_batched(per_step) and not RW.is_batched(RW.exact_match)
  seen = {}
  rw = RW.Rewards(["kw"], [lambda prompts, completions, **kw: seen.update(kw) or [1.0] * len(completions)], [1.0])
  rw(["p"], ["c"], [{"answer": "a", "prompt": "p", "_completion_tokens": 3}], [[7, 8]])
  # the JSONL columns but `prompt`, the ids, and TRL's trainer_state, log_metric and log_extra (their own test below)
  assert {k: v for k, v in seen.items() if k not in ("trainer_state", "log_metric", "log_extra")} == \
      {"completion_ids": [[7, 8]], "answer": ["a"]}
  assert set(seen) == {"completion_ids", "answer", "trainer_state", "log_metric", "log_extra"}
  for out, msg in (([1.0], "returned 1 values for 2 completions"), (3.0, "returned float, not a list of 2")):
    rw = RW.Rewards(["bad"], [lambda completions, out=out: out], [1.0])
    with pytest.raises(RW.RewardFailed, match=f"rl.reward=bad: .*{msg}"):
      rw(["p", "q"], ["c", "d"], [{}, {}])


# TRL's documented reward that logs (docs/source/grpo_trainer.md at f2cd577, "Example 6: Logging extra columns and
# metrics"), unchanged.
def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
  extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
  extracted = [m.group(1) if m else None for m in extracted]
  rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

  if log_extra:
    log_extra("golden_answer", list(ground_truth))
    log_extra("extracted_answer", [e or "[none]" for e in extracted])

  if log_metric:
    log_metric("accuracy", sum(rewards) / len(rewards))

  return rewards


def test_trls_trainer_state_log_metric_and_log_extra_reach_a_per_step_reward():
  """TRL's per-step form gets trainer_state (the step: a curriculum reward's global_step / max_steps), log_metric (the
  step's mean of each name, Scored.metrics) and log_extra (a column per completion, Scored.extra), by keyword, or
  only those it names without **kwargs. TRL's Example 6 runs as written. Controls: without a trainer_state the
  curriculum reward fails on every completion (what a TRL reward reading it did before: exit 2); a column of the
  wrong length or a metric that is no number is that reward's failure, with its message."""
  from meshlm.rl import rewards as RW
  state = RW.TrainerState(global_step=3, max_steps=12, epoch=0.5, num_train_epochs=2, is_world_process_zero=True,
                          is_local_process_zero=True)

  def curriculum(completions, **kwargs):
    progress = kwargs["trainer_state"].global_step / kwargs["trainer_state"].max_steps
    return [progress * len(c) for c in completions]

  def named(completions, log_metric):  # no **kwargs: gets what it names
    log_metric("twice", 1.0)
    log_metric("twice", 2.0)
    return [0.0] * len(completions)
  rw = RW.Rewards(["reward_func", "curriculum", "named"], [reward_func, curriculum, named], [1.0, 1.0, 1.0])
  completions = [r"so \boxed{12}", r"\boxed{7}", "no box", r"\boxed{3}"]
  sc = rw(["p"] * 4, completions, [{"ground_truth": g} for g in ("12", "8", "5", "3")], state=state)
  assert sc.each["reward_func"] == [1.0, 0.0, 0.0, 1.0]
  assert sc.each["curriculum"] == [0.25 * len(c) for c in completions]
  assert sc.metrics == {"accuracy": 0.5, "twice": 1.5}
  assert sc.extra == {"golden_answer": ["12", "8", "5", "3"], "extracted_answer": ["12", "7", "[none]", "3"]}
  with pytest.raises(RW.RewardFailed, match=r"curriculum failed on every one of the step's 4 completions; the first "
                                            r"raised AttributeError: 'NoneType' object has no attribute 'global_step'"):
    RW.Rewards(["curriculum"], [curriculum], [1.0])(["p"] * 4, completions, [{}] * 4)
  short = lambda completions, log_extra: log_extra("x", [1]) or [1.0] * len(completions)  # noqa: E731
  word = lambda completions, log_metric: log_metric("m", "high") or [1.0] * len(completions)  # noqa: E731
  for f, msg in ((short, r"raised ValueError: log_extra\('x', ...\): 1 values for 2 completions"),
                 (word, r"raised TypeError: log_metric\('m', ...\): str 'high' is not a number")):
    with pytest.raises(RW.RewardFailed, match=msg):
      RW.Rewards(["f"], [f], [1.0])(["p"] * 2, ["a", "b"], [{}] * 2, state=state)


def test_async_rewards_are_awaited_together():
  """async def rewards, per step (TRL's) and per completion, are awaited, all of a step's at once (TRL's
  asyncio.gather): `left` and `right` each wait for the other, which only concurrent awaiting lets finish; a sync
  reward beside them runs as before, and an async one that raises on every completion stops the run with its error.
  Control: `left` awaited alone waits for `right` in vain (cut by its timeout)."""
  import asyncio
  from meshlm.rl import rewards as RW
  events = {}

  async def meet(me, other, timeout):
    ev = events.setdefault(me, asyncio.Event()), events.setdefault(other, asyncio.Event())
    ev[0].set()
    await asyncio.wait_for(ev[1].wait(), timeout)

  async def left(completions, timeout=60, **kwargs):
    await meet("left", "right", timeout)
    return [1.0] * len(completions)

  async def right(prompts, completions, **kwargs):
    await meet("right", "left", 60)
    return [2.0] * len(completions)

  async def per(prompt, completion, row):
    await asyncio.sleep(0)
    return float(len(completion))
  rw = RW.Rewards(["left", "right", "per", "sync"], [left, right, per, lambda p, c, row: 0.5], [1.0] * 4)
  sc = rw(["p", "q"], ["ab", "c"], [{}, {}])
  assert sc.each == {"left": [1.0, 1.0], "right": [2.0, 2.0], "per": [2.0, 1.0], "sync": [0.5, 0.5]}
  assert sc.total == [5.5, 4.5]

  async def boom(completions, **kwargs):
    raise KeyError("answer")
  with pytest.raises(RW.RewardFailed, match=r"rl.reward=boom failed on every one of the step's 2 completions; the "
                                            r"first raised KeyError: 'answer'"):
    RW.Rewards(["boom"], [boom], [1.0])(["p", "q"], ["a", "b"], [{}, {}])
  events.clear()
  with pytest.raises(asyncio.TimeoutError):
    asyncio.run(left(["a"], timeout=0.2))


def test_what_rewards_log_reaches_metrics_jsonl_and_completions_jsonl(prompts, reward_file, tmp_path, monkeypatch):
  """An async TRL reward that reads trainer_state and calls log_metric and log_extra, through `meshlm rl`'s trainer:
  its metrics are in the step's metrics.jsonl record under their names (max_steps 1, global_step 0 at the first
  step), its column in completions.jsonl's rollout rows. A metric named like one of meshlm's own stops the run
  naming it (with_logged; control: another name passes)."""
  from meshlm.rl.rewards import RewardFailed
  monkeypatch.setattr(R, "sample", made_sampler(0))
  cfg = load_config(*DENSE, f"rl.prompts={prompts}", "cpu_devices=1", f"rl.reward={reward_file}:logging_spread",
                    "rl.mask_truncated_completions=true", "train.steps=1", "rl.log_completions=3",
                    f"run_dir={tmp_path}/r")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", TR.ClipWindowWarning)  # the stand-in sampler's log-probs are far off the model's
    TR.run(cfg, show_progress=False)
  (rec,) = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
  rows = [json.loads(ln) for ln in (tmp_path / "r" / TR.COMPLETIONS).read_text().splitlines()]
  assert (rec["max_steps"], rec["global_step"]) == (1, 0) and rec["mean_chars"] > 0
  assert [r["extra"] for r in rows] == [{"first_char": r["completion"][:1]} for r in rows] and len(rows) == 3
  with pytest.raises(RewardFailed, match=r"step 4: a reward's log_metric named 'loss', a metric meshlm logs itself"):
    TR.with_logged({"loss": 1.0}, {"loss": 2.0}, 4)
  with pytest.raises(RewardFailed, match="named 'step'"):
    TR.with_logged({"loss": 1.0}, {"step": 2.0}, 4)
  assert TR.with_logged({"loss": 1.0}, {"accuracy": 0.5}, 4) == {"loss": 1.0, "accuracy": 0.5}


# TRL's documented conversational reward (docs/source/grpo_trainer.md, "Example 2: Reward completions with a specific
# format"), unchanged.
def format_reward_func(completions, **kwargs):
  """Reward function that checks if the completion has a specific format."""
  pattern = r"^<think>.*?</think><answer>.*?</answer>$"
  completion_contents = [completion[0]["content"] for completion in completions]
  matches = [re.match(pattern, content) for content in completion_contents]
  return [1.0 if match else 0.0 for match in matches]


def test_a_trl_reward_for_conversational_prompts_runs_unchanged(made_cispo):
  """Conversational prompts give the per-step form TRL's shapes: prompts as their messages (copies: a reward may edit
  them), completions as [{"role": "assistant", "content": text}]; TRL's own example reward scores TRL's example
  completions [1.0, 0.0] through the trainer's scoring. The per-completion form keeps strings (the rendered prompt).
  Negative control: on plain-text prompts the same reward fails on every completion, and the message says which
  shapes it got."""
  import types
  from meshlm.rl import rewards as RW
  tr, _, _ = made_cispo
  user = [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}]
  texts = ["<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>",
           "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."]
  chat = [R.Prompt("<rendered>", [1, 2], {"prompt": user, "answer": "12"}, user)] * 2
  gen = types.SimpleNamespace(lengths=np.array([3, 4]), token_lists=lambda: [[5, 6, 7], [5, 6, 7, 8]])
  seen, per = {}, []

  def spy(prompts, completions, **kw):
    prompts[0].append({"role": "assistant", "content": "edited"})  # TRL's trainer pops; ours must not see it
    seen.update(prompts=prompts, completions=completions)
    return [0.0] * len(completions)
  saved = tr.rewards
  try:
    tr.rewards = RW.Rewards(["format_reward_func", "spy", "per"], [format_reward_func, spy,
                            lambda p, c, row: per.append((p, c, row["prompt"])) or 0.0], [1.0, 1.0, 1.0])
    sc = tr._score(chat, gen, texts)
    assert sc.each["format_reward_func"] == [1.0, 0.0] and sc.total == [1.0, 0.0]
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in texts]
    assert seen["prompts"][1] == user and chat[0].messages == user and len(seen["prompts"][0]) == 2
    assert per == [("<rendered>", t, user) for t in texts]  # the per-completion form: strings, messages in the row
    plain = [R.Prompt("What is (1 + 2) * 4?", [1, 2], {"prompt": "What is (1 + 2) * 4?"})] * 2
    tr.rewards = RW.Rewards(["format_reward_func"], [format_reward_func], [1.0])
    with pytest.raises(RW.RewardFailed, match=r"format_reward_func failed on every one of the step's 2 completions; "
                                              r"the first raised TypeError: string indices must be integers.*; it was "
                                              r"called with TRL's standard shapes: prompts and completions as strings"):
      tr._score(plain, gen, texts)
  finally:
    tr.rewards = saved


def test_nan_is_reported_as_nan_and_exclude_sums_what_scored():
  """A reward returning NaN on every completion stops the run saying it returned nan (not "raised"); a reward
  failing on some scores 0 (zero) or is left out of the weighted sum (exclude, TRL's nansum), and a completion that
  no reward scored is NaN, for its group to leave out. Counters: raised (errors) apart from NaN (nans)."""
  from meshlm.rl import rewards as RW
  nan = lambda p, c, row: float("nan")  # noqa: E731
  with pytest.raises(RW.RewardFailed, match=r"rl.reward=nan failed on every one of the step's 2 completions; the "
                                            r"first returned nan; it was called with f\(prompt: str"):
    RW.Rewards(["nan"], [nan], [1.0])(["p", "q"], ["c", "d"], [{}, {}])
  flaky = lambda p, c, row: {"a": 1.0, "b": float("inf")}.get(c) if c != "r" else row["x"]  # noqa: E731
  for failed, want in (("zero", [3.0, 2.0, 2.0, 2.0]), ("exclude", [3.0, 2.0, 2.0, 2.0])):
    rw = RW.Rewards(["flaky", "two"], [flaky, lambda p, c, row: 1.0], [1.0, 2.0], failed=failed)
    sc = rw(["p"] * 4, ["a", "b", "r", "zzz"], [{}] * 4)
    assert sc.total == want  # zero: the failures score 0; exclude: left out of the sum (the same totals here)
    assert rw.errors == {"flaky": 1, "two": 0} and rw.nans == {"flaky": 1, "two": 0}
    assert rw.nones == {"flaky": 1, "two": 0}  # zzz: None, scored 0 under zero and counted, never a failure
    assert sc.failures["flaky"].first == "returned inf" and sc.failures["flaky"].total == 2
  rw = RW.Rewards(["flaky"], [flaky], [1.0], failed="exclude")
  sc = rw(["p"] * 3, ["a", "b", "zzz"], [{}] * 3)  # b: inf (failure); zzz: None (no reward)
  assert sc.total[0] == 1.0 and np.isnan(sc.total[1]) and np.isnan(sc.total[2])
  # Control: zero scores both 0
  assert RW.Rewards(["flaky"], [flaky], [1.0], failed="zero")(["p"] * 3, ["a", "b", "zzz"], [{}] * 3).total == \
      [1.0, 0.0, 0.0]


def test_trls_spellings_are_taken_or_name_the_meshlm_key():
  """TRL's values that mean the same are taken (scale_rewards true / false, top_k=0 for off); TRL's key names are
  refused in one line naming meshlm's key and value. Controls: values that mean nothing still fail."""
  from meshlm.errors import ConfigError
  rl = lambda *a: load_config(*a).rl  # noqa: E731
  assert rl("rl.scale_rewards=true").scale_rewards == "group" and rl("rl.scale_rewards=false").scale_rewards == "none"
  assert rl("rl.top_k=0").top_k is None and rl("rl.top_k=5").top_k == 5
  for arg, msg in (("rl.loss_type=dapo", "rl.loss_type=dapo: TRL's spelling; meshlm's is rl.loss_agg=token_mean"),
                   ("rl.loss_type=dr_grpo", "rl.loss_type=dr_grpo: TRL's spelling; meshlm's is rl.loss_agg=constant"),
                   ("rl.loss_type=ppo", "rl.loss_type: TRL's name; meshlm spells its values as dapo: rl.loss_agg="),
                   ("rl.max_completion_length=64", "rl.max_completion_length: TRL's name; meshlm's key is "
                                                    "rl.max_new_tokens"),
                   ("rl.top_k=-1", "rl.top_k: Input should be greater than 0"),
                   ("rl.scale_rewards=yes please", "rl.scale_rewards: Input should be 'group', 'batch' or 'none'")):
    with pytest.raises(ConfigError, match=re.escape(msg)):
      load_config(arg)


@pytest.mark.parametrize("arg, msg", [
    ("rl.failed_reward=drop", r"rl.failed_reward: Input should be 'zero' or 'exclude' \(got 'drop'\)"),
    ("rl.policy_loss=ppo", r"rl.policy_loss: Input should be 'clip' or 'cispo'"),
    ("rl.delta=0.5", r"rl.delta: Input should be greater than 1"),
    ("rl.delta=1.1", r"rl.delta=1.1 must be above 1 \+ rl.epsilon_high = 1.2"),
    ("rl.policy_loss=cispo rl.delta=2", r"rl.delta=2.0: caps the clipped objective's ratio"),
    ("rl.cispo_cap=0", r"rl.cispo_cap: Input should be greater than 0"),
    ("rl.loss_agg=bnp", r"rl.loss_agg: Input should be .*'bnpo'"),
    ("rl.mask_truncated_completions=maybe", r"rl.mask_truncated_completions: Input should be a valid boolean"),
    ("rl.top_entropy_quantile=1.5", r"rl.top_entropy_quantile: Input should be less than or equal to 1"),
    ("rl.kl_estimator=k2", r"rl.kl_estimator: Input should be 'k3' or 'k3_ratio'"),
    ("rl.sampler_is=token_clip", r"rl.sampler_is: Input should be .*'sequence_mask'"),
    ("rl.sampler_is=token_mask rl.sampler_is_min=3", r"rl.sampler_is_min=3.0 must be below rl.sampler_is_cap=2.0"),
    ("rl.sampler_is_min=0.5", r"rl.sampler_is_min=0.5 bounds the sampler_is weight, and rl.sampler_is is none"),
    ("rl.eval_prompts=0", r"rl.eval_prompts: give a count above 0"),
    ("rl.eval_every=5 rl.eval_prompts=no_such.jsonl", r"rl.eval_prompts=no_such.jsonl: no such file"),
    ("rl.max_new_tokens=100", r"rl.max_new_tokens=100 leaves no room for a prompt within model.max_position=64"),
    ("rl.reward=[exact_match,exact_match]", r"rl.reward lists exact_match twice"),
])
def test_each_new_key_refuses_bad_values_in_one_line(tmp_path, capsys, prompts, arg, msg):
  import re
  code = cli.main(["rl", *SMALL, *RL, f"rl.prompts={prompts}", f"run_dir={tmp_path}/run", "cpu_devices=1",
                   *arg.split()])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and re.search(msg, err[0]), err
  assert not (tmp_path / "run").exists()


def test_rl_help_lists_every_new_key(capsys):
  assert cli.main(["rl", "--help"]) == 0
  out = capsys.readouterr().out
  for key in ("failed_reward", "policy_loss", "delta", "cispo_cap", "mask_truncated_completions",
              "top_entropy_quantile", "kl_estimator", "sampler_is_min", "eval_prompts"):
    assert re.search(rf"^\s*rl\.{key}\b", out, re.M), key
  assert "bnpo" in out and "token_mask" in out and "path/to/file.py" in out


def test_the_clip_window_warning_speaks_once_past_half_and_not_below(prompts):
  """ClipWindowWarning (rl/trainer.check_window) reads the first iteration's ratio_outside_window: above half of
  the tokens it warns, once per run; at 0.4 it does not, nor with rl.sampler_is on (the ratio then starts at 1) or
  under cispo (no window)."""
  import types
  import warnings as W
  cfg = _cfg(prompts, "rl.ratio_level=sequence", "rl.epsilon=3e-4", "rl.epsilon_high=4e-4")
  m = lambda out: {"ratio_outside_window": out, "logp_gap_mean": 1.5e-3, "ratio_min": 0.998, "ratio_max": 1.002}  # noqa
  for c, out, warns in ((cfg, 0.4, False), (cfg, 0.9, True),
                        (cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"sampler_is": "sequence"})}), 0.9, False),
                        (cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"policy_loss": "cispo"})}), 0.9, False)):
    tr = types.SimpleNamespace(cfg=c, window_warned=False)
    with W.catch_warnings(record=True) as got:
      W.simplefilter("always")
      TR.Trainer.check_window(tr, m(out), 0)
      TR.Trainer.check_window(tr, m(out), 1)
    hits = [g for g in got if issubclass(g.category, TR.ClipWindowWarning)]
    assert len(hits) == int(warns), (out, c.rl.sampler_is, c.rl.policy_loss)
    if warns:
      assert "step 0: before any update, 90% of the completion tokens' ratios" in str(hits[0].message)
      assert "[1 - 0.0003, 1 + 0.0004]" in str(hits[0].message)
