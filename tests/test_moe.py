"""The MoE layer (nn/moe/) against its reference (nn/moe_reference.py), numpy and its plain variants.

- Dropless equals every-expert-on-every-token: forward and every gradient, float32, with routing
  forced uneven (expert 0 gets every token, two experts get none) at odd sizes, each grouped-matmul
  implementation with norm_topk on, and off on the CPU default; a wrong unsort fails the same check
  (negative control).
- The grouped matmul (block scan and ragged_dot) against per-group numpy, empty and full groups.
- Aux losses against a numpy transcription of transformers' load_balancing_loss_func and the z-loss.
- Speedup 1: one sort in forward + backward (the plain argsort unsort has two), and its gradient
  bit-identical to autodiff of the plain gather, -0 cotangents included.
- Speedup 2: fused_glu bit-identical to autodiff of the split (plain and under jax.checkpoint), one
  grouped matmul for gate|up, no pad in the backward, and the same named residuals saved.
- Explicit and auto sharding (fsdp=2) inside jit give the unsharded numbers.
"""
import dataclasses
import functools
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm.config import load_config
from meshlm.nn import moe
from meshlm.nn.moe import dropless, gmm, rows
from meshlm.nn.dense import dense
from meshlm.nn.moe_reference import moe_mlp_reference
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import logical_spec

from moe_helpers import count_primitives, count_sorts, settings

B, T, D, F, E, K = 3, 13, 24, 20, 8, 2  # odd sizes: 39 tokens, 78 (token, slot) pairs
TOL = 1e-6  # float32 reassociation: max |diff| <= TOL * max(1, max |reference|), per leaf


def _uneven_inputs(seed: int = 0):
  """x and params whose router sends every token to expert 0 and none to experts E-2, E-1."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  x[..., 0] = np.abs(x[..., 0]) + 1.0  # feature 0 >= 1 for every token
  router = (0.1 * rng.standard_normal((D, E))).astype(np.float32)
  router[0, 0], router[0, E - 2], router[0, E - 1] = 3.0, -8.0, -8.0
  s = lambda n: 1 / np.sqrt(n)  # noqa: E731
  p = {
      "router": router,
      "gate": (s(D) * rng.standard_normal((E, D, F))).astype(np.float32),
      "up": (s(D) * rng.standard_normal((E, D, F))).astype(np.float32),
      "down": (s(F) * rng.standard_normal((E, F, D))).astype(np.float32),
  }
  return jnp.asarray(x), jax.tree.map(jnp.asarray, p)


def _loss(y, side):
  # A cotangent that differs per element, plus the aux losses so the router gets their gradient too.
  c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
  return jnp.sum(c * y) / y.shape[0] + side["moe_load_balance_loss"] + 0.1 * side["moe_z_loss"]


def _dropless(norm_topk, **kw):
  def f(p, x):
    y, side = moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=norm_topk, **kw))
    return _loss(y, side), y
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


@functools.cache
def _dropless_out(norm_topk, **kw):
  """((loss, y), (d_params, d_x)) of the dropless layer on _uneven_inputs(), once per setting for the module."""
  x, p = _uneven_inputs()
  return _dropless(norm_topk, **kw)(p, x)


def _reference(norm_topk):
  def f(p, x):
    y, r = moe_mlp_reference(p, x, num_experts=E, k=K, norm_topk=norm_topk)
    side = moe.aux_stats(r["logits"], r["probs"], r["ids"], E)
    return _loss(y, side), y
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _max_rel_diffs(out, ref) -> dict:
  (loss, y), (gp, gx) = out
  (rloss, ry), (rgp, rgx) = ref
  pairs = {"loss": (loss, rloss), "y": (y, ry), "d_x": (gx, rgx)} | {f"d_{k}": (gp[k], rgp[k]) for k in rgp}
  return {k: float(jnp.max(jnp.abs(a - b)) / max(1.0, float(jnp.max(jnp.abs(b))))) for k, (a, b) in pairs.items()}


@pytest.fixture(scope="module")
def uneven():
  x, p = _uneven_inputs()
  return x, p, {nt: _reference(nt)(p, x) for nt in (True, False)}


def test_routing_is_as_uneven_as_constructed(uneven):
  x, p, _ = uneven
  logits = jnp.einsum("btd,de->bte", x, p["router"])
  _, _, ids = moe.route(logits, K, True)
  counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
  assert counts[0] == B * T  # one expert gets every token...
  assert counts[E - 2] == counts[E - 1] == 0  # ...and two get none
  assert counts.sum() == B * T * K


DROPLESS_ARMS = {
    "loop": dict(grouped_matmul="loop"),
    "loop-b8-split-argsort": dict(grouped_matmul="loop", block_rows=8, fused_gate_up=False, unsort_impl="argsort"),
    "blocks": dict(grouped_matmul="blocks"),
    "blocks-b4-split-argsort": dict(grouped_matmul="blocks", block_rows=4, fused_gate_up=False, unsort_impl="argsort"),
    "ragged": dict(grouped_matmul="ragged"),
    "megablox": dict(grouped_matmul="megablox"),  # Pallas interpret mode on CPU
}


# norm_topk is the router's (route's weights), before any dispatch: every arm with it on, and without it the arm the
# models run on CPU (grouped_matmul "auto" is "loop" there); the other arms take the same weights either way.
@pytest.mark.parametrize("arm, norm_topk", [(arm, True) for arm in DROPLESS_ARMS] + [("loop", False)])
def test_dropless_equals_reference(uneven, arm, norm_topk):
  _, _, refs = uneven
  diffs = _max_rel_diffs(_dropless_out(norm_topk, **DROPLESS_ARMS[arm]), refs[norm_topk])
  print(arm, norm_topk, diffs)
  assert set(diffs) == {"loss", "y", "d_x", "d_router", "d_gate", "d_up", "d_down"}
  assert max(diffs.values()) <= TOL, diffs


def test_norm_topk_changes_the_output(uneven):
  _, _, refs = uneven
  assert float(jnp.max(jnp.abs(refs[True][0][1] - refs[False][0][1]))) > 1e-2


def test_impl_reference_is_the_reference_and_unknown_impls_are_refused(uneven):
  x, p, refs = uneven
  y, side = moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True, impl="reference"))
  np.testing.assert_allclose(y, refs[True][0][1], rtol=1e-6, atol=1e-6)
  assert set(side) == {"moe_load_balance_loss", "moe_z_loss", "moe_expert_fraction", "moe_expert_prob", "moe_expert_ids",
                       "moe_dropped"}
  assert float(side["moe_dropped"]) == 0.0  # only the compact expert-parallel dispatch drops
  with pytest.raises(ValueError, match="impl='capacity'"):
    knobs, opts = settings(E, K, norm_topk_prob=True)  # past the section's own check (it refuses it too)
    moe.moe_mlp(p, x, None, knobs.model_copy(update=dict(impl="capacity")), opts)


def test_wrong_unsort_fails_the_reference_check(uneven, monkeypatch):
  # Negative control: unsorting by perm itself instead of its inverse must not pass.
  x, p, refs = uneven
  monkeypatch.setattr(rows, "inverse_permutation", lambda perm: perm)
  diffs = _max_rel_diffs(_dropless(True)(p, x), refs[True])
  assert diffs["y"] > 1e-2


# loop with block_rows=b: blocks of b rows, then of b // 4 (the last may run past its group's end).
@pytest.mark.parametrize("impl,block_rows", [("loop", None), ("loop", 4), ("loop", 8), ("blocks", 4), ("blocks", 16),
                                             ("ragged", None), ("megablox", None)])
def test_grouped_matmul_matches_numpy(impl, block_rows):
  rng = np.random.default_rng(1)
  sizes = np.array([0, 11, 0, 1, 5, 0], np.int32)  # empty groups first, in between and last
  rows = int(sizes.sum())
  x = rng.standard_normal((rows, 7)).astype(np.float32)
  w = rng.standard_normal((len(sizes), 7, 9)).astype(np.float32)
  c = rng.standard_normal((rows, 9)).astype(np.float32)
  e_of_row = np.repeat(np.arange(len(sizes)), sizes)
  want = np.einsum("rd,rdf->rf", x, w[e_of_row])
  want_dx = np.einsum("rf,rdf->rd", c, w[e_of_row])
  want_dw = np.zeros_like(w)
  np.add.at(want_dw, e_of_row, np.einsum("rd,rf->rdf", x, c))
  fn = lambda x, w: moe.grouped_matmul(x, w, jnp.asarray(sizes), impl=impl, block_rows=block_rows)  # noqa: E731
  y, vjp = jax.vjp(jax.jit(fn), jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(c))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(dw)[sizes == 0])  # experts with no rows get no gradient
  # A tuple of kernels is one grouped matmul against their concatenation (the fused gate|up).
  split = lambda x, w1, w2: moe.grouped_matmul(x, (w1, w2), jnp.asarray(sizes), impl=impl,  # noqa: E731
                                               block_rows=block_rows)
  y2, vjp2 = jax.vjp(jax.jit(split), jnp.asarray(x), jnp.asarray(w[..., :4]), jnp.asarray(w[..., 4:]))
  dx2, dw1, dw2 = vjp2(jnp.asarray(c))
  np.testing.assert_allclose(y2, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx2, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.concatenate([dw1, dw2], -1), want_dw, rtol=1e-5, atol=1e-5)


def test_loop_with_shifted_group_starts_fails_the_numpy_check(monkeypatch):
  # Negative control for the expert loop: each expert reading its rows one row late must not pass.
  rng = np.random.default_rng(1)
  sizes = np.array([0, 11, 0, 1, 5, 0], np.int32)
  x = rng.standard_normal((17, 7)).astype(np.float32)
  w = rng.standard_normal((6, 7, 9)).astype(np.float32)
  want = np.einsum("rd,rdf->rf", x, w[np.repeat(np.arange(6), sizes)])
  real = gmm._expert_rows
  monkeypatch.setattr(gmm, "_expert_rows", lambda s: (real(s)[0] + 1, real(s)[1]))
  y = moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), impl="loop", block_rows=4)
  assert np.max(np.abs(np.asarray(y) - want)) > 1e-1


def test_block_layout_covers_each_row_once():
  sizes = jnp.array([3, 0, 9, 1], jnp.int32)
  src, dst, block_expert, live = moe.block_layout(sizes, 13, 4)
  src, dst = np.asarray(src), np.asarray(dst)
  assert np.array_equal(src[dst], np.arange(13))  # dst and src are inverse on the real rows
  assert np.sum(src < 13) == 13  # every other padded row reads the zero fill
  assert list(np.asarray(block_expert)[np.asarray(live)]) == [0, 2, 2, 2, 3]


def test_unknown_grouped_matmul_is_refused():
  with pytest.raises(ValueError, match="grouped_matmul='nope'"):
    moe.grouped_matmul(jnp.ones((2, 3)), jnp.ones((1, 3, 4)), jnp.array([2]), impl="nope")


def test_unknown_unsort_is_refused():
  x, p = _uneven_inputs()
  with pytest.raises(ValueError, match="unsort_impl='nope'"):
    moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True, unsort_impl="nope"))


def test_top_k_above_num_experts_is_refused():
  x, p = _uneven_inputs()
  knobs, opts = settings(E, K, norm_topk_prob=True)
  with pytest.raises(ValueError, match="num_experts_per_tok=9"):  # past the section's own check, as above
    moe.moe_mlp(p, x, None, knobs.model_copy(update=dict(num_experts_per_tok=9)), opts)


# --- aux losses against transformers' formula --------------------------------------------------------

def _hf_load_balancing_loss(gate_logits: list[np.ndarray], num_experts: int, top_k: int, mask=None) -> float:
  """numpy transcription of transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
  (layers: [tokens, experts] logits; mask: [tokens] or None)."""
  tokens_sum = np.zeros(num_experts)
  prob_sum = np.zeros(num_experts)
  total_rows = 0.0
  for logits in gate_logits:
    z = logits - logits.max(-1, keepdims=True)
    w = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    selected = np.argsort(-w, axis=-1, kind="stable")[:, :top_k]
    m = np.ones(len(w)) if mask is None else mask.astype(np.float64)
    tokens_sum += np.bincount(selected.ravel(), weights=np.repeat(m, top_k), minlength=num_experts)
    prob_sum += (w * m[:, None]).sum(0)
    total_rows += m.sum()
  return float(np.sum((tokens_sum / total_rows) * (prob_sum / total_rows)) * num_experts)


def _z_loss(logits, mask):
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return float(np.sum(lse ** 2 * mask) / mask.sum())


def test_aux_losses_match_transformers_formula():
  rng = np.random.default_rng(2)
  layers = [rng.standard_normal((B, T, E)).astype(np.float32) * s for s in (1.0, 3.0)]
  mask = (rng.random((B, T)) > 0.3).astype(np.float32)
  sides = []
  for logits in layers:
    probs, _, ids = moe.route(jnp.asarray(logits), K, True)
    side = moe.aux_stats(jnp.asarray(logits), probs, ids, E, jnp.asarray(mask))
    assert all(v.dtype == jnp.float32 for v in side.values())
    flat = logits.reshape(-1, E)
    assert abs(float(side["moe_load_balance_loss"]) - _hf_load_balancing_loss([flat], E, K, mask.ravel())) < 1e-5
    assert abs(float(side["moe_z_loss"]) - _z_loss(flat, mask.ravel())) < 1e-4
    np.testing.assert_allclose(jnp.sum(side["moe_expert_fraction"]), K, rtol=1e-6)
    sides.append(side)
  stacked = {k: jnp.stack([s[k] for s in sides]) for k in sides[0]}
  hf = _hf_load_balancing_loss([lg.reshape(-1, E) for lg in layers], E, K, mask.ravel())
  assert abs(float(moe.load_balancing_loss(stacked)) - hf) < 1e-5
  # The mean of the per-layer losses is a different number: the combination over layers matters.
  assert abs(float(jnp.mean(stacked["moe_load_balance_loss"])) - hf) > 1e-3
  # Without the mask the padding counts, and the number moves.
  unmasked = moe.aux_stats(jnp.asarray(layers[0]), *moe.route(jnp.asarray(layers[0]), K, True)[::2], E)
  assert abs(float(unmasked["moe_load_balance_loss"]) - float(sides[0]["moe_load_balance_loss"])) > 1e-4


# --- speedup 1: the unsort reuses the sort's permutation ---------------------------------------------

def _layer_grad(unsort_impl):
  x, p = _uneven_inputs()

  def f(p, x):
    return _loss(*moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True, unsort_impl=unsort_impl)))
  return jax.grad(f, argnums=(0, 1)), (p, x)


def test_one_sort_in_forward_and_backward():
  for impl, want in (("perm", 1), ("argsort", 2)):
    g, args = _layer_grad(impl)
    s = settings(E, K, norm_topk_prob=True, unsort_impl=impl)
    fwd = lambda p, x: moe.moe_mlp(p, x, None, *s)  # noqa: E731
    assert count_sorts(fwd, *args) == want
    assert count_sorts(g, *args) == want  # forward + backward: the backward adds none


def test_remat_saving_the_permutation_keeps_the_backward_sort_free():
  g, (p, x) = _layer_grad("perm")
  f = lambda p, x: jnp.sum(moe.moe_mlp(p, x, None, *settings(E, K, norm_topk_prob=True))[0])  # noqa: E731
  cp = jax.checkpoint_policies
  dots = jax.checkpoint(f, policy=cp.checkpoint_dots)
  dots_perm = jax.checkpoint(f, policy=cp.save_from_both_policies(
      cp.checkpoint_dots, cp.save_only_these_names(*moe.REMAT_SAVE_NAMES)))
  assert count_sorts(jax.grad(dots), p, x) == 2  # the argsort is replayed in the backward
  assert count_sorts(jax.grad(dots_perm), p, x) == 1


def _int_gathers(jaxpr) -> int:
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  n = sum(e.primitive.name == "gather" and jnp.issubdtype(e.invars[0].aval.dtype, jnp.integer) for e in jaxpr.eqns)
  return n + sum(_int_gathers(sub) for e in jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(e.params))


def test_token_of_each_slot_is_perm_floordiv_k_not_an_index_gather():
  x, p = _uneven_inputs()
  s = settings(E, K, norm_topk_prob=True, grouped_matmul="ragged")
  fwd = lambda p, x: moe.moe_mlp(p, x, None, *s)[0]  # noqa: E731
  assert _int_gathers(jax.make_jaxpr(fwd)(p, x)) == 0
  # Negative control: the repeated-token-id formulation is an int32 gather.
  perm = jnp.arange(6, dtype=jnp.int32)
  assert _int_gathers(jax.make_jaxpr(lambda q: jnp.repeat(jnp.arange(3), 2)[q])(perm)) == 1


def test_layer_gradient_is_bit_identical_to_the_argsort_unsort():
  """The layer's loss, output and every gradient with the perm unsort (the "loop" arm of the reference check, the
  CPU default) against the same layer with the argsort unsort, bit for bit."""
  a = _dropless_out(True, **DROPLESS_ARMS["loop"])
  b = _dropless_out(True, **DROPLESS_ARMS["loop"], unsort_impl="argsort")
  assert len(jax.tree.leaves(a)) == 3 + len(_uneven_inputs()[1])  # loss, y, d_x and each parameter's
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.array_equal(np.asarray(u).view(np.uint32), np.asarray(v).view(np.uint32))


def _cotangent_with_signed_zeros(shape, seed):
  rng = np.random.default_rng(seed)
  d = rng.standard_normal(shape).astype(np.float32)
  d[::3] = 0.0  # zero cotangent rows
  d[1::5] = -0.0
  return jnp.asarray(d)


def _bits(a):
  return np.asarray(a).view(np.uint32)


def test_unsort_backward_is_bit_identical_to_a_plain_gather():
  A = 23
  rng = np.random.default_rng(3)
  perm = jnp.asarray(rng.permutation(A).astype(np.int32))
  inv = moe.inverse_permutation(perm)
  assert np.array_equal(np.asarray(perm)[np.asarray(inv)], np.arange(A))
  ys = jnp.asarray(rng.standard_normal((A, 5)).astype(np.float32))
  dy = _cotangent_with_signed_zeros((A, 5), 4)
  plain = jax.jit(jax.vjp(lambda y: y[inv], ys)[1])(dy)[0]
  fast = jax.jit(jax.vjp(lambda y: moe.unsort(y, perm, inv), ys)[1])(dy)[0]
  assert np.array_equal(_bits(fast), _bits(plain))
  # Negative control: the raw gather keeps -0 where autodiff's scatter-add gives +0.
  assert not np.array_equal(_bits(dy[perm]), _bits(plain))
  assert count_sorts(jax.grad(lambda y: jnp.sum(moe.unsort(y, perm, inv) * dy)), ys) == 0


# --- speedup 2: fused gate|up with the fused GLU VJP -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_glu_no_zero_fix(act, h):
  return moe.split_glu(act, h)


def _nofix_fwd(act, h):
  return moe.split_glu(act, h), h


def _nofix_bwd(act, h, d):
  F_ = h.shape[-1] // 2
  _, vjp = jax.vjp(lambda g, u: act(g) * u, h[..., :F_], h[..., F_:])
  return (jnp.concatenate(vjp(d), axis=-1),)


_fused_glu_no_zero_fix.defvjp(_nofix_fwd, _nofix_bwd)


@pytest.mark.parametrize("act", [jax.nn.silu, functools.partial(jax.nn.gelu, approximate=True)],
                         ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("remat", [False, True])
def test_fused_glu_is_bit_identical_to_the_split(act, remat):
  rng = np.random.default_rng(5)
  h = jnp.asarray(rng.standard_normal((37, 2 * 11)).astype(np.float32))
  d = _cotangent_with_signed_zeros((37, 11), 6)
  wrap = jax.checkpoint if remat else (lambda f: f)

  def run(glu):
    y, vjp = jax.vjp(wrap(lambda h: glu(act, h)), h)
    return y, vjp(d)[0]
  (y1, g1), (y2, g2) = jax.jit(functools.partial(run, moe.fused_glu))(), jax.jit(functools.partial(run, moe.split_glu))()
  assert np.array_equal(_bits(y1), _bits(y2))
  assert np.array_equal(_bits(g1), _bits(g2))
  # Negative control: without where(d == 0, 0, d) the -0 of zero cotangent rows survives.
  _, g3 = jax.jit(functools.partial(run, _fused_glu_no_zero_fix))()
  assert not np.array_equal(_bits(g3), _bits(g2))


def _jaxpr_counts(fused):
  x, p = _uneven_inputs()
  s = settings(E, K, norm_topk_prob=True, fused_gate_up=fused, grouped_matmul="ragged")
  fwd = jax.make_jaxpr(lambda p, x: moe.moe_mlp(p, x, None, *s)[0])(p, x)
  grad = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(moe.moe_mlp(p, x, None, *s)[0])))(p, x)
  return count_primitives(fwd, ("ragged_dot_general",)), count_primitives(grad, ("pad",))


def test_fused_gate_up_is_one_grouped_matmul_with_no_pad_in_the_backward():
  assert _jaxpr_counts(True) == (2, 0)  # gate|up and down; the GLU backward concatenates
  assert _jaxpr_counts(False) == (3, 0)  # the split arm: three grouped matmuls
  # The fused matmul with a plain split GLU: autodiff pads each half-gradient.
  x, p = _uneven_inputs()
  h = jnp.ones((5, 8))
  assert count_primitives(jax.make_jaxpr(jax.grad(lambda h: jnp.sum(moe.split_glu(jax.nn.silu, h))))(h), ("pad",)) == 2
  assert count_primitives(jax.make_jaxpr(jax.grad(lambda h: jnp.sum(moe.fused_glu(jax.nn.silu, h))))(h), ("pad",)) == 0


def test_fused_glu_saves_the_same_named_residuals():
  from jax._src.ad_checkpoint import saved_residuals
  h = jnp.ones((5, 8))
  policy = jax.checkpoint_policies.save_only_these_names("moe_gate", "moe_up")

  def saved(glu):
    f = jax.checkpoint(lambda h: jnp.sum(glu(jax.nn.silu, h * 2.0)), policy=policy)
    return sorted((tuple(a.shape), why.split(" from ")[0]) for a, why in saved_residuals(f, h) if "moe_" in why)
  fused, split = saved(moe.fused_glu), saved(moe.split_glu)
  assert split == [((5, 4), "named 'moe_gate'"), ((5, 4), "named 'moe_up'")]
  assert fused == split


# --- sharding -----------------------------------------------------------------------------------------

SPEC = moe.moe_spec(D, E, F, kernel_fsdp="embed")


@pytest.fixture(scope="module")
def unsharded_4_rows(uneven):
  """The unsharded dropless layer on B + 1 = 4 rows (the sharded test's input), once for both modes."""
  x, p, _ = uneven
  return _dropless(True)(p, jnp.concatenate([x, x[:1]]))


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_sharded_equals_unsharded(uneven, unsharded_4_rows, mode):
  x, p, _ = uneven
  mesh = make_mesh(load_config("cpu_devices=2", "mesh.fsdp=2", f"shard_mode={mode}"))
  ctx = type("Ctx", (), {"dense": staticmethod(functools.partial(dense, kernel_order=True))})

  def f(p, x):
    y, side = moe.moe_mlp(p, x, ctx, *settings(E, K, norm_topk_prob=True))
    return _loss(y, side), y
  with jax.set_mesh(mesh):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
    ps = {k: put(v, SPEC[k].axes) for k, v in p.items()}
    xs = put(jnp.concatenate([x, x[:1]]), ("batch", "length", "act_embed"))  # B = 4: sharded on fsdp
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(ps, xs)
    if mode == "explicit":
      assert "fsdp" in str(jax.typeof(got[0][1]))  # the output stays batch-sharded
  diffs = _max_rel_diffs(got, unsharded_4_rows)
  assert max(diffs.values()) <= TOL, diffs


# --- the reference path on a mesh ----------------------------------------------------------------------------

def _reference_on_fsdp4(impl: str, mode: str):
  """(loss, grads as numpy) of one batch through mixtral-tiny (shrunk) on fsdp=4 with model.moe_impl=impl."""
  from meshlm.models.params import init_params
  from meshlm.train.step import BATCH_SPEC, grads_and_loss
  cfg = load_config("model=mixtral-tiny", "cpu_devices=4", "mesh.fsdp=4", f"shard_mode={mode}", f"model.parts.moe.impl={impl}",
                    "model.embed_dim=64", "model.parts.moe.mlp_dim=64", "model.head_dim=16", "model.num_layers=1",
                    "model.vocab_size=128", "train.seq_len=16", "train.per_device_batch_size=1",
                    "train.compute_dtype=float32")
  mesh = make_mesh(cfg)
  rng = np.random.default_rng(0)
  toks = rng.integers(0, cfg.model.vocab_size, (4, 17)).astype(np.int32)
  batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((4, 16), np.int32),
           "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (4, 16)).copy(),
           "loss_mask": np.ones((4, 16), np.float32)}
  with jax.set_mesh(mesh):
    params = init_params(cfg, jax.random.key(0), mesh)
    put = {k: jax.device_put(v, NamedSharding(mesh, logical_spec(BATCH_SPEC[k].axes(), v.shape, mesh)))
           for k, v in batch.items()}
    loss, grads = jax.jit(lambda p, b: grads_and_loss(cfg, p, b)[:2])(params, put)
  return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("mode", ["explicit"])
def test_reference_impl_runs_on_fsdp4_and_equals_dropless(mode):
  """model.parts.moe.impl=reference on fsdp=4 (it raised under explicit: its einsums had no one output sharding) gives
  the dropless path's loss and gradients. Explicit only, where it raised (an auto arm cost a
  compile per impl for no case of its own: dropless explicit == auto is every MoE family's row of
  tests/test_conformance.py)."""
  (l_ref, g_ref), (l_drop, g_drop) = _reference_on_fsdp4("reference", mode), _reference_on_fsdp4("dropless", mode)
  assert abs(l_ref - l_drop) <= 1e-5 * abs(l_drop)
  for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_drop)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(np.max(np.abs(b)))))


def _copied_knobs(cls) -> set[str]:
  """The fields of a dataclass named like a knob of the moe section: a second copy with a default of its own."""
  from meshlm.models.ffns.moe import MoEConfig
  return {f.name for f in dataclasses.fields(cls)} & set(MoEConfig.model_fields)


def test_the_parts_section_reaches_the_layer_itself(monkeypatch):
  """The part hands moe_mlp its section object itself (no record copied from it field by field), and the layer's
  Options declare no knob of the section again. Control: a record re-declaring kernel_fsdp is seen."""
  from meshlm.config import load_config
  from meshlm.models.ffns import moe as part
  from meshlm.models.model import resolve
  assert _copied_knobs(moe.Options) == set()

  @dataclasses.dataclass(frozen=True)
  class Copying:
    activation: object = None
    kernel_fsdp: str = "embed"
  assert _copied_knobs(Copying) == {"kernel_fsdp"}
  m = resolve(load_config("model=deepseek-v3-tiny", "model.parts.moe.ep_impl=compact",
                          "model.parts.moe.ep_buffer_factor=1.5")).m
  seen = []
  monkeypatch.setattr(moe, "moe_mlp", lambda p, x, ctx, knobs, opts, **kw: seen.append((knobs, opts)) or (x, {}))
  ctx = types.SimpleNamespace(model=m, layer={}, cast=lambda w, dt: w.astype(dt), here=types.SimpleNamespace(
      segment_ids=None))
  part.apply({"router_full": None, "router_bias": None}, jnp.zeros((1, 2, m.embed_dim)), ctx, routing="group_sigmoid")
  (knobs, opts), = seen
  assert knobs is part.knobs(m) and (knobs.ep_impl, knobs.ep_buffer_factor) == ("compact", 1.5)
  assert opts.cast is ctx.cast  # the kernels cast by the context's rule


def test_auto_grouped_matmul_follows_the_programs_platform_not_the_hosts():
  """meshlm compile traces a TPU topology's program on a CPU host: auto builds megablox there (a pallas_call), as the TPU
  run does (the host's default backend would pick the CPU's loop). Control: a CPU mesh keeps the loop."""
  from meshlm.parallel import topology as TP
  xs, w, sizes = jnp.ones((16, 8)), jnp.ones((4, 8, 8)), jnp.array([4, 4, 4, 4])
  built = {}
  for name, devices in (("tpu", TP.devices(TP.parse("v5p:2x2x1"))), ("cpu", jax.devices("cpu")[:1])):
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("fsdp",))
    with jax.set_mesh(mesh):
      jaxpr = str(jax.make_jaxpr(lambda a, b, c: gmm.grouped_matmul(a, b, c))(xs, w, sizes))
      built[name] = (gmm.default_grouped_matmul(), "pallas_call" in jaxpr)
  assert built == {"tpu": ("megablox", True), "cpu": ("loop", False)}
