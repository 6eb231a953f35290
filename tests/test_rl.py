"""`meshlm rl` on a small qwen3-moe (float32): rollouts, the RL step, replay, the frozen router, resume.

- Replay is exact: with rl.router_replay=true the training forward's expert ids equal the sampler's for
  every fed token and MoE layer, bit for bit, and the first iteration's ratio is 1 within 1e-5 at every
  step, with top_p=0.9 and temperature 0.7 (the trainer scores under the sampler's truncation); the
  negative control scoring without the truncation shows the kept-mass bias (mean ratio well below 1).
- With replay off, a perturbed router makes the trainer route otherwise and the step reports the flips;
  the unperturbed router reports none.
- 20 RL steps leave the frozen router bit-unchanged; the census of the RL step has no router weight-
  gradient dot (and has them when nothing is frozen: control).
- SIGTERM after step 9 saves checkpoint 10; 10 + 10 steps (the resume) equal 20 straight, in rewards,
  losses and parameters.
- Explicit and auto sharding give the same RL losses within 1e-5 on fsdp=4.
- Bad input: one line, exit 2.
"""
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import cli
from meshlm.commands.resolve import load_config
from meshlm.models import decoder
from meshlm.rl import rollout as R
from meshlm.rl import step as RS
from meshlm.rl import toy
from meshlm.rl import trainer as TR
from meshlm.rl.rewards import Rewards

SMALL = ("model=qwen3-moe-tiny", "train.compute_dtype=float32", "model.embed_dim=64", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "model.moe_mlp_dim=32",
         "model.vocab_size=257", "model.max_position=64", "train.seq_len=32")
RL = ("rl.prompts_per_step=2", "rl.num_generations=4", "rl.max_new_tokens=8", "rl.temperature=0.7", "rl.top_p=0.9",
      "rl.reward=[meshlm.rl.toy:reverse_reward]", "train.learning_rate=1e-2", "train.warmup_steps=0",
      "checkpoint.every=10")
REPLAY = ("rl.router_replay=true", r"train.freeze=['.*\.router']")
ROUTER = "layers.moe.moe.router"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  d = tmp_path_factory.mktemp("toy")
  path, _ = toy.write(str(d), 40, 0, 3, 6)
  return path


def _cfg(prompts, *extra, devices=1):
  return load_config(*SMALL, *RL, f"rl.prompts={prompts}", f"cpu_devices={devices}", *extra)


@pytest.fixture(scope="module")
def runs(prompts, tmp_path_factory):
  """20 RL steps straight, and 10 + 10 with a resume (router replay on, router frozen)."""
  root = tmp_path_factory.mktemp("runs")
  straight = TR.run(_cfg(prompts, *REPLAY, "train.steps=20", f"run_dir={root}/a"), show_progress=False)
  # SIGTERM once step 9's metrics are read: the loop saves checkpoint 10 and stops, as on a preemption.
  term = lambda i: os.kill(os.getpid(), signal.SIGTERM) if i == 9 else None  # noqa: E731
  first = TR.run(_cfg(prompts, *REPLAY, "train.steps=20", f"run_dir={root}/b"), show_progress=False, on_step=term)
  resumed = TR.run(_cfg(prompts, *REPLAY, "train.steps=20", f"run_dir={root}/b"), show_progress=False)
  records = [json.loads(ln) for ln in open(f"{root}/b/metrics.jsonl")]
  return straight, (first, resumed), records


def test_first_iteration_ratio_is_one_under_top_p_at_every_step(runs):
  straight, _, _ = runs
  assert len(straight.records) == 20
  for r in straight.records:
    assert abs(r["ratio_mean"] - 1) <= 1e-5 and abs(r["ratio_max"] - 1) <= 1e-5 and abs(r["ratio_min"] - 1) <= 1e-5
    assert r["logp_gap_max"] <= 1e-5
    assert r["router_flips_any_layer"] == 0.0  # replayed
  # the run learned something (the parameters moved and the loss is not zero)
  assert any(abs(x) > 0 for x in straight.losses)


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
  assert resumed.start_step == 10 and [r["step"] for r in records] == list(range(20))
  assert [r["reward_mean"] for r in records] == straight.rewards
  assert [r["loss"] for r in records] == [r["loss"] for r in straight.records]
  for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Control: the rewards are not constant, so equal lists say something.
  assert len(set(straight.rewards)) > 1


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


def test_trainer_expert_ids_equal_the_samplers_bit_for_bit(rollout):
  tr, state, batch = rollout
  fwd = jax.jit(lambda p, b: RS._forward(tr.cfg, p, b, True)[1])
  with jax.set_mesh(tr.mesh):
    live = np.asarray(fwd(tr.params_of(state), batch))  # [L, B, T, k]
    free = np.asarray(jax.jit(lambda p, b: RS._forward(tr.cfg, p, b, False)[1])(tr.params_of(state), batch))
  rec = np.moveaxis(np.asarray(batch["forced_expert_ids"]), 2, 0)
  fed = rec[..., 0] >= 0
  assert fed.sum() > 100 and fed[..., 0].all()
  np.testing.assert_array_equal(live[fed], rec[fed])
  # The unforced training forward routes as the sampler did too (same params, float32).
  np.testing.assert_array_equal(free[fed], rec[fed])


def test_untruncated_scoring_shows_the_kept_mass_bias(rollout):
  """The control: the trainer scores with the temperature only (rl.score_truncated=false), so each ratio
  is the kept mass of top-p (< 1), while the truncated scoring gives 1."""
  tr, state, batch = rollout
  with jax.set_mesh(tr.mesh):
    logits = jax.jit(lambda p, b: RS._forward(tr.cfg, p, b, True)[0])(tr.params_of(state), batch)
  mask = np.asarray(batch["loss_mask"]) > 0
  samp = np.asarray(batch["sampler_logp"])
  ratio = lambda c: np.exp(np.asarray(RS.score(c, logits, batch["targets"])[0]) - samp)[mask]  # noqa: E731
  kept = ratio(tr.cfg)
  untrunc = ratio(tr.cfg.model_copy(update={"rl": tr.cfg.rl.model_copy(update={"score_truncated": False})}))
  assert abs(kept.mean() - 1) <= 1e-5
  assert untrunc.mean() < 0.97 and np.all(untrunc <= 1 + 1e-5)


def test_replay_off_reports_the_router_flips_of_a_perturbed_router(rollout):
  """The RL loss with rl.router_replay=false (forward only: the metrics are the loss's) on a rollout
  sampled with a perturbed router reports flips in every MoE layer; sampled with the trainer's own
  router it reports none."""
  tr, state, batch = rollout
  off = tr.cfg.model_copy(update={"rl": tr.cfg.rl.model_copy(update={"router_replay": False})})
  rows = tr.cfg.rl.prompts_per_step * tr.cfg.rl.num_generations
  metrics = jax.jit(lambda p, b: RS.rl_loss(off, p, b, jnp.sum(b["loss_mask"]), num_rows=rows)[1])
  params = tr.params_of(state)
  noisy = jax.tree.map(lambda a: a, params)
  r = noisy["layers"]["moe"]["moe"]["router"]
  noisy["layers"]["moe"]["moe"]["router"] = r + 0.5 * jax.random.normal(jax.random.key(1), r.shape) * jnp.std(r)
  perturbed = tr.rollout(state._replace(params=decoder.split_state(tr.cfg, noisy)[0]), 1)
  with jax.set_mesh(tr.mesh):
    m = metrics(params, perturbed)
    same = metrics(params, batch)
  flips = [float(m[f"router_flips_layer{i}"]) for i in range(3)]
  assert min(flips) > 0.01 and float(m["router_flips_any_layer"]) > max(flips)
  assert abs(float(m["ratio_mean"]) - 1) > 1e-3
  # Control: sampled by the trainer's own router, nothing flips and the ratio is 1.
  assert float(same["router_flips_any_layer"]) == 0.0 and abs(float(same["ratio_mean"]) - 1) <= 1e-5


def test_sampler_is_and_the_kl_reference_score_the_rollout_with_the_trainer(prompts):
  """rl.sampler_is=token and rl.beta > 0: the trainer scores the rollout (old policy, and the reference,
  here the same parameters) with the sampler's truncation, so at the first update the IS weight and
  the ratio are 1 and the KL is 0, up to the train/sample gap."""
  tr = TR.Trainer(_cfg(prompts, *REPLAY, "rl.sampler_is=token", "rl.beta=0.1"))
  state = tr.step.init_state(jax.random.key(0))
  tr.ref = jax.tree.map(jnp.copy, tr.params_of(state))
  batch = tr.rollout(state, 0)
  mask = np.asarray(batch["loss_mask"]) > 0
  old, samp = np.asarray(batch["old_logp"]), np.asarray(batch["sampler_logp"])
  assert mask.sum() > 50 and np.max(np.abs(old - samp)[mask]) <= 1e-5 and np.any(old[mask] != samp[mask])
  np.testing.assert_array_equal(np.asarray(batch["ref_logp"]), old)
  _, m, _ = tr.updates(state, batch)
  assert abs(float(m["sampler_is_mean"]) - 1) <= 1e-5 and abs(float(m["ratio_mean"]) - 1) <= 1e-5
  assert abs(float(m["kl"])) <= 1e-6 and np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0


def test_census_of_the_rl_step_has_no_router_weight_gradient_dot(prompts):
  from meshlm.analysis.census import moe_counts, stablehlo_counts
  ps = R.load_prompts(_cfg(prompts), _byte())

  def router_dots(*extra):
    step = RS.build_rl_step(TR.rl_config(_cfg(prompts, "rl.router_replay=true", *extra), ps, 1))
    _, _, mod = stablehlo_counts(step.lower().as_text(debug_info=True))
    return moe_counts(mod)["weight_grad_dots"]
  frozen, trained = router_dots(r"train.freeze=['.*\.router']"), router_dots()
  assert not [k for k in frozen if "router" in k] and frozen["layers/mlp/moe/experts/down"] > 0
  # Control: a trained router has its weight-gradient dot in each of the 3 scanned MoE layers; nothing else changes.
  assert trained.pop("layers/mlp/moe/router") == 3 and trained == frozen


def test_explicit_and_auto_losses_agree_on_fsdp4(prompts, rollout):
  """Two layers (a dense one, one MoE) to keep the two compiles cheap; the rollout's batch with its first
  MoE layer's ids and made-up advantages (the untrained model's rewards are all 0)."""
  _, _, batch = rollout
  host = jax.tree.map(np.asarray, batch)
  host["forced_expert_ids"] = host["forced_expert_ids"][:, :, :1]
  host["advantages"] = np.linspace(-1.0, 1.5, host["advantages"].shape[0]).astype(np.float32)
  out = {}
  for mode in ("explicit", "auto"):
    tr_cfg = TR.rl_config(_cfg(prompts, *REPLAY, "model.num_layers=2", "mesh.fsdp=4", f"shard_mode={mode}",
                               devices=4), R.load_prompts(_cfg(prompts), _byte()), 4)
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
  total, each = rw(["p", "p", "p"], ["12", "x", "12"], [{"answer": "12"}, {"answer": "12"}, {}])
  # the third row has no answer: both rewards raise there, score 0 and are counted
  assert total == [1.5, 0.0, 0.0] and each["numeric_match"] == [1.0, 0.0, 0.0]
  assert rw.errors == {"exact_match": 1, "numeric_match": 1}


@pytest.mark.parametrize("case, msg", [
    ("empty", "rl.prompts=.*: empty"),
    ("long", "line 2's prompt is 70 tokens, longer than model.max_position - rl.max_new_tokens = 64 - 8 = 56"),
    ("groups", "rl.num_generations=1: GRPO normalizes"),
    ("unknown", "rl.reward=exactly: unknown reward"),
    ("import", "rl.reward=no_such_module_xyz:f: cannot import it"),
    ("dense", "rl.router_replay=true: llama2-tiny is dense"),
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
  code = cli.main(["rl", *args])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and re.search(msg, err[0]), err
  assert not (tmp_path / "run").exists()


def test_rows_of_a_gdn_hybrid_on_context_shards_are_whole_chunks(prompts):
  """The RL step's row length T (the longest prompt + rl.max_new_tokens, rounded up) is one the train step takes:
  on mesh.context, a Gated DeltaNet hybrid runs whole chunks per shard, so T is a multiple of context x
  model.gdn_chunk_size. Before, T was only a multiple of 8, and `meshlm rl` stopped at its first rollout with a
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
