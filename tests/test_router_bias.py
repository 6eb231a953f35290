"""The routing bias of group-limited sigmoid routing as model state (models/ffns/moe.py, routing="group_sigmoid"),
through the real train step, on the tests' groupkind family (gqa + DeepSeek-V3's MoE feed-forward).

router_bias [L, E] is not a parameter (the optimizer never sees it); after each step
bias += rate * sign(mean load - load) from the routed (token, slot) pairs of the whole global batch,
padding excluded, summed over devices and micro-batches. With rate > 0 a skewed start balances; at
rate 0 it never moves; on 4 devices with 2 micro-batches it moves by the whole batch's counts; a
checkpoint resumes it exactly.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.models import decoder, registry
from meshlm.models.params import merge_state, model_state_specs, split_state
from meshlm.train import step as ST

RATE = 0.02
SKEW = np.array([0.45, 0.4, 0.1, 0.0, 0.0, -0.1, -0.3, -0.3], np.float32)  # favours group 0's experts
BASE = ("model=llama2-tiny", "model.family=groupkind", "model.embed_dim=64", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "model.parts.moe.num_experts=8",
        "model.parts.moe.num_experts_per_tok=2", "model.parts.moe.mlp_dim=16", "model.parts.moe.shared_expert_mlp_dim=16",
        "model.parts.moe.router_scoring=sigmoid", "model.parts.moe.n_group=4", "model.parts.moe.topk_group=2", "model.parts.moe.routed_scaling_factor=2.5",
        "train.compute_dtype=float32", "train.seq_len=16", "train.warmup_steps=0", "train.sample_tokens=0",
        "train.learning_rate=1e-4", "data.source=synthetic")
ONE = ("cpu_devices=1", "train.per_device_batch_size=8")
# Only the final norm trains: the routing (and so the load) moves by the bias alone, and the step's
# backward is small to compile. The optimizer still updates a parameter and keeps its moments.
FROZEN = ("train.freeze=['layers\\..*', 'embed', 'lm_head']",)
FOUR = ("cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=2", "train.micro_batches=2")


@pytest.fixture(autouse=True)
def registered(monkeypatch):
  monkeypatch.setitem(registry.FAMILIES, "groupkind", "groupkind")


def _batch(step):
  """A fixed batch whose rows 4 and 6 end in padding (segment 0, no loss) from position 9, and whose odd
  rows (the second of two micro-batches, rows i, 2 + i, ...) are real tokens without loss (a prompt):
  routed and counted, with no share of the loss."""
  rng = np.random.default_rng(0)
  B, T = step.global_batch, step.cfg.train.seq_len
  toks = rng.integers(0, step.cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[[4, 6], 9:] = 0
  loss = seg.astype(np.float32)
  loss[1::2] = 0.0
  return step.put_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": loss,
                         "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                         "segment_ids": seg})


def _bias(state):
  return np.asarray(state.model_state["layers"]["moe"]["moe"]["router_bias"])


def _skewed(step, state):
  leaf = state.model_state["layers"]["moe"]["moe"]["router_bias"]
  skew = jax.device_put(jnp.broadcast_to(jnp.asarray(SKEW), leaf.shape), leaf.sharding)
  return ST.TrainState(state.step, state.params, state.opt_state, {"layers": {"moe": {"moe": {"router_bias": skew}}}})


def _setup(*keys):
  mp = pytest.MonkeyPatch()
  mp.setitem(registry.FAMILIES, "groupkind", "groupkind")
  cfg = load_config(*BASE, *keys)
  step = ST.build_train_step(cfg)
  return mp, cfg, step, _skewed(step, step.init_state(jax.random.key(0))), _batch(step)


def _np(state):
  return jax.tree.map(np.asarray, state)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """50 steps at RATE on 4 devices (fsdp) with 2 micro-batches, from the skewed bias: the whole batch's
  load (a forward's side output, no micro-batches) before each of the first 3 steps and after the
  50th, the bias after each of the first 3, the state after 6, and a checkpoint written after 3."""
  from meshlm.train.checkpoint import Checkpointer
  mp, cfg, step, state, batch = _setup(*FOUR, f"model.parts.moe.router_bias_update_rate={RATE}", *FROZEN,
                                       f"run_dir={tmp_path_factory.mktemp('bias')}")
  try:
    fwd = jax.jit(lambda st, b: decoder.forward(cfg, merge_state(st.params, st.model_state), b["inputs"],
                                                b["positions"], b["segment_ids"], return_side=True)[1]["moe_expert_load"])
    start = _np(state)
    ckpt = Checkpointer(cfg, warn=lambda s: None)
    loads, biases, out = [], [], {}
    for i in range(1, 51):
      if i <= 3:
        with jax.set_mesh(step.mesh):
          loads.append(np.asarray(fwd(state, batch)))
      state, _ = step(state, batch)  # donates the state: read it before
      if i <= 3:
        biases.append(_bias(state))
      if i == 3:
        ckpt.save(3, state, jax.random.key(0), {}, {})
      if i == 6:
        out["state6"] = _np(state)
    ckpt.wait()
    with jax.set_mesh(step.mesh):
      load50 = np.asarray(fwd(state, batch))
    restored = ckpt.restore_latest(step.abstract_state())
    ckpt.close()
    yield dict(out, cfg=cfg, step=step, batch=batch, start=start, loads=loads, biases=biases, load50=load50,
               restored=restored)
  finally:
    mp.undo()


def _cv(load_LE):
  return float(np.mean(np.std(load_LE, axis=-1) / np.mean(load_LE, axis=-1)))


def test_the_bias_is_model_state_not_a_parameter(run):
  cfg = run["cfg"]
  assert model_state_specs(cfg)["layers"]["moe"]["moe"]["router_bias"].shape == (cfg.model.num_layers, 8)
  assert "router_bias" not in run["start"].params["layers"]["moe"]["moe"]
  assert not any("router_bias" in p for p in jax.tree.leaves(ST.param_paths(cfg)))  # not in the optimizer
  assert "shared_expert_gate" not in run["start"].params["layers"]["moe"]["moe"]  # shared experts without a gate
  assert run["start"].params["layers"]["moe"]["moe"]["shared_gate"].shape == (cfg.model.num_layers, 64, 16)


def test_each_step_moves_the_bias_by_the_rule_from_the_whole_batch(run):
  """bias += rate * sign(mean load - load) with the load of the whole global batch's real tokens (a
  forward of the whole batch), though the step counts it on 4 fsdp shards in 2 micro-batches; the
  second micro-batch has no loss tokens, so a count weighted by each micro-batch's token share (what
  "mean" side outputs get) would leave its tokens out (checked by hand with after_step_side=
  {"moe_expert_load": "mean"}: the third step then moves layer 0's expert 2 to 0.12, not 0.08)."""
  real = 6 * 16 + 2 * 9
  bias = np.broadcast_to(SKEW, (2, 8))
  for load, got in zip(run["loads"], run["biases"]):
    np.testing.assert_array_equal(load.sum(-1), 2 * real)  # padding's pairs are not counted
    bias = (bias + np.float32(RATE) * np.sign(load.mean(-1, keepdims=True) - load)).astype(np.float32)
    np.testing.assert_array_equal(got, bias)
  assert not np.array_equal(run["loads"][0], run["loads"][2])  # the routing moved with the bias


def test_the_load_balances_over_50_steps(run):
  cv0, cv50 = _cv(run["loads"][0]), _cv(run["load50"])
  assert cv0 > 0.8, cv0  # the skewed start: group 0's experts take most tokens
  assert cv50 < 0.5 * cv0, (cv0, cv50)


def test_at_rate_zero_the_bias_never_moves():
  """Control: from the same skewed start, three steps at rate 0 leave it bit-unchanged while the
  trainable parameters move."""
  mp, _, step, state, batch = _setup(*ONE, "model.parts.moe.router_bias_update_rate=0", *FROZEN)
  try:
    q0 = np.asarray(state.params["final_norm"])
    for _ in range(3):
      state, _ = step(state, batch)
    np.testing.assert_array_equal(_bias(state), np.broadcast_to(SKEW, (2, 8)))
    assert not np.array_equal(np.asarray(state.params["final_norm"]), q0)
  finally:
    mp.undo()


def test_resume_from_the_checkpoint_is_exact(run):
  """Saved after 3 steps through the real checkpoint code, restored and continued for 3: the state
  after 6 equals the straight run's, bit for bit, the bias included."""
  r, step, batch = run["restored"], run["step"], run["batch"]
  assert r["step"] == 3
  np.testing.assert_array_equal(np.asarray(r["model_state"]["layers"]["moe"]["moe"]["router_bias"]), run["biases"][2])
  state = ST.TrainState(jax.device_put(jnp.int32(3), step.state_shardings().step), r["params"], r["opt_state"],
                        r["model_state"])
  for _ in range(3):
    state, _ = step(state, batch)
  got, want = _np(state), run["state6"]
  np.testing.assert_array_equal(_bias(got), _bias(want))
  assert not np.array_equal(_bias(want), run["biases"][2])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_replayed_ids_bypass_the_bias_in_the_model(run):
  """forward with the forced_expert_ids layer input: ids recorded with the zero bias, replayed into the model with the
  skewed bias, give the zero-bias logits bit for bit (the bias picks experts, never weighs them);
  unforced, the skewed bias routes elsewhere and the logits differ (control)."""
  cfg, batch = run["cfg"], run["batch"]
  params = jax.tree.map(jnp.asarray, run["start"].params)  # unsharded: one device
  tokens = jnp.asarray(np.asarray(batch["inputs"]))
  skew = {"layers": {"moe": {"moe": {"router_bias": jnp.broadcast_to(jnp.asarray(SKEW), (2, 8))}}}}
  zero = {"layers": {"moe": {"moe": {"router_bias": jnp.zeros((2, 8), jnp.float32)}}}}
  fwd = jax.jit(lambda st, f: decoder.forward(cfg, merge_state(params, st), tokens, return_side=True,
                                              layer_inputs={"forced_expert_ids": f}))
  none = jnp.full((2, *tokens.shape, 2), -1, jnp.int32)
  want, side = fwd(zero, none)
  got, got_side = fwd(skew, side["moe_expert_ids"])
  np.testing.assert_array_equal(np.asarray(got_side["moe_expert_ids"]), np.asarray(side["moe_expert_ids"]))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  other, other_side = fwd(skew, none)
  assert not np.array_equal(np.asarray(other_side["moe_expert_ids"]), np.asarray(side["moe_expert_ids"]))
  assert float(jnp.max(jnp.abs(other - want))) > 1e-4


def test_generate_reads_the_bias(run):
  """generate takes the whole model tree (the bias merged in), and the bias changes what it routes
  (zero bias: other recorded expert ids). Cached against uncached decoding is the deepseek_v3
  family's test. On one device: the cheapest compile."""
  from meshlm.models.generate import generate
  from meshlm.parallel.mesh import make_mesh
  cfg, start = run["cfg"], run["start"]
  tree = {b: merge_state(start.params, {"layers": {"moe": {"moe": {"router_bias": jnp.broadcast_to(
      jnp.asarray(v, jnp.float32), (2, 8))}}}}) for b, v in (("skew", SKEW), ("zero", 0.0))}
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  mesh = make_mesh(load_config("cpu_devices=1"))
  out = {b: generate(cfg, t, prompts, max_new_tokens=4, stop_tokens=(), mesh=mesh) for b, t in tree.items()}
  assert not np.array_equal(np.asarray(out["skew"].expert_ids), np.asarray(out["zero"].expert_ids))
  assert np.all(np.asarray(out["skew"].expert_ids)[0, :5] >= 0)  # the fed prompt tokens are recorded


def test_load_params_from_carries_the_bias(run):
  """checkpoint.load_params_from (a new run from a run's parameters) restores the whole model tree:
  the checkpoint's bias comes back with the parameters (the loop splits it into the model state)."""
  from meshlm.train.checkpoint import load_params
  cfg, step = run["cfg"], run["step"]
  abstract, sh = step.abstract_state(), step.state_shardings()
  tree = load_params(cfg, cfg.run_dir, merge_state(abstract.params, abstract.model_state),
                     merge_state(sh.params, sh.model_state), step.mesh)
  params, state = split_state(cfg, tree)
  np.testing.assert_array_equal(np.asarray(state["layers"]["moe"]["moe"]["router_bias"]), run["biases"][2])
  assert not np.array_equal(run["biases"][2], np.broadcast_to(SKEW, (2, 8)))
  assert "router_bias" not in params["layers"]["moe"]["moe"]
