"""Router replay (nn/router_replay.py): forced expert ids through moe_mlp, the decoder and the train step.

- The compact top-k (at most R gathered rows, lax.cond fallback to the full top-k) is bit-identical to
  the plain full top-k in the forward and every gradient, on both branches and at the R / R+1
  boundary, padding included, and at the default R (R and R + 1 of 300 tokens unforced); the compact
  branch alone at R+1 rows is wrong (negative control).
- In a whole model with more tokens than R (qwen3-moe-tiny, small dims, 2 x 144): the replay program
  holds the cond with a top-k over [R, E], and the compact branch's ids are the ones used (a wrong full
  top-k changes nothing while the free rows fit, and comes through when they do not).
- Replaying the ids an unforced forward recorded gives its logits and gradients bit for bit (whole
  qwen3-moe-tiny; mixtral-tiny's unrolled layers in tests/test_conformance.py); other ids change the
  output; the router keeps a gradient when every token is forced; explicit and auto sharding give the
  unsharded ids.
- The train step takes the ids as a batch field; bad shapes and ranges are refused in one line.
- The decoder's per-layer inputs reach each MoE layer through a scan period holding two of them, an
  unrolled remainder, param_scan_axis=1 and remat=full (checked to fail when the period's rank is
  ignored in the slicing).
"""
import functools

import jax
import jax.extend  # jax.extend.core.jaxprs_in_params below: jax does not import the submodule itself
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.models import decoder
from meshlm.models.params import init_params
from meshlm.models.ffns.moe import knobs
from meshlm.nn import moe
from meshlm.nn import router_replay as rr
from meshlm.nn.dense import dense
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import logical_spec
from meshlm.train import step as train_step
from moe_helpers import settings

B, T, D, F, E, K = 2, 9, 16, 12, 8, 2  # 18 tokens
R = 6  # replay rows of the compact top-k in these tests
TOL = 1e-6


def _same(a, b) -> bool:
  """Bit-identical pytrees (same structure, every leaf equal bit for bit)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      u.shape == v.shape and u.dtype == v.dtype
      and np.array_equal(np.atleast_1d(np.asarray(u)).view(np.uint8), np.atleast_1d(np.asarray(v)).view(np.uint8))
      for u, v in zip(la, lb))


@pytest.fixture(scope="module")
def layer():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  p = {"router": 0.3 * rng.standard_normal((D, E)), "gate": 0.2 * rng.standard_normal((E, D, F)),
       "up": 0.2 * rng.standard_normal((E, D, F)), "down": 0.2 * rng.standard_normal((E, F, D))}
  p = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}

  def f(p, x, forced, mask, *, aux=True, **kw):
    y, side = moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True, **kw), forced_ids_BTk=forced,
                          token_mask_BT=mask)
    c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    loss = jnp.sum(c * y) + (side["moe_load_balance_loss"] + 0.1 * side["moe_z_loss"] if aux else 0.0)
    return loss, (y, side["moe_expert_ids"])
  grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True),
                 static_argnames=("aux", "replay_rows", "replay_impl"))
  plain = jax.jit(jax.value_and_grad(lambda p, x: f(p, x, None, None), argnums=(0, 1), has_aux=True))(p, x)
  return x, p, grad, plain


def _forced(recorded, free: int, seed: int = 1) -> np.ndarray:
  """recorded ids with `free` random tokens set to -1 (not forced)."""
  forced = np.asarray(recorded).copy().reshape(B * T, K)
  forced[np.random.default_rng(seed).choice(B * T, free, replace=False)] = -1
  return forced.reshape(B, T, K)


@pytest.mark.parametrize("free,padding", [(R, 0), (R + 1, 0), (B * T, 0), (R + 3, 3)],
                         ids=["R-compact", "R+1-fallback", "none-forced", "padding-compact"])
def test_compact_topk_is_bit_identical_to_the_full_topk(layer, free, padding):
  x, p, grad, plain = layer
  ids0 = plain[0][1][1]
  forced = _forced(ids0, free)
  mask = np.ones((B, T), np.int32)
  if padding:
    # Padding rows among the unforced ones: they need no top-k, so R + 3 unforced rows with 3 of them
    # padding fit the compact branch.
    unforced = np.flatnonzero(forced.reshape(-1, K)[:, 0] < 0)
    mask.reshape(-1)[unforced[:padding]] = 0
  need = (forced[..., 0] < 0) & (mask > 0)
  assert bool(rr.compact_fits(jnp.asarray(need.reshape(-1)), R)) == (need.sum() <= R)
  compact = grad(p, x, jnp.asarray(forced), jnp.asarray(mask), replay_rows=R)
  full = grad(p, x, jnp.asarray(forced), jnp.asarray(mask), replay_impl="full")
  assert _same(compact, full)
  ids = np.asarray(compact[0][1][1])
  # Forced tokens use their ids; real unforced ones the live top-k; padding unforced ones 0..k-1.
  np.testing.assert_array_equal(ids[forced[..., 0] >= 0], forced[forced[..., 0] >= 0])
  np.testing.assert_array_equal(ids[need], np.asarray(ids0)[need])
  np.testing.assert_array_equal(ids[(forced[..., 0] < 0) & (mask == 0)], np.broadcast_to(np.arange(K), (padding, K)))
  if not padding:
    # With no padding every token's ids are the recorded top-k: the unforced forward, bit for bit.
    assert _same(compact, plain)


@pytest.mark.parametrize("free", [rr.REPLAY_ROWS, rr.REPLAY_ROWS + 1], ids=["R-compact", "R+1-fallback"])
def test_default_R_compact_and_fallback_are_bit_identical_to_the_full_topk(layer, free):
  """At the default R (what the models run), 300 tokens with R or R + 1 of them unforced: the compact
  branch and the fallback give the full top-k's ids, weights and gradients bit for bit."""
  _, p, grad, _ = layer
  R, N = rr.REPLAY_ROWS, 300
  x = jnp.asarray(np.random.default_rng(4).standard_normal((1, N, D)), jnp.float32)
  probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, p["router"]).reshape(N, E), axis=-1)
  forced = np.array(jax.lax.top_k(probs, K)[1], np.int32)  # the top-k ids, forced; then `free` unforced
  forced[np.random.default_rng(5).choice(N, free, replace=False)] = -1
  need = jnp.asarray(forced[:, 0] < 0)
  assert bool(rr.compact_fits(need, R)) == (free <= R)
  compact = grad(p, x, jnp.asarray(forced[None]), None)  # replay_rows left at its default
  full = grad(p, x, jnp.asarray(forced[None]), None, replay_impl="full")
  assert _same(compact, full)
  if free > R:  # control: the compact branch alone (no fallback) misses the last row
    wrong = rr.compact_topk(probs, need, K, R)
    assert int(jnp.sum(jnp.any(wrong != rr.full_topk(probs, need, K), axis=-1))) == 1


def test_the_compact_branch_alone_is_wrong_past_R_rows(layer):
  """Negative control: at R + 1 rows the compact top-k (without its fallback) misses one row."""
  x, p, grad, plain = layer
  forced = _forced(plain[0][1][1], R + 1)
  need = jnp.asarray(forced[..., 0].reshape(-1) < 0)
  probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, p["router"]).reshape(B * T, E), axis=-1)
  wrong, right = rr.compact_topk(probs, need, K, R), rr.full_topk(probs, need, K)
  assert not _same(wrong, right)
  assert int(jnp.sum(jnp.any(wrong != right, axis=-1))) == 1
  assert _same(rr.compact_topk(probs, need, K, R + 1), right)


def test_forcing_other_ids_changes_the_output_and_the_router_keeps_its_gradient(layer):
  x, p, grad, plain = layer
  ids0 = np.asarray(plain[0][1][1])
  shifted = (ids0 + 1) % E  # every token forced, to other experts
  (_, (y, ids)), (gp, _) = grad(p, x, jnp.asarray(shifted), None, aux=False, replay_rows=R)
  np.testing.assert_array_equal(ids, shifted)
  assert float(jnp.max(jnp.abs(y - plain[0][1][0]))) > 1e-3
  # No aux loss here: the router's gradient flows only through the weights gathered at the forced ids.
  assert float(jnp.max(jnp.abs(gp["router"]))) > 1e-4
  (_, _), (gp_same, _) = grad(p, x, jnp.asarray(ids0), None, aux=False, replay_rows=R)
  assert float(jnp.max(jnp.abs(gp_same["router"] - gp["router"]))) > 1e-6


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_sharded_replay_gives_the_unsharded_ids(layer, mode):
  x, p, grad, plain = layer
  x4 = jnp.concatenate([x, x])  # B = 4: two rows per fsdp shard
  forced = np.concatenate([_forced(plain[0][1][1], 2), _forced(plain[0][1][1], 5, seed=2)])
  rows = 3  # shard 0 needs 2 rows (compact branch), shard 1 needs 5 (the fallback)
  want = grad(p, x4, jnp.asarray(forced), None, replay_impl="full")
  mesh = make_mesh(load_config("cpu_devices=2", "mesh.fsdp=2", f"shard_mode={mode}"))
  ctx = type("Ctx", (), {"dense": staticmethod(functools.partial(dense, kernel_order=True))})

  def f(p, x, forced):
    y, side = moe.moe_mlp(p, x, ctx, *settings(E, K, norm_topk_prob=True, replay_rows=rows),
                          forced_ids_BTk=forced)
    c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(c * y) + side["moe_load_balance_loss"] + 0.1 * side["moe_z_loss"], (y, side["moe_expert_ids"])
  spec = moe.moe_spec(D, E, F, kernel_fsdp="embed")
  with jax.set_mesh(mesh):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
    ps = {k: put(v, spec[k].axes) for k, v in p.items()}
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        ps, put(x4, ("batch", "length", "act_embed")), put(jnp.asarray(forced), ("batch", "length", None)))
  np.testing.assert_array_equal(got[0][1][1], want[0][1][1])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= TOL * max(1.0, np.max(np.abs(b)))


def test_bad_forced_ids_are_refused(layer):
  x, p, _, _ = layer
  call = lambda f: moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True), forced_ids_BTk=f)  # noqa: E731
  good = np.zeros((B, T, K), np.int32)
  with pytest.raises(ValueError, match=r"forced_expert_ids: shape \(2, 9, 3\), expected \(2, 9, 2\)"):
    call(np.zeros((B, T, K + 1), np.int32))
  with pytest.raises(ValueError, match=r"ids range over \[0, 8\], expected -1 \(not forced\) or an expert in \[0, 8\)"):
    call(np.where(np.arange(K) == 1, E, good))
  with pytest.raises(ValueError, match=r"ids range over \[-2, 0\]"):
    call(good - 2 * (np.arange(T)[:, None] == 3))
  with pytest.raises(ValueError, match="row 0 .* mixes -1 with expert ids"):
    call(np.where(np.arange(K) == 0, -1, good))
  with pytest.raises(ValueError, match="dtype float32, expected integer"):
    call(good.astype(np.float32))
  with pytest.raises(ValueError, match="router replay impl='sorted'"):
    moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True, replay_impl="sorted"),
                forced_ids_BTk=good)


# --- the whole model ---------------------------------------------------------------------------------

MB, MT = 4, 16


# qwen3-moe-tiny: a dense layer, then MoE layers in a scan. Unrolled MoE layers (mixtral-tiny) replay their recorded
# ids bit for bit in tests/test_conformance.py's test_recorded_expert_ids_replay_bit_for_bit[mixtral-tiny] (the
# 1-device process), and take each its own row of the forced ids in
# test_per_layer_inputs_reach_each_layer_through_scan_groups_and_remainder (an unrolled remainder); the gradients
# through a replayed routing are the moe part's, the same in a scan or unrolled.
@pytest.fixture(scope="module")
def model():
  cfg = load_config("model=qwen3-moe-tiny", "cpu_devices=1", "train.compute_dtype=float32")
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (MB, MT)), jnp.int32)
  c = jnp.cos(jnp.arange(MB * MT * cfg.model.vocab_size, dtype=jnp.float32)).reshape(MB, MT, -1)

  def f(p, forced):
    logits, side = decoder.forward(cfg, p, tokens, return_side=True, layer_inputs={"forced_expert_ids": forced})
    return jnp.sum(logits * c), (logits, side["moe_expert_ids"])
  plain = jax.jit(jax.value_and_grad(lambda p: f(p, None), has_aux=True))(params)
  replay = jax.jit(jax.value_and_grad(f, has_aux=True))
  return cfg, params, tokens, plain, replay


def test_replaying_recorded_ids_gives_the_unforced_logits_and_gradients(model):
  cfg, params, _, plain, replay = model
  ids = plain[0][1][1]
  n_moe = decoder.plan(cfg).count("moe")
  assert ids.shape == (n_moe, MB, MT, knobs(cfg.model).num_experts_per_tok) and ids.dtype == jnp.int32
  assert _same(replay(params, ids), plain)
  # Control: other ids (every token forced elsewhere) change the logits and the gradients.
  (_, (logits, got_ids)), grads = replay(params, (ids + 1) % knobs(cfg.model).num_experts)
  np.testing.assert_array_equal(got_ids, (ids + 1) % knobs(cfg.model).num_experts)
  assert float(jnp.max(jnp.abs(logits - plain[0][1][0]))) > 1e-4
  assert not _same(grads, plain[1])
  router = jnp.moveaxis(grads["layers"]["moe"]["moe"]["router"], cfg.param_scan_axis, 0)  # [L_moe, D, E]
  assert router.shape[0] == n_moe
  assert float(jnp.min(jnp.max(jnp.abs(router), axis=(1, 2)))) > 0  # every MoE layer's router learns


def test_bad_forced_ids_are_refused_by_forward(model):
  cfg, params, tokens, plain, _ = model
  ids = np.asarray(plain[0][1][1])
  with pytest.raises(ValueError, match=r"forced_expert_ids: shape \(.*\), expected \(.*\)"):
    decoder.forward(cfg, params, tokens, layer_inputs={"forced_expert_ids": ids[:-1]})
  with pytest.raises(ValueError, match=r"forced_expert_ids: ids range over \[\d+, \d+\], expected -1"):
    decoder.forward(cfg, params, tokens, layer_inputs={"forced_expert_ids": ids + knobs(cfg.model).num_experts})
  dense_cfg = load_config("model=llama2-tiny", "cpu_devices=1")
  with pytest.raises(ValueError, match="no layer of model family 'llama' here reads 'forced_expert_ids'"):
    decoder.forward(dense_cfg, {}, tokens, layer_inputs={"forced_expert_ids": ids})
  with pytest.raises(ConfigError, match="no layer whose choices a replay forces"):
    train_step.replay_batch_spec(dense_cfg)
  with pytest.raises(ValueError, match=r"layer_inputs: no layer of model family '.*' here reads 'x' \(inputs its layers read: forced_expert_ids\)"):
    decoder.forward(cfg, params, tokens, layer_inputs={"x": ids})


def test_train_step_with_forced_ids(model):
  """The forced ids as a batch field of the train step: placed on fsdp=2, split over 2 micro-batches, and read by
  the step's forward. Only the final norm trains: the field and the forward are what is checked here, and a
  backward through every layer compiles about three times as long. The gradients of a replayed routing are
  test_replaying_recorded_ids_gives_the_unforced_logits_and_gradients's; the RL step trains the whole model on
  replayed ids in tests/test_rl.py."""
  _, _, tokens, plain, _ = model
  cfg = load_config("model=qwen3-moe-tiny", "cpu_devices=2", "mesh.fsdp=2", "train.compute_dtype=float32",
                    f"train.seq_len={MT}", f"train.per_device_batch_size={MB // 2}", "train.micro_batches=2",
                    r"train.freeze=['layers\..*', 'embed', 'lm_head']")
  step = train_step.build_train_step(cfg, batch_spec=train_step.replay_batch_spec(cfg))
  field = step.batch_spec["forced_expert_ids"]
  n_moe = decoder.plan(cfg).count("moe")
  assert field.shape(MB, MT) == (MB, MT, n_moe, knobs(cfg.model).num_experts_per_tok)
  targets = jnp.roll(tokens, -1, axis=1)
  logits = plain[0][1][0]
  want = float(jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)))
  ids = np.asarray(plain[0][1][1])  # [L_moe, B, T, k]
  batch = {"inputs": np.asarray(tokens), "targets": np.asarray(targets),
           "positions": np.broadcast_to(np.arange(MT, dtype=np.int32), (MB, MT)).copy(),
           "segment_ids": np.ones((MB, MT), np.int32), "loss_mask": np.ones((MB, MT), np.float32)}

  def loss_with(forced_LBTk):
    state = step.init_state(jax.random.key(0))
    _, metrics = step(state, step.put_batch(dict(batch, forced_expert_ids=np.moveaxis(forced_LBTk, 0, 2))))
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    return float(metrics["loss"])
  assert abs(loss_with(ids) - want) <= 1e-5 * abs(want)  # replaying the recorded routing
  assert abs(loss_with(np.full_like(ids, -1)) - want) <= 1e-5 * abs(want)  # nothing forced: top-k
  assert abs(loss_with((ids + 1) % knobs(cfg.model).num_experts) - want) > 1e-4  # control: other experts
  with pytest.raises(ValueError, match=r"forced_expert_ids: shape \(4, 16, 3, 1\), expected \(4, 16, 3, 2\)"):
    step.put_batch(dict(batch, forced_expert_ids=np.zeros((MB, MT, n_moe, 1), np.int32)))
  with pytest.raises(ValueError, match=r"forced_expert_ids: ids range over \[-3, -1\]"):
    step.put_batch(dict(batch, forced_expert_ids=np.full((MB, MT, n_moe, 2), -3, np.int32)
                        + (np.arange(2) == 0) * 2))


def test_per_layer_inputs_reach_each_layer_through_scan_groups_and_remainder():
  """A plan whose scanned period holds two MoE layers ([G, n] grouping), an unrolled MoE remainder,
  param_scan_axis=1 and remat=full: every MoE layer routes by its own row of the forced ids, and the
  recorded ids replay bit for bit (forward only, small dims; a routing with nothing forced is the plain top-k, bit
  for bit: test_compact_topk_is_bit_identical_to_the_full_topk[none-forced])."""
  cfg = load_config("model=qwen3-moe-tiny", "cpu_devices=1", "model.num_layers=7", "model.mlp_only_layers=[2,5]",
                    "model.embed_dim=64", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
                    "model.mlp_dim=64", "model.parts.moe.mlp_dim=32", "model.vocab_size=128", "param_scan_axis=1",
                    "remat=full", "train.compute_dtype=float32")
  lp = decoder.plan(cfg)
  assert (lp.kinds, lp.period, lp.groups, lp.rest) == (("moe", "moe", "dense") * 2 + ("moe",), 3, 2, 1)
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 8)), jnp.int32)
  fwd = jax.jit(lambda p, f: decoder.forward(cfg, p, tokens, return_side=True, layer_inputs={"forced_expert_ids": f}))
  # Recorded with nothing forced (every row -1: each layer's own top-k), so one program serves the recording and
  # the replays.
  logits, side = fwd(params, np.full((5, 2, 8, 2), -1, np.int32))
  ids = np.asarray(side["moe_expert_ids"])  # [5, 2, 8, 2]
  assert ids.shape == (5, 2, 8, 2)
  assert _same(fwd(params, ids), (logits, side))
  # Each layer gets its own row: a different shift per MoE layer comes back layer by layer.
  shifted = (ids + 1 + np.arange(5)[:, None, None, None]) % knobs(cfg.model).num_experts
  got_logits, got = fwd(params, shifted)
  np.testing.assert_array_equal(got["moe_expert_ids"], shifted)
  assert float(jnp.max(jnp.abs(got_logits - logits))) > 1e-4


# --- the compact branch in a whole model -------------------------------------------------------------
# The model tests above route 4 x 16 tokens, fewer than REPLAY_ROWS, so they take the full top-k
# without a cond. Here 2 x 144 = 288 tokens per MoE layer: more than R = 256, so the cond is in the
# program, and each of its branches can be taken (at most R unforced rows, or more).

LB, LT = 2, 144
FITS = 200  # unforced tokens per layer: fits R
SMALL_MOE = ("model=qwen3-moe-tiny", "cpu_devices=1", "train.compute_dtype=float32", "model.embed_dim=64",
             "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64",
             "model.parts.moe.mlp_dim=32", "model.vocab_size=128")


@pytest.fixture(scope="module")
def long_model():
  assert LB * LT > rr.REPLAY_ROWS >= FITS
  cfg = load_config(*SMALL_MOE)
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (LB, LT)), jnp.int32)
  logits, side = jax.jit(lambda p: decoder.forward(cfg, p, tokens, return_side=True))(params)
  return cfg, params, tokens, logits, np.asarray(side["moe_expert_ids"])  # ids [L_moe, B, T, k]


def _unforce(ids_LBTk: np.ndarray, free: int) -> np.ndarray:
  """The recorded ids with `free` random tokens of every MoE layer set to -1 (not forced)."""
  out = ids_LBTk.copy().reshape(ids_LBTk.shape[0], -1, ids_LBTk.shape[-1])
  rng = np.random.default_rng(3)
  for layer in out:
    layer[rng.choice(layer.shape[0], free, replace=False)] = -1
  return out.reshape(ids_LBTk.shape)


def _eqns(jaxpr):
  """Every equation of a (closed) jaxpr, sub-jaxprs included, in order."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _top_k_operands(jaxpr) -> list[tuple[int, ...]]:
  return [tuple(e.invars[0].aval.shape) for e in _eqns(jaxpr) if e.primitive.name == "top_k"]


def _routing_conds(jaxpr) -> list:
  """The conds with a top-k in a branch (the grouped matmul's block loop has conds of its own)."""
  return [e for e in _eqns(jaxpr) if e.primitive.name == "cond"
          and any(_top_k_operands(b) for b in e.params["branches"])]


def test_the_replay_program_of_a_model_holds_the_cond_and_an_R_row_top_k(long_model):
  cfg, params, tokens, _, ids = long_model
  R, N, E = rr.REPLAY_ROWS, LB * LT, knobs(cfg.model).num_experts
  replay = jax.make_jaxpr(lambda p, f: decoder.forward(cfg, p, tokens, layer_inputs={"forced_expert_ids": f}))(params, ids)
  conds = _routing_conds(replay)
  # One cond in the scanned MoE layers' body; its branches: the full top-k over [N, E], the compact
  # one over [R, E] (lax.cond's order: the false branch first), and no other top-k in the program.
  assert len(conds) == 1
  assert [_top_k_operands(b) for b in conds[0].params["branches"]] == [[(N, E)], [(R, E)]]
  assert _top_k_operands(replay) == [(N, E), (R, E)]
  # Control: the unforced forward routes by one top-k over every row, in no cond.
  plain = jax.make_jaxpr(lambda p: decoder.forward(cfg, p, tokens))(params)
  assert _top_k_operands(plain) == [(LB, LT, E)]
  assert not _routing_conds(plain)


def test_a_model_uses_the_compact_branch_when_the_free_rows_fit(long_model, monkeypatch):
  """The full top-k is made wrong (every id shifted by one expert): with FITS <= R unforced tokens per
  layer the replay still gives the unforced logits bit for bit, so its top-k is the compact branch's;
  with every token unforced (N > R) the cond falls back and the wrong ids come through (control)."""
  cfg, params, tokens, logits, ids = long_model
  E = knobs(cfg.model).num_experts
  full_topk = rr.full_topk
  monkeypatch.setattr(rr, "full_topk", lambda probs, need, k: (full_topk(probs, need, k) + 1) % E)
  fwd = jax.jit(lambda p, f: decoder.forward(cfg, p, tokens, return_side=True, layer_inputs={"forced_expert_ids": f}))
  fits = _unforce(ids, FITS)
  got_logits, side = fwd(params, fits)
  np.testing.assert_array_equal(side["moe_expert_ids"], ids)
  assert _same(got_logits, logits)
  got_logits, side = fwd(params, np.full_like(ids, -1))
  # The first MoE layer's ids are the wrong ones (the later layers see other inputs from then on).
  np.testing.assert_array_equal(side["moe_expert_ids"][0], (ids[0] + 1) % E)
  assert float(jnp.max(jnp.abs(got_logits - logits))) > 1e-4
