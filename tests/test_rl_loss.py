"""The GRPO loss (rl/loss.py) against a NumPy reference written loop by loop, in float64: the advantages,
the loss and its gradient with respect to the policy log-probs (central differences of the reference),
for each rl.loss_agg, rl.scale_rewards, rl.ratio_level and rl.sampler_is, with beta > 0 and clip-higher,
on a hand-made batch that holds a degenerate group (all rewards equal: advantage 0) and an all-masked
completion. Negative controls: a wrong aggregation, an advantage without the group mean and a clip
without the high epsilon each fail the same check."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.rl import loss as L

G, P, T, MAX_LEN = 3, 3, 6, 6
B = P * G
TOL = 2e-6  # float32 against float64, relative to the largest value compared


def _batch():
  rng = np.random.default_rng(7)
  mask = np.zeros((B, T))
  lengths = [6, 4, 2, 5, 0, 3, 6, 1, 4]  # row 4: an all-masked (empty) completion
  for b, n in enumerate(lengths):
    mask[b, T - n:] = 1.0 if n else 0.0  # completions at the end of the row, as after a prompt
  rewards = np.array([1.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.2, 1.0, 0.0])  # group 1 degenerate
  old = rng.uniform(-3.0, -0.5, (B, T))
  sampler = old + rng.uniform(-0.3, 0.3, (B, T))
  # log ratios spread over [-0.45, 0.45]: some inside the clip range, some outside, none at an edge
  lr = rng.choice([-1, 1], (B, T)) * rng.uniform(0.02, 0.45, (B, T))
  near_edge = lambda x: np.min(np.abs(np.abs(x)[..., None] - np.array([np.log(0.8), np.log(1.2), np.log(1.28)])))
  assert near_edge(lr) > 1e-3
  logp = old + lr
  ref = old + rng.uniform(-0.4, 0.4, (B, T))
  return dict(logp=logp, old=old, sampler=sampler, ref=ref, rewards=rewards, mask=mask)


# --- the reference -----------------------------------------------------------------------------------

def ref_advantages(r, scale):
  out = np.zeros_like(r)
  for g in range(len(r) // G):
    grp = r[g * G:(g + 1) * G]
    mean = sum(grp) / G
    for j in range(G):
      a = grp[j] - mean
      if scale == "group":
        a /= np.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1)) + L.STD_EPS
      elif scale == "batch":
        m_all = sum(r) / len(r)
        a /= np.sqrt(sum((x - m_all) ** 2 for x in r) / (len(r) - 1)) + L.STD_EPS
      out[g * G + j] = a
  return out


def ref_loss(logp, d, adv, *, agg, level, eps, eps_hi, beta, sampler_is, cap):
  mask = d["mask"]
  hi = eps if eps_hi is None else eps_hi
  n_tok = mask.sum()
  total = 0.0
  for b in range(B):
    n = mask[b].sum()
    toks = [t for t in range(T) if mask[b, t]]
    seq_lr = sum(logp[b, t] - d["old"][b, t] for t in toks) / max(n, 1)
    seq_is = sum(d["old"][b, t] - d["sampler"][b, t] for t in toks)
    row = 0.0
    for t in toks:
      r = np.exp(seq_lr if level == "sequence" else logp[b, t] - d["old"][b, t])
      term = -min(r * adv[b], min(max(r, 1 - eps), 1 + hi) * adv[b])
      if sampler_is == "token":
        term *= min(np.exp(d["old"][b, t] - d["sampler"][b, t]), cap)
      elif sampler_is == "sequence":
        term *= min(np.exp(seq_is), cap)
      x = d["ref"][b, t] - logp[b, t]
      term += beta * (np.exp(x) - x - 1)
      if agg == "token_mean":
        total += term / n_tok
      elif agg == "sequence_mean":
        row += term / n
      else:
        total += term / (B * MAX_LEN)
    total += row / B if agg == "sequence_mean" else 0.0
  return total


def ref_grad(d, adv, **kw):
  """Central differences of the reference loss in each log-prob."""
  g = np.zeros((B, T))
  h = 1e-6
  for b, t in itertools.product(range(B), range(T)):
    up, down = d["logp"].copy(), d["logp"].copy()
    up[b, t] += h
    down[b, t] -= h
    g[b, t] = (ref_loss(up, d, adv, **kw) - ref_loss(down, d, adv, **kw)) / (2 * h)
  return g


# --- the code under test -----------------------------------------------------------------------------

def jax_loss(logp, d, adv, *, agg, level, eps, eps_hi, beta, sampler_is, cap, weights_agg=None):
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  mask = f32(d["mask"])
  w = L.token_weights(mask, weights_agg or agg, jnp.sum(mask), B, MAX_LEN)
  isw = L.sampler_is_weight(f32(d["old"]), f32(d["sampler"]), mask, sampler_is, cap)
  loss, _ = L.policy_loss(logp, f32(d["old"]), f32(adv), mask, w, epsilon=eps, epsilon_high=eps_hi,
                          ratio_level=level, beta=beta, is_weight_BT=isw if sampler_is != "none" else None,
                          ref_BT=f32(d["ref"]))
  return loss


def _close(got, want) -> bool:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return bool(np.max(np.abs(got - want)) <= TOL * max(1.0, np.max(np.abs(want))))


BASE = dict(agg="token_mean", level="token", eps=0.2, eps_hi=None, beta=0.0, sampler_is="none", cap=2.0)
VARIANTS = {
    "token_mean": {}, "sequence_mean": dict(agg="sequence_mean"), "constant": dict(agg="constant"),
    "sequence_ratio": dict(level="sequence"), "sampler_is_token": dict(sampler_is="token", cap=1.1),
    "sampler_is_sequence": dict(sampler_is="sequence", cap=1.5), "clip_higher": dict(eps_hi=0.28),
    "kl": dict(beta=0.1), "gspo_seq_mean_is_kl": dict(agg="sequence_mean", level="sequence", sampler_is="sequence",
                                                       beta=0.05, eps_hi=0.28),
}


@pytest.fixture(scope="module")
def data():
  return _batch()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_reference_and_a_degenerate_group_gets_zero(data, scale):
  got = np.asarray(L.advantages(jnp.asarray(data["rewards"], jnp.float32), G, scale))
  want = ref_advantages(data["rewards"], scale)
  assert _close(got, want)
  np.testing.assert_array_equal(got[G:2 * G], 0.0)  # the group of equal rewards
  # Control: without the group mean the advantages are wrong.
  assert not _close(np.asarray(jnp.asarray(data["rewards"]) / (np.std(data["rewards"]) + 1)), want)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_gradient_equal_the_reference(data, variant, scale):
  kw = dict(BASE, **VARIANTS[variant])
  adv = ref_advantages(data["rewards"], scale)
  want_loss, want_grad = ref_loss(data["logp"], data, adv, **kw), ref_grad(data, adv, **kw)
  loss, grad = jax.value_and_grad(lambda lp: jax_loss(lp, data, adv, **kw))(jnp.asarray(data["logp"], jnp.float32))
  assert _close(loss, want_loss), (float(loss), want_loss)
  assert _close(grad, want_grad)
  assert np.abs(want_grad).max() > 1e-3  # the check sees a real gradient
  # The empty completion gets no gradient; the degenerate group only the KL's.
  np.testing.assert_array_equal(np.asarray(grad)[4], 0.0)
  if kw["beta"] == 0:
    np.testing.assert_array_equal(np.asarray(grad)[G:2 * G], 0.0)


def test_negative_controls_fail_the_same_check(data):
  adv = ref_advantages(data["rewards"], "group")
  lp = jnp.asarray(data["logp"], jnp.float32)
  # sequence_mean computed with token_mean's weights
  kw = dict(BASE, agg="sequence_mean")
  assert not _close(jax_loss(lp, data, adv, **kw, weights_agg="token_mean"), ref_loss(data["logp"], data, adv, **kw))
  # advantages without the group mean (raw rewards)
  assert not _close(jax_loss(lp, data, data["rewards"], **BASE), ref_loss(data["logp"], data, adv, **BASE))
  # clip-higher ignored: the symmetric clip
  kw = dict(BASE, eps_hi=0.28)
  assert not _close(jax.grad(lambda x: jax_loss(x, data, adv, **dict(kw, eps_hi=None)))(lp), ref_grad(data, adv, **kw))
  # the per-token ratio where the sequence ratio is asked for
  kw = dict(BASE, level="sequence")
  assert not _close(jax.grad(lambda x: jax_loss(x, data, adv, **BASE))(lp), ref_grad(data, adv, **kw))
