"""The GRPO loss (rl/loss.py) against a NumPy reference written loop by loop, in float64: the advantages,
the loss and its gradient with respect to the policy log-probs (central differences of the reference),
for each rl.loss_agg, rl.scale_rewards, rl.ratio_level and rl.sampler_is, with beta > 0 and clip-higher,
on a hand-made batch that holds a degenerate group (all rewards equal: advantage 0) and an all-masked
completion. Negative controls: a wrong aggregation, an advantage without the group mean and a clip
without the high epsilon each fail the same check.

The modes TRL names (issue 33) follow TRL's own rule, transcribed from trl/trainer/grpo_trainer.py at
f2cd577 (huggingface/trl): the sampler IS modes token/sequence x truncate/mask with a lower bound, the
ratio-weighted k3 (use_bias_correction_kl), delta, cispo, bnpo over micro-batches, the top-entropy
quantile and the advantages of unscorable (NaN) rewards; each has a negative control (NEGATIVE)."""
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


def ref_loss(logp, d, adv, *, agg, level, eps, eps_hi, beta, sampler_is, cap, is_mode="truncate", floor=None,
             objective="clip", delta=None, cispo_cap=5.0, kl_est="k3", keep=None, weight_logp=None, micro=1):
  """The loss, loop by loop, in float64. TRL's rule for its flags (trl/trainer/grpo_trainer.py, _compute_loss and
  the vLLM importance sampling in _generate_and_score_completions, at f2cd577): the ratio coef_1; cispo
  -clamp(coef_1, max=cap).detach() * A * logp, else -min(min(coef_1, delta) * A, clamp(coef_1, 1 - eps, 1 + hi) * A);
  times the entropy mask, times the sampler IS weight (clamped to [floor, cap], or 0 outside it for the mask modes);
  plus beta * k3 (times coef_1 for use_bias_correction_kl). weight_logp: the log-probs the cispo weight reads
  (its stop_gradient: held fixed while the gradient's differences move logp). micro: bnpo's micro-batches (rows
  m, micro + m, ...)."""
  mask = d["mask"]
  hi = eps if eps_hi is None else eps_hi
  wl = logp if weight_logp is None else weight_logp
  n_tok = mask.sum()
  total = 0.0
  for b in range(B):
    n = mask[b].sum()
    toks = [t for t in range(T) if mask[b, t]]
    seq_lr = sum(logp[b, t] - d["old"][b, t] for t in toks) / max(n, 1)
    seq_wl = sum(wl[b, t] - d["old"][b, t] for t in toks) / max(n, 1)
    seq_is = sum(d["old"][b, t] - d["sampler"][b, t] for t in toks)
    row = 0.0
    for t in toks:
      r = np.exp(seq_lr if level == "sequence" else logp[b, t] - d["old"][b, t])
      if objective == "cispo":
        rw = np.exp(seq_wl if level == "sequence" else wl[b, t] - d["old"][b, t])
        term = -min(rw, cispo_cap) * adv[b] * logp[b, t]
      else:
        term = -min(min(r, delta if delta is not None else np.inf) * adv[b], min(max(r, 1 - eps), 1 + hi) * adv[b])
      if keep is not None:
        term *= keep[b, t]
      if sampler_is != "none":
        w = np.exp(d["old"][b, t] - d["sampler"][b, t]) if sampler_is == "token" else np.exp(seq_is)
        lo = floor if floor is not None else -np.inf
        if is_mode == "truncate":
          term *= min(max(w, lo), cap)
        else:
          term *= w if lo <= w <= cap else 0.0
      x = d["ref"][b, t] - logp[b, t]
      term += beta * (np.exp(x) - x - 1) * (r if kl_est == "k3_ratio" else 1.0)
      if agg == "token_mean":
        total += term / n_tok
      elif agg == "sequence_mean":
        row += term / n
      elif agg == "bnpo":
        total += term / max(mask[b % micro::micro].sum(), 1) / micro  # this row's micro-batch's tokens
      else:
        total += term / (B * MAX_LEN)
    total += row / B if agg == "sequence_mean" else 0.0
  return total


def ref_grad(d, adv, **kw):
  """Central differences of the reference loss in each log-prob (cispo's weight held at the point: its
  stop_gradient)."""
  g = np.zeros((B, T))
  h = 1e-6
  if kw.get("objective") == "cispo" and "weight_logp" not in kw:
    kw = dict(kw, weight_logp=d["logp"])
  for b, t in itertools.product(range(B), range(T)):
    up, down = d["logp"].copy(), d["logp"].copy()
    up[b, t] += h
    down[b, t] -= h
    g[b, t] = (ref_loss(up, d, adv, **kw) - ref_loss(down, d, adv, **kw)) / (2 * h)
  return g


# --- the code under test -----------------------------------------------------------------------------

def jax_loss(logp, d, adv, *, agg, level, eps, eps_hi, beta, sampler_is, cap, weights_agg=None, is_mode="truncate",
             floor=None, objective="clip", delta=None, cispo_cap=5.0, kl_est="k3", keep=None, micro=1,
             weight_logp=None):
  """The loss through rl/loss.py, as rl/step.rl_loss calls it. micro > 1 (bnpo): the train step's micro-batches,
  rows m, micro + m, ... (train/step._split_micro), each weighted by token_weights on its own, summed."""
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  total = 0.0
  for m in range(micro):
    part = (lambda a: a[m::micro]) if micro > 1 else (lambda a: a)  # noqa: E731
    mask = f32(part(d["mask"]))
    old, sampler, ref = (f32(part(d[k])) for k in ("old", "sampler", "ref"))
    w = L.token_weights(mask, weights_agg or agg, jnp.sum(mask), B, MAX_LEN, micro)
    isw = L.sampler_is_weight(old, sampler, mask, sampler_is, cap, mode=is_mode, floor=floor)
    loss, _ = L.policy_loss(part(logp), old, f32(part(adv)), mask, w, epsilon=eps, epsilon_high=eps_hi,
                            ratio_level=level, beta=beta, is_weight_BT=isw if sampler_is != "none" else None,
                            ref_BT=ref, objective=objective, delta=delta, cispo_cap=cispo_cap, kl_estimator=kl_est,
                            keep_BT=None if keep is None else f32(part(keep)))
    total = total + loss if micro > 1 else loss
  return total


def _close(got, want) -> bool:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return bool(np.max(np.abs(got - want)) <= TOL * max(1.0, np.max(np.abs(want))))


def ref_entropy_mask(H, mask, rho):
  """TRL's get_high_entropy_mask, in float64: the (1 - rho) quantile of the completion tokens' entropies
  (torch.quantile's default linear interpolation, numpy's too), and the tokens at or above it."""
  vals = np.asarray(H, np.float64)[mask > 0]
  if vals.size == 0:
    return np.zeros_like(mask)
  thr = np.quantile(vals, 1 - rho)
  return ((np.asarray(H, np.float64) * mask >= thr) & (mask > 0)).astype(np.float64)


# float32, as the step's; higher off the completions (prompt and padding positions), as a control can then see
ENTROPY = (np.random.default_rng(11).uniform(0.1, 3.0, (B, T)) + 2.0 * (1 - _batch()["mask"])).astype(np.float32)
KEEP = ref_entropy_mask(ENTROPY, _batch()["mask"], 0.5)

BASE = dict(agg="token_mean", level="token", eps=0.2, eps_hi=None, beta=0.0, sampler_is="none", cap=2.0)
VARIANTS = {
    "token_mean": {}, "sequence_mean": dict(agg="sequence_mean"), "constant": dict(agg="constant"),
    "sequence_ratio": dict(level="sequence"), "sampler_is_token": dict(sampler_is="token", cap=1.1),
    "sampler_is_sequence": dict(sampler_is="sequence", cap=1.5), "clip_higher": dict(eps_hi=0.28),
    "kl": dict(beta=0.1), "gspo_seq_mean_is_kl": dict(agg="sequence_mean", level="sequence", sampler_is="sequence",
                                                       beta=0.05, eps_hi=0.28),
    # The modes of issue 33, each with its negative control in NEGATIVE. Bounds sit >= 1e-3 from every ratio.
    "sampler_is_token_mask": dict(sampler_is="token", is_mode="mask", cap=1.2, floor=0.85),
    "sampler_is_sequence_mask": dict(sampler_is="sequence", is_mode="mask", cap=1.3, floor=0.8),
    "sampler_is_token_truncate_floor": dict(sampler_is="token", cap=1.15, floor=0.93),
    "kl_k3_ratio": dict(beta=0.1, kl_est="k3_ratio"),
    "kl_k3_ratio_sequence": dict(beta=0.1, kl_est="k3_ratio", level="sequence"),
    "delta": dict(delta=1.3), "cispo": dict(objective="cispo", cispo_cap=1.25),
    "cispo_sequence_kl": dict(objective="cispo", cispo_cap=1.25, level="sequence", beta=0.05),
    "entropy_top_half": dict(keep=KEEP), "bnpo_3_micro_batches": dict(agg="bnpo", micro=3),
}
# What a break of each new mode computes instead: each fails the reference check of the mode.
NEGATIVE = {
    "sampler_is_token_mask": dict(is_mode="truncate"),  # truncated where masking is asked for
    "sampler_is_sequence_mask": dict(sampler_is="token"),  # per token where per sequence is asked for
    "sampler_is_token_truncate_floor": dict(floor=None),  # the lower bound ignored
    "kl_k3_ratio": dict(kl_est="k3"), "kl_k3_ratio_sequence": dict(kl_est="k3"),  # the weight by the ratio dropped
    "delta": dict(delta=None),  # the ratio of negative advantages left uncapped
    "cispo": dict(objective="clip"), "cispo_sequence_kl": dict(cispo_cap=5.0),  # the PPO clip; the cap not binding
    "entropy_top_half": dict(keep=(1 - KEEP) * _batch()["mask"]),  # the low-entropy half
    "bnpo_3_micro_batches": dict(agg="token_mean", micro=1),  # the whole batch's token mean (DAPO)
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


# The new modes act after the advantages: one scale each is enough.
CASES = [(v, s) for v in VARIANTS for s in (["group", "batch", "none"] if v not in NEGATIVE else ["group"])]


@pytest.mark.parametrize("variant, scale", CASES)
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


@pytest.mark.parametrize("variant", list(NEGATIVE))
def test_each_new_mode_has_a_negative_control(data, variant):
  """The variant's reference check (loss and gradient, as above) fails for what a break of it would compute."""
  kw = dict(BASE, **VARIANTS[variant])
  adv = ref_advantages(data["rewards"], "group")
  want_loss, want_grad = ref_loss(data["logp"], data, adv, **kw), ref_grad(data, adv, **kw)
  wrong = dict(kw, **NEGATIVE[variant])
  loss, grad = jax.value_and_grad(lambda lp: jax_loss(lp, data, adv, **wrong))(jnp.asarray(data["logp"], jnp.float32))
  assert not (_close(loss, want_loss) and _close(grad, want_grad))


def test_cispo_stops_the_gradient_of_its_weight(data):
  """CISPO's weight min(ratio, cap) is held constant: the gradient is -w * A / n per token. Control: the gradient a
  missing stop_gradient gives (central differences of the value itself, the weight moving with logp) differs."""
  kw = dict(BASE, **VARIANTS["cispo"])
  adv = ref_advantages(data["rewards"], "group")
  grad = jax.grad(lambda lp: jax_loss(lp, data, adv, **kw))(jnp.asarray(data["logp"], jnp.float32))
  assert _close(grad, ref_grad(data, adv, **kw))
  assert not _close(grad, ref_grad(data, adv, **kw, weight_logp=None))


def test_the_ratio_bounds_act_on_some_tokens_and_not_others(data):
  """The variants above mean something: each bound masks, truncates or caps some completion tokens and leaves
  others alone, and the top-half entropy mask keeps about half."""
  m = data["mask"] > 0
  tok = np.exp(data["old"] - data["sampler"])[m]
  seq = np.exp(((data["old"] - data["sampler"]) * data["mask"]).sum(1))[data["mask"].sum(1) > 0]
  ratio = np.exp(data["logp"] - data["old"])[m]
  for x, lo, hi in ((tok, 0.85, 1.2), (seq, 0.8, 1.3), (tok, 0.93, 1.15)):
    assert (x < lo).any() and (x > hi).any() and ((x >= lo) & (x <= hi)).any()
    assert np.min(np.abs(x[:, None] - np.array([lo, hi]))) > 1e-3
  adv = ref_advantages(data["rewards"], "group")
  neg = (np.broadcast_to(adv[:, None], data["mask"].shape)[m] < 0)
  assert ((ratio > 1.3) & neg).any() and (ratio > 1.25).any()  # delta and the cispo cap bind somewhere
  assert abs(KEEP.sum() - m.sum() / 2) <= 1


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_entropy_mask_equals_trls_quantile_rule(data, rho):
  got = np.asarray(L.entropy_mask(jnp.asarray(ENTROPY), jnp.asarray(data["mask"], jnp.float32), rho))
  want = ref_entropy_mask(ENTROPY, data["mask"], rho)
  np.testing.assert_array_equal(got, want)
  m = data["mask"] > 0
  assert want[m].sum() == (1 if rho == 0 else m.sum() if rho == 1 else want[m].sum()) and not want[~m].any()
  if 0 < rho < 1:
    # Control: the quantile taken over every position (prompt and padding too) keeps another set.
    every = np.asarray(L.entropy_mask(jnp.asarray(ENTROPY), jnp.ones((B, T), jnp.float32), rho)) * data["mask"]
    assert not np.array_equal(every, want)
  empty = np.asarray(L.entropy_mask(jnp.asarray(ENTROPY), jnp.zeros((B, T), jnp.float32), rho))
  assert not empty.any()  # no completion token: none kept (TRL returns zeros)


def ref_advantages_nan(r, scale):
  """TRL's advantages with unscorable (NaN) rewards, in float64: nanmean, its nanstd (Bessel-corrected, NaN below
  2 values), then NaN advantages to 0 (grpo_trainer.py, _generate_and_score_completions)."""
  def nanstd(x):
    v = [a for a in x if not np.isnan(a)]
    if len(v) < 2:
      return np.nan
    mu = sum(v) / len(v)
    return np.sqrt(sum((a - mu) ** 2 for a in v) / (len(v) - 1))
  out = np.zeros_like(r)
  for g in range(len(r) // G):
    grp = r[g * G:(g + 1) * G]
    v = [a for a in grp if not np.isnan(a)]
    mean = sum(v) / len(v) if v else np.nan
    std = nanstd(grp) if scale == "group" else nanstd(r)
    for j in range(G):
      a = grp[j] - mean
      if scale != "none":
        a /= std + L.STD_EPS
      out[g * G + j] = 0.0 if np.isnan(a) else a
  return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_leave_unscorable_rewards_out_as_trl_does(scale):
  """rl.failed_reward=exclude: a NaN reward is left out of its group's mean and std and gets 0; a group with one
  scorable reward (std NaN) and an all-NaN group get 0 throughout. Without NaN it is `advantages`. Control: NaN
  scored 0 (rl.failed_reward=zero) gives other advantages."""
  r = np.array([1.0, np.nan, 0.25, 0.7, np.nan, np.nan, np.nan, np.nan, np.nan])
  got = np.asarray(L.advantages_excluding_nan(jnp.asarray(r, jnp.float32), G, scale))
  want = ref_advantages_nan(r, scale)
  assert _close(got, want) and np.isfinite(got).all() and np.abs(want).max() > 0.1
  np.testing.assert_array_equal(got[[1, 4, 5, 6, 7, 8]], 0.0)
  assert not _close(np.asarray(L.advantages(jnp.asarray(np.nan_to_num(r), jnp.float32), G, scale)), want)
  full = _batch()["rewards"]
  assert _close(np.asarray(L.advantages_excluding_nan(jnp.asarray(full, jnp.float32), G, scale)),
                ref_advantages(full, scale))
