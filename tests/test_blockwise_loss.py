"""loss_impl=blockwise (nn/head_loss.py: the head and the log-softmax per block, a custom VJP) against the
materialized reference (decoder.head, then train/step.cross_entropy or rl/step.score): the loss, the RL
log-probs and entropy, and their gradients w.r.t. the head's input and its kernel, in float32, each with a
negative control; then a few tiny presets trained 2 steps both ways, and the compiled step's buffers."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.models import decoder
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


def _data(seed=0):
  rng = np.random.default_rng(seed)
  # Large enough logits that the soft-cap (2.0) bends them: its slope matters in the gradient.
  x = jnp.asarray(2 * rng.standard_normal((B, T, D)), jnp.float32)
  params = {"embed": jnp.asarray(rng.standard_normal((V, D)), jnp.float32),
            "lm_head": jnp.asarray(rng.standard_normal((D, V)), jnp.float32)}
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  mask = jnp.asarray(rng.random((B, T)) > 0.3, jnp.float32).at[0, 2].set(0.0).at[1, -1].set(0.0)  # holes
  return x, params, targets, mask


def _reference_loss(cfg, params, x, targets, mask):
  return ST.cross_entropy(decoder.head(cfg, params, x), targets, mask)[0]


def _blockwise_loss(cfg, params, x, targets, mask):
  return ST.blockwise_cross_entropy(cfg, params, x, targets, mask)[0]


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
    if blockwise:
      return RS.score_blockwise(cfg, p, x, targets)
    return RS.score(cfg, decoder.head(cfg, p, x), targets)

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
  ref = RS.score(cfg, decoder.head(cfg, params, x), targets)[0]
  monkeypatch.setattr(RS, "_kept", lambda k, p, z: jnp.ones(z.shape, jnp.bool_))
  assert not np.allclose(RS.score_blockwise(cfg, params, x, targets)[0], ref, **TOL)


def test_auto_picks_blockwise_only_for_large_logits():
  cfg = meshlm.load_config("model=llama2-tiny")  # V = 512
  assert cfg.loss_impl == "auto" and not ST.blockwise_loss(cfg, 64, 128)  # the tiny presets' size: materialized
  assert ST.blockwise_loss(cfg, 2 ** 19 // 128, 128)  # 2^28 logits
  assert not ST.blockwise_loss(cfg, 2 ** 19 // 128 - 1, 128)
  assert ST.blockwise_loss(cfg.model_copy(update={"loss_impl": "blockwise"}), 1, 1)
  assert not ST.blockwise_loss(cfg.model_copy(update={"loss_impl": "materialized"}), 2 ** 20, 2 ** 10)
