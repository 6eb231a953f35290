"""RoPE as one full-width pass (nn/rope.apply_rope: x * cos + roll(x, H/2) * sin_signed, with sin's first half
negated once per step in the context) against the rotate-half formula it replaced (x * cos + concatenate([-x2, x1])
* sin, kept here as the reference): bit for bit, forward and gradient, alone at awkward sizes and through every
path that rotates (gqa, gated_gqa's partial rotary, mla's rotate-half and interleaved pairs, gemma3's local theta;
training loss and gradients, prefill and decode), with the halves swapped both ways (jnp.roll; the permutation
matmul TPU programs use, run here on XLA:CPU). A roll without the sign fold fails the same checks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.analysis.golden import shrink
from meshlm.models import context, decoder
from meshlm.models.mixers import gated_gqa, mla
from meshlm.nn import rope as R
from meshlm.train.step import grads_and_loss


def rotate_half_reference(x_BNTH, cos_BTH, sin_BTH):
  """The formula apply_rope had (HF's rotate_half), on the plain sin [s, s]."""
  half = x_BNTH.shape[-1] // 2
  xf = x_BNTH.astype(jnp.float32)
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos_BTH[:, None] + rotated * sin_BTH[:, None]).astype(x_BNTH.dtype)


def interleave_reference(x_BNTH, cos_BTH, sin_BTH):
  """apply_rope_interleave as it was, reading the plain sin's first half."""
  half = x_BNTH.shape[-1] // 2
  cos, sin = cos_BTH[:, None, :, :half], sin_BTH[:, None, :, :half]
  xf = x_BNTH.astype(jnp.float32)
  x1, x2 = xf[..., 0::2], xf[..., 1::2]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BNTH.dtype)


def unfold_sign(sin_signed):
  """The plain sin back from the folded one (exact: a negation)."""
  half = sin_signed.shape[-1] // 2
  return jnp.concatenate([-sin_signed[..., :half], sin_signed[..., half:]], axis=-1)


def roll_without_sign_fold(x_BNTH, cos_BTH, sin_BTH):
  """A broken variant: the roll, times the plain sin (rotates the first half the wrong way)."""
  xf = x_BNTH.astype(jnp.float32)
  y = xf * cos_BTH[:, None] + jnp.roll(xf, x_BNTH.shape[-1] // 2, axis=-1) * sin_BTH[:, None]
  return y.astype(x_BNTH.dtype)


def _tables(positions, width, scaling=None):
  return R.freqs_at(jnp.asarray(positions), width, 1e6, scaling)


def _rotate_and_grad(fn, x, cos, sin, ct):
  y, vjp = jax.vjp(lambda x: fn(x, cos, sin), x)
  return y, vjp(ct)[0]


# H = 128 (qwen3's head), 64 (MLA's rope width, llama2-tiny's head), 32 and 8 (partial rotary widths); odd T.
@pytest.mark.parametrize("width", [128, 64, 32, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position": 4096}])
def test_apply_rope_equals_rotate_half_bit_for_bit(width, dtype, scaling):
  rng = np.random.default_rng(width)
  B, N, T = 2, 3, 7
  x = jnp.asarray(rng.standard_normal((B, N, T, width)), dtype)
  ct = jnp.asarray(rng.standard_normal((B, N, T, width)), dtype)
  positions = rng.integers(0, 200_000, (B, T)).astype(np.int32)  # far positions: every angle's sin and cos sign
  cos, sin = _tables(positions, width, scaling)
  want = jax.jit(lambda x, c, s, ct: _rotate_and_grad(rotate_half_reference, x, c, s, ct))(x, cos, sin, ct)
  for by_matmul in (False, True):
    rope = lambda x, c, s: R.apply_rope(x, c, s, by_matmul)  # noqa: E731
    got = jax.jit(lambda x, c, s, ct: _rotate_and_grad(rope, x, c, s, ct))(x, cos, R.fold_sign(sin), ct)
    for g, w in zip(got, want):
      assert g.dtype == w.dtype == jnp.dtype(dtype)
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  # The control: the roll times the unfolded sin is another rotation, and the same comparison sees it.
  broken = jax.jit(lambda x, c, s, ct: _rotate_and_grad(roll_without_sign_fold, x, c, s, ct))(x, cos, sin, ct)
  for b, w in zip(broken, want):
    assert not np.array_equal(np.asarray(b, np.float32), np.asarray(w, np.float32))


def test_the_tables_gradients_are_the_rotate_half_formulas():
  """cos's and the folded sin's cotangents (unused in training, where the tables come from integer positions) equal
  the reference's, the sin's through the fold (a negated first half)."""
  rng = np.random.default_rng(5)
  x, ct = (jnp.asarray(rng.standard_normal((2, 3, 7, 64)), jnp.float32) for _ in range(2))
  cos, sin = _tables(rng.integers(0, 9_000, (2, 7)).astype(np.int32), 64)
  _, vjp = jax.vjp(R.apply_rope, x, cos, R.fold_sign(sin))
  _, dcos, dss = vjp(ct)
  _, ref_vjp = jax.vjp(rotate_half_reference, x, cos, sin)
  _, ref_dcos, ref_dsin = ref_vjp(ct)
  np.testing.assert_allclose(dcos, ref_dcos, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dss, R.fold_sign(ref_dsin), rtol=1e-5, atol=1e-6)
  assert not np.allclose(dss, ref_dsin, rtol=1e-5, atol=1e-6)  # the fold matters


def test_fold_sign_negates_the_first_half_only():
  sin = jnp.asarray(np.arange(1, 9, dtype=np.float32)[None, None])  # [1, 1, 8]
  np.testing.assert_array_equal(np.asarray(R.fold_sign(sin))[0, 0], [-1, -2, -3, -4, 5, 6, 7, 8])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_rope_interleave_reads_the_second_half_of_the_folded_sin(dtype):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 3, 5, 64)), dtype)
  cos, sin = _tables(rng.integers(0, 50_000, (2, 5)).astype(np.int32), 64)
  got = R.apply_rope_interleave(x, cos, R.fold_sign(sin))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(interleave_reference(x, cos, sin), np.float32))
  # Reading the folded sin's first half (the old code on the new tables) turns every pair the other way.
  assert not np.array_equal(np.asarray(got, np.float32),
                            np.asarray(interleave_reference(x, cos, R.fold_sign(sin)), np.float32))


# --- every path that rotates, as the model runs it ---------------------------------------------------

# (preset and overrides, the mixer modules whose RoPE it calls): gqa (llama2-tiny; gemma3-tiny's local and global
# thetas), gated_gqa's partial rotary (qwen3.5-tiny: 1/4 of each head), mla's rotate-half and interleaved pairs.
# Only layers that rotate: qwen3.5-tiny as one full-attention layer (its Gated DeltaNet layers have no RoPE),
# deepseek-v3-tiny as its one dense layer (MLA, then a dense MLP: its MoE layers run the same MLA and compiled for
# most of the row's time: mla-rotate-half 20.8 s of CPU, -n 0).
MLA = ("deepseek-v3-tiny", "model.num_layers=1", "model.first_k_dense_replace=1")
PATHS = {
    "gqa": ("llama2-tiny",),
    "gqa-local-global": ("gemma3-tiny", *shrink("gemma3-tiny")),
    "gated_gqa-partial": ("qwen3.5-tiny", "model.num_layers=1", "model.full_attention_interval=1"),
    "mla-rotate-half": (*MLA, "model.parts.mla.rope_interleave=false"),
    "mla-interleave": (*MLA, "model.parts.mla.rope_interleave=true"),
}


def _patched(monkeypatch, rotate_half, interleave, calls: list):
  """Every mixer's RoPE replaced: the tables the context built (sign folded) are unfolded and handed to the given
  formulas; each trace is counted, so a path that never reaches them fails instead of passing. gqa and mla's
  rotate-half pairs rotate through Context.rope (models/context), gated_gqa's partial rotary through its own."""
  def rh(x, cos, sin_signed, by_matmul=None):
    calls.append("rotate_half")
    return rotate_half(x, cos, unfold_sign(sin_signed))

  def il(x, cos, sin_signed):
    calls.append("interleave")
    return interleave(x, cos, unfold_sign(sin_signed))
  for mod in (context, gated_gqa):
    monkeypatch.setattr(mod, "apply_rope", rh)
  monkeypatch.setattr(mla, "apply_rope_interleave", il)


def _run_paths(cfg, params):
  """(loss, grads) of one training batch (packed rows), and the logits of a prefill and of one decode step."""
  rng = np.random.default_rng(0)
  B, T, V = 2, 24, cfg.model.vocab_size
  toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
  cut = 9
  col = np.arange(T)[None].repeat(B, 0)
  batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.where(col < cut, 1, 2).astype(np.int32),
           "positions": np.where(col < cut, col, col - cut).astype(np.int32), "loss_mask": np.ones((B, T), np.float32)}
  loss, grads, _ = jax.jit(lambda p, b: grads_and_loss(cfg, p, b))(params, batch)
  lengths = np.array([T, T - 5], np.int32)

  def sample(p, tokens, lengths):
    logits, cache, _ = decoder.prefill(cfg, p, tokens, lengths, 2 * T)
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    step, _, _ = decoder.decode(cfg, p, nxt, lengths, cache)
    return logits, step
  prefill, step = jax.jit(sample)(params, toks[:, :-1], lengths)
  return jax.tree.map(np.asarray, (loss, grads, prefill, step))


def test_swap_halves_by_matmul_is_a_dot_and_by_roll_is_none():
  """The two ways really differ in the program (so the checks above compare both): the product is a dot."""
  x = jnp.zeros((1, 2, 3, 8), jnp.bfloat16)
  ops = [str(jax.make_jaxpr(lambda x: R.swap_halves(x, m))(x)) for m in (False, True)]
  assert "dot_general" not in ops[0] and "dot_general" in ops[1]


@pytest.mark.parametrize("path", list(PATHS))
def test_every_rope_path_trains_and_decodes_as_rotate_half_bit_for_bit(monkeypatch, path):
  """Both ways of swapping the halves (rope_swap=roll, CPU's; matmul, the permutation product TPU's take) against one
  reference run."""
  keys = (f"model={PATHS[path][0]}", *PATHS[path][1:], "cpu_devices=1")
  cfg = meshlm.load_config(*keys)
  params = meshlm.init_params(cfg, jax.random.key(0))
  got = {way: _run_paths(meshlm.load_config(*keys, f"rope_swap={way}"), params) for way in ("roll", "matmul")}
  calls: list = []
  _patched(monkeypatch, rotate_half_reference, interleave_reference, calls)
  want = _run_paths(cfg, params)
  expected = "interleave" if path == "mla-interleave" else "rotate_half"
  assert calls.count(expected) > 0 and set(calls) == {expected}, calls
  assert np.all(np.isfinite(want[0]))
  for way, run in got.items():
    for g, w in zip(jax.tree.leaves(run), jax.tree.leaves(want)):
      np.testing.assert_array_equal(g, w, err_msg=way)


def test_the_path_check_sees_a_roll_without_the_sign_fold(monkeypatch):
  cfg = meshlm.load_config("model=llama2-tiny", "cpu_devices=1")
  params = meshlm.init_params(cfg, jax.random.key(0))
  got = _run_paths(cfg, params)
  calls: list = []
  _patched(monkeypatch, roll_without_sign_fold, interleave_reference, calls)
  broken = _run_paths(cfg, params)
  assert calls
  assert not np.array_equal(got[0], broken[0])  # the loss
  assert not np.array_equal(got[2], broken[2]) and not np.array_equal(got[3], broken[3])  # prefill, decode logits


O2_CHECK = """
import sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {tests!r})
from test_rope import rotate_half_reference, _tables, _rotate_and_grad
from meshlm.nn import rope as R
rng = np.random.default_rng(0)
x, ct = (jnp.asarray(rng.standard_normal((2, 4, 64, 64)), jnp.float32) for _ in range(2))
cos, sin = _tables(rng.integers(0, 200_000, (2, 64)).astype(np.int32), 64)
R.platform = lambda: "cpu"
got = jax.jit(lambda *a: _rotate_and_grad(R.apply_rope, *a))(x, cos, R.fold_sign(sin), ct)
want = jax.jit(lambda *a: _rotate_and_grad(rotate_half_reference, *a))(x, cos, sin, ct)
print([bool(np.array_equal(g, w)) for g, w in zip(got, want)])
"""


def test_the_cpu_rotation_is_bit_identical_at_xla_cpus_default_optimization_level():
  """The suite runs XLA:CPU at backend optimization level 0 (conftest.py), where LLVM forms no FMAs; users run the
  default level, where it contracts multiply-adds, so two formulas equal in IEEE arithmetic can round differently
  (the rotation by the opposite angle as the gradient did: 1 ulp). Checked in a process at the default level."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  tests = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run([sys.executable, "-c", O2_CHECK.format(tests=tests)], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[True, True]", out.stdout
