"""loss_impl=blockwise (nn/head_loss.py: the head and the log-softmax per block, a custom VJP) against the
materialized reference (decoder.head, then head_loss.materialized_logprobs), both through models/logprobs.py's
head_logprobs, the one place that picks: the loss, the RL
log-probs and entropy, and their gradients w.r.t. the head's input and its kernel, in float32, each with a
negative control; then a few tiny presets trained 3 steps both ways, and the compiled step's buffers."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.models import logprobs as LP
from meshlm.nn import head_loss
from meshlm.rl import step as RS
from meshlm.train import step as ST

B, T, D, V, BLOCK = 2, 7, 16, 37, 3  # T is not a multiple of the block: the last block is padded
TOL = dict(rtol=2e-5, atol=2e-6)
CASES = {"untied": [], "tied": ["model.tie_embeddings=true"], "softcap": ["model.final_logit_softcap=2.0"],
         "tied_softcap": ["model.tie_embeddings=true", "model.final_logit_softcap=2.0"]}


def _cfg(*extra):
  return meshlm.load_config("model=llama2-tiny", f"model.vocab_size={V}", f"model.embed_dim={D}",
                            f"loss_block={BLOCK}", "train.compute_dtype=float32", *extra)


def _data(seed=0, V=V):
  rng = np.random.default_rng(seed)
  # Large enough logits that the soft-cap (2.0) bends them: its slope matters in the gradient.
  x = jnp.asarray(2 * rng.standard_normal((B, T, D)), jnp.float32)
  params = {"embed": jnp.asarray(rng.standard_normal((V, D)), jnp.float32),
            "lm_head": jnp.asarray(rng.standard_normal((D, V)), jnp.float32)}
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  mask = jnp.asarray(rng.random((B, T)) > 0.3, jnp.float32).at[0, 2].set(0.0).at[1, -1].set(0.0)  # holes
  return x, params, targets, mask


def _reference_loss(cfg, params, x, targets, mask):
  return -jnp.sum(LP.head_logprobs(cfg, params, x, targets, "materialized")[0] * mask)


def _blockwise_loss(cfg, params, x, targets, mask):
  return -jnp.sum(LP.head_logprobs(cfg, params, x, targets, "blockwise")[0] * mask)


def _value_and_grads(loss, cfg, params, x, targets, mask):
  """(loss, d/dx, d/dparams) of loss(cfg, params, x, targets, mask), jitted."""
  fn = jax.jit(jax.value_and_grad(lambda p, x: loss(cfg, p, x, targets, mask), argnums=(0, 1)))
  value, (g_params, g_x) = fn(params, x)
  return value, g_x, g_params


def _close(a, b) -> bool:
  return all(np.allclose(np.asarray(u), np.asarray(v), **TOL) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
  cfg = _cfg(*CASES[request.param])
  x, params, targets, mask = _data()
  ref = _value_and_grads(_reference_loss, cfg, params, x, targets, mask)
  return cfg, (x, params, targets, mask), ref


def test_blockwise_loss_equals_the_materialized_one(case):
  cfg, (x, params, targets, mask), ref = case
  got = _value_and_grads(_blockwise_loss, cfg, params, x, targets, mask)
  np.testing.assert_allclose(got[0], ref[0], **TOL)
  np.testing.assert_allclose(got[1], ref[1], **TOL)  # d/dx
  for name in ("embed", "lm_head"):  # the head kernel (the table when tied); the other one's gradient is 0
    np.testing.assert_allclose(got[2][name], ref[2][name], **TOL)
  assert float(jnp.max(jnp.abs(ref[2]["lm_head" if cfg.model.tie_embeddings else "embed"]))) == 0.0
  assert float(jnp.max(jnp.abs(ref[1]))) > 1e-3  # the comparison has something to compare


def test_a_wrong_block_offset_fails(case, monkeypatch):
  """Targets paired with the next block's positions: the value (and gradients) differ."""
  cfg, (x, params, targets, mask), ref = case
  blocks = head_loss._blocks
  monkeypatch.setattr(head_loss, "_blocks", lambda a, nb, tb: jnp.roll(blocks(a, nb, tb), 1, axis=0)
                      if a.dtype == jnp.int32 else blocks(a, nb, tb))
  got = _value_and_grads(_blockwise_loss, cfg, params, x, targets, mask)
  assert not np.allclose(got[0], ref[0], **TOL)


def test_a_dropped_mask_fails(case):
  cfg, (x, params, targets, mask), ref = case
  got = _value_and_grads(_blockwise_loss, cfg, params, x, targets, jnp.ones_like(mask))
  assert not np.allclose(got[0], ref[0], **TOL) and not _close(got[1], ref[1])


def test_a_missing_soft_cap_derivative_fails(monkeypatch):
  cfg = _cfg(*CASES["tied_softcap"])
  x, params, targets, mask = _data()
  ref = _value_and_grads(_reference_loss, cfg, params, x, targets, mask)
  monkeypatch.setattr(head_loss, "_cap_slope", jnp.ones_like)
  got = _value_and_grads(_blockwise_loss, cfg, params, x, targets, mask)
  np.testing.assert_allclose(got[0], ref[0], **TOL)  # the forward still caps
  assert not _close(got[1], ref[1]) and not _close(got[2]["embed"], ref[2]["embed"])


# --- RL: log q(target) and the entropy of q, per token, with their gradients --------------------------------
RL_CASES = {"plain": [], "temperature_topk": ["rl.temperature=0.7", "rl.top_k=5"],
            "topp_softcap": ["rl.top_p=0.8", "model.final_logit_softcap=2.0", "model.tie_embeddings=true"]}


def _rl_value_and_grads(cfg, params, x, targets, w, blockwise: bool):
  """((logp, entropy), d/d(x, params) of sum(w0 logp + w1 entropy)): a fixed cotangent on both outputs."""
  def outs(p, x):
    return LP.head_logprobs(cfg, p, x, targets, "blockwise" if blockwise else "materialized",
                            temperature=cfg.rl.temperature, keep_fn=RS.keep_fn(cfg), entropy=True)

  def f(p, x):
    logp, ent = outs(p, x)
    return jnp.sum(w[0] * logp + w[1] * ent), (logp, ent)
  (_, vals), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
  return vals, grads


@pytest.fixture(scope="module", params=list(RL_CASES))
def rl_case(request):
  cfg = _cfg(*RL_CASES[request.param])
  x, params, targets, _ = _data(1)
  w = jnp.asarray(np.random.default_rng(2).standard_normal((2, B, T)), jnp.float32)
  return cfg, (x, params, targets, w), _rl_value_and_grads(cfg, params, x, targets, w, blockwise=False)


def test_rl_logprobs_and_entropy_equal_the_materialized_ones(rl_case):
  cfg, (x, params, targets, w), (ref_vals, ref_grads) = rl_case
  vals, grads = _rl_value_and_grads(cfg, params, x, targets, w, blockwise=True)
  np.testing.assert_allclose(vals[0], ref_vals[0], **TOL)
  np.testing.assert_allclose(vals[1], ref_vals[1], **TOL)
  assert float(jnp.mean(ref_vals[1])) > 0.1  # entropies worth comparing
  assert _close(grads, ref_grads), jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, ref_grads)


def test_rl_a_missing_entropy_gradient_fails(rl_case, monkeypatch):
  cfg, (x, params, targets, w), (ref_vals, ref_grads) = rl_case
  monkeypatch.setattr(head_loss, "_entropy_slope", lambda p, logq, ent: jnp.zeros_like(p))
  vals, grads = _rl_value_and_grads(cfg, params, x, targets, w, blockwise=True)
  np.testing.assert_allclose(vals[1], ref_vals[1], **TOL)
  assert not _close(grads[1], ref_grads[1])


def test_rl_truncation_is_scored(monkeypatch):
  """Control for the kept set: scoring the top-k case without it (keep_fn None) moves log q off the reference."""
  cfg = _cfg(*RL_CASES["temperature_topk"])
  x, params, targets, _ = _data(1)
  score = lambda impl: LP.head_logprobs(cfg, params, x, targets, impl, temperature=cfg.rl.temperature,  # noqa: E731
                                       keep_fn=RS.keep_fn(cfg))[0]
  ref = score("materialized")
  np.testing.assert_allclose(score("blockwise"), ref, **TOL)
  monkeypatch.setattr(RS, "_kept", lambda k, p, z: jnp.ones(z.shape, jnp.bool_))
  assert not np.allclose(score("blockwise"), ref, **TOL)


def test_auto_picks_blockwise_only_for_large_logits():
  cfg = meshlm.load_config("model=llama2-tiny")  # V = 512
  assert cfg.loss_impl == "auto" and LP.loss_path(cfg, 64, 128) == "materialized"  # the tiny presets' size
  assert LP.loss_path(cfg, 2 ** 19 // 128, 128) == "blockwise"  # 2^28 logits
  assert LP.loss_path(cfg, 2 ** 19 // 128 - 1, 128) == "materialized"
  assert LP.loss_path(cfg.model_copy(update={"loss_impl": "blockwise"}), 1, 1) == "blockwise"
  assert LP.loss_path(cfg.model_copy(update={"loss_impl": "materialized"}), 2 ** 20, 2 ** 10) == "materialized"


# --- The train step: a few tiny presets, 3 steps each way; the compiled step's buffers ------------------------
# A vocab no other dimension of these models equals (the logits check below finds [B, T, V] by it).
STEP_T, LOSS_BLOCK, STEP_V = 32, 8, 300
STEP_RUNS = {  # name: (preset, mesh and mode, loss_impl)
    "llama2": ("llama2-tiny", ["mesh.fsdp=4"], "materialized"),
    "llama2_blockwise": ("llama2-tiny", ["mesh.fsdp=4"], "blockwise"),
    # The vocab over mesh.tensor and the batch over data and fsdp, under auto: against the fsdp=4 reference.
    "llama2_blockwise_auto_tensor": ("llama2-tiny", ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2",
                                                     "shard_mode=auto"], "blockwise"),
    # The sequence over mesh.context: the strided blocks keep each block's positions on their devices.
    "llama2_blockwise_context": ("llama2-tiny", ["mesh.fsdp=2", "mesh.context=2"], "blockwise"),
    "gemma2": ("gemma2-tiny", ["mesh.fsdp=4"], "materialized"),  # tied head, final soft-cap
    "gemma2_blockwise": ("gemma2-tiny", ["mesh.fsdp=4"], "blockwise"),
    "gemma2_blockwise_tensor": ("gemma2-tiny", ["mesh.fsdp=2", "mesh.tensor=2"], "blockwise"),
    "mixtral": ("mixtral-tiny", ["mesh.fsdp=4"], "materialized"),
    "mixtral_blockwise": ("mixtral-tiny", ["mesh.fsdp=4"], "blockwise"),
}


def _batch(global_batch: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  shape = (global_batch, STEP_T)
  return {"inputs": rng.integers(0, STEP_V, shape).astype(np.int32),
          "targets": rng.integers(0, STEP_V, shape).astype(np.int32), "segment_ids": np.ones(shape, np.int32),
          "positions": np.tile(np.arange(STEP_T, dtype=np.int32), (shape[0], 1)),
          "loss_mask": (rng.random(shape) > 0.2).astype(np.float32)}


def _train(name: str):
  """([(loss, grad norm)] of 3 steps, the compiled step's HLO text, its census, B per device, the optimization
  barriers in the lowered step) of one STEP_RUNS entry."""
  from meshlm.analysis.census import census_of, lowered_of
  from meshlm.parallel.mesh import make_mesh
  preset, mesh_keys, impl = STEP_RUNS[name]
  # The fewest layers each preset takes (gemma2: one [local, global] period): the head and the loss are the test.
  layers = f"model.num_layers={2 if preset == 'gemma2-tiny' else 1}"
  cfg = meshlm.load_config(f"model={preset}", layers, "cpu_devices=4", *mesh_keys, "train.per_device_batch_size=1",
                           f"train.seq_len={STEP_T}", f"model.vocab_size={STEP_V}", "train.compute_dtype=float32",
                           f"loss_impl={impl}", f"loss_block={LOSS_BLOCK}")
  mesh = make_mesh(cfg)
  step = ST.build_train_step(cfg, mesh)
  lowered = step.lower()
  compiled = lowered.compile()
  state = step.init_state(jax.random.key(0))
  losses = []
  for i in range(3):
    with jax.set_mesh(mesh):
      state, metrics = compiled(state, step.put_batch(_batch(step.global_batch, i)))
    # The gradient norm too: AdamW's first update is about lr x sign(g), so the losses alone hardly see dW.
    losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  b_local = step.global_batch // (mesh.shape["data"] * mesh.shape["fsdp"])  # the logits checks' runs: T whole
  barriers = lowered.as_text().count("stablehlo.optimization_barrier")
  return losses, compiled.as_text(), census_of(lowered_of(lowered, compiled)), b_local, barriers


@pytest.fixture(scope="module")
def runs():
  cache = {}
  def get(name):
    if name not in cache:
      cache[name] = _train(name)
    return cache[name]
  return get


@pytest.mark.parametrize("name", [n for n in STEP_RUNS if "blockwise" in n])
def test_blockwise_trains_to_the_materialized_losses(runs, name):
  ref = runs(name.split("_blockwise")[0])[0]
  got = runs(name)[0]
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  assert len({loss for loss, _ in ref}) == 3  # three different steps compared
  # The step's blockwise backward holds the head gradient's barrier (loss_grad_reduce=auto), the materialized none.
  assert (runs(name)[4], runs(name.split("_blockwise")[0])[4]) == (1, 0)


def _logits_buffers(hlo: str, b_local: int, vocab: int = STEP_V) -> list[str]:
  """Every array shape in the HLO text holding a whole [B, T, V] logits tensor (any layout or split of B x T)."""
  out = []
  for dims in re.findall(r"(?:f32|bf16)\[([\d,]+)\]", hlo):
    shape = [int(d) for d in dims.split(",")]
    if vocab in shape and int(np.prod(shape)) == b_local * STEP_T * vocab:
      out.append(dims)
  return out


@pytest.mark.parametrize("base", ["llama2", "gemma2"])
def test_the_blockwise_step_holds_no_logits(runs, base):
  """The materialized step holds [B, T, V] (the control); the blockwise one none, only [B, block, V] pieces."""
  _, hlo, _, b_local, _ = runs(base)
  assert _logits_buffers(hlo, b_local)
  _, hlo, census, b_local, _ = runs(f"{base}_blockwise")
  assert _logits_buffers(hlo, b_local) == []
  assert re.search(rf"f32\[{b_local},{LOSS_BLOCK},{STEP_V}\]", hlo)  # the blocks are there
  # The head's weight gradient in kernel order under explicit: no blocked transpose-of-dot pair anywhere.
  assert census["stablehlo"]["transpose_of_dot"]["blocked"] == 0


def _head_census(tied: bool):
  """The StableHLO census counts of the blockwise loss's gradient on an explicit fsdp=2 x tensor=2 mesh (lowered
  only), the kernel stored as the model stores it (embed over fsdp, vocab over tensor)."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from meshlm.analysis.census import stablehlo_counts
  mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
  x, params, targets, mask = _data(V=40)  # a vocab mesh.tensor divides
  kernel, spec = (params["embed"], P("tensor", "fsdp")) if tied else (params["lm_head"], P("fsdp", "tensor"))
  loss = lambda x, k: -jnp.sum(head_loss.blockwise_logprobs(x, k, targets, tied=tied, block=BLOCK)[0] * mask)
  with jax.set_mesh(mesh):
    args = (jax.device_put(x, NamedSharding(mesh, P("fsdp"))), jax.device_put(kernel, NamedSharding(mesh, spec)))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).as_text(debug_info=True)
  return stablehlo_counts(text, counters=())[0]


def _sharded_grads(block: int, barrier: bool):
  """(loss, d/dx, d/dkernel) of the untied blockwise loss on an explicit fsdp=2 x tensor=2 mesh (4 row shards'
  partials exchanged), and the count of optimization barriers in the lowered program."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
  x, params, targets, mask = _data(V=40)
  loss = lambda x, k: -jnp.sum(head_loss.blockwise_logprobs(x, k, targets, tied=False, block=block,  # noqa: E731
                                                            barrier=barrier)[0] * mask)
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  with jax.set_mesh(mesh):
    args = (jax.device_put(x, NamedSharding(mesh, P("fsdp"))),
            jax.device_put(params["lm_head"], NamedSharding(mesh, P("fsdp", "tensor"))))
    value, grads = fn(*args)
    barriers = fn.lower(*args).as_text().count("stablehlo.optimization_barrier")
  return [np.asarray(a) for a in (value, *grads)], barriers


def test_the_head_gradient_barrier_changes_no_number():
  """loss_grad_reduce: the barrier (auto's choice, models/logprobs.grad_reduce) only orders the head gradient's one
  reduction before dx is returned: value and gradients bit-identical to overlap's, and to the materialized reference
  within TOL; the barrier is in the program only when asked. Control: the bitwise comparison sees a reordered sum
  (another block size: the gradients' float32 sums over blocks run in another order)."""
  cfg = meshlm.load_config("model=llama2-tiny")
  assert LP.grad_reduce(cfg) == "barrier" and LP.grad_reduce(_cfg("loss_grad_reduce=overlap")) == "overlap"
  got, n = _sharded_grads(BLOCK, barrier=True)
  plain, n0 = _sharded_grads(BLOCK, barrier=False)
  assert (n, n0) == (1, 0)
  assert all(np.array_equal(a, b) for a, b in zip(got, plain))
  x, params, targets, mask = _data(V=40)
  cfg = _cfg("model.vocab_size=40")
  ref = _value_and_grads(_reference_loss, cfg, params, x, targets, mask)
  for a, b in zip(got, (ref[0], ref[1], ref[2]["lm_head"])):
    np.testing.assert_allclose(a, b, **TOL)
  other, _ = _sharded_grads(BLOCK + 1, barrier=True)
  assert not all(np.array_equal(a, b) for a, b in zip(other, plain))


def test_the_estimate_holds_the_barrier_rule():
  """auto's barrier by analysis/layout.py's estimate (abstract shapes, nothing compiled): with overlap the head's
  float32 accumulator also counts in a layer's phase (XLA:TPU holds it over the layers' backward), with the barrier
  only in the loss's. DeepSeek-V3 in MaxText's layout (docs/compile.md: compiled 72.08 GiB with overlap's program,
  68.63 with the barrier): the estimate falls by the whole f32[7168,129280]. Where the loss's phase is the larger
  (a 2-layer llama with a 2^17 vocab) it moves by less, never up."""
  from meshlm.analysis.layout import estimate
  dsv3 = ["model=deepseek-v3", "train.seq_len=4096", "train.per_device_batch_size=1", "remat=full", "mesh.expert=8",
          "mesh.fsdp=32"]
  est = lambda *o, devices=256: estimate(meshlm.load_config(*o), devices, "tpu")  # noqa: E731
  auto, overlap = est(*dsv3), est(*dsv3, "loss_grad_reduce=overlap")
  assert auto.terms["held_head_grad"] == 0 and auto.peak == est(*dsv3, "loss_grad_reduce=barrier").peak
  assert overlap.terms["held_head_grad"] == 7168 * 129280 * 4 == overlap.peak - auto.peak
  small = ["model=llama3-8b", "model.num_layers=2", "model.vocab_size=131072", "train.seq_len=1024", "mesh.fsdp=4"]
  auto, overlap = est(*small, devices=4), est(*small, "loss_grad_reduce=overlap", devices=4)
  t = auto.terms  # the loss's phase sets the estimate
  assert auto.peak == sum(t[k] for k in ("params", "opt_state", "model_state", "grads", "saved", "loss"))
  assert 0 < overlap.peak - auto.peak < overlap.terms["held_head_grad"]


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_weight_gradient_comes_out_in_kernel_order(tied, monkeypatch):
  """0 transpose-of-dot pairs under explicit; control: dW formed in the other order, then transposed, is blocked."""
  counts = _head_census(tied)
  assert counts["transpose_of_dot"]["blocked"] == 0 and counts["transpose_of_dot"]["adjacent"] == 0
  from jax.sharding import reshard

  def flipped(opts, x5, dz5, acc_spec):
    eqn = "abctd,abctv->acdv" if opts.tied else "abctv,abctd->acvd"
    pair = (x5, dz5) if opts.tied else (dz5, x5)
    other = jax.sharding.PartitionSpec(acc_spec[0], acc_spec[1], acc_spec[3], acc_spec[2])
    return reshard(jnp.swapaxes(jnp.einsum(eqn, *pair, out_sharding=other), 2, 3), acc_spec)
  monkeypatch.setattr(head_loss, "_weight_grad", flipped)
  assert _head_census(tied)["transpose_of_dot"]["blocked"] >= 1


def test_the_rl_step_scores_blockwise_as_it_scores_materialized(monkeypatch):
  """rl/step.scores (the RL loss's and the scorer's log-probs and entropy) under both loss_impl values, on a
  one-layer model with top-k scoring; the blockwise one goes through the blockwise head (and only it does)."""
  out, calls = {}, []
  blockwise = head_loss.blockwise_logprobs
  monkeypatch.setattr(LP, "blockwise_logprobs", lambda *a, **k: calls.append(1) or blockwise(*a, **k))
  for impl in ("materialized", "blockwise"):
    cfg = _cfg("model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=8",
               "model.mlp_dim=32", "rl.top_k=5", f"loss_impl={impl}")
    params = meshlm.init_params(cfg, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in _batch(B, seed=3).items()}
    batch = {k: (v % V if v.dtype == jnp.int32 and k in ("inputs", "targets") else v) for k, v in batch.items()}
    out[impl] = jax.jit(lambda p, b: RS.scores(cfg, p, b, False)[:2])(params, batch)
    assert len(calls) == (impl == "blockwise")
  np.testing.assert_allclose(out["blockwise"][0], out["materialized"][0], **TOL)
  np.testing.assert_allclose(out["blockwise"][1], out["materialized"][1], **TOL)
