"""The Gated DeltaNet hybrids (qwen3_next, qwen3_5, qwen3_5_moe): the short conv against its definition, the
two projection layouts against each other, the mixer's chunked rule against the reference, the negative control
of the packed-document check (a dropped GDN reset; the check itself, and cached sampling, are
tests/test_conformance.py's), AdamW's decay mask, a short training run whose loss falls, and the config errors.
The whole model's gradients (finite, shaped as the parameters, reaching every GDN parameter) are read from
tests/test_gdn_context.py's unsharded runs; explicit == auto, tests/test_conformance.py's.

Every program compiles once per module (functools.cache); float32 throughout.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm import spec as S
from meshlm.config import load_config
from meshlm.models import decoder
from meshlm.models.params import param_specs
from meshlm.models.mixers import gdn as gdn_mixer
from meshlm.models.mixers.gated_gqa import partial_rope
from meshlm.nn.rope import apply_rope, fold_sign, rope_angles, inv_frequencies
from meshlm.nn.short_conv import causal_conv, causal_conv_reference, window_at

T = 48
LEN1, LEN2 = 21, 19  # two documents packed into one row of T, then 8 padding positions
# Float32 reassociation; a document reading another moves logits by 1e-2 or more. Packed against alone measures
# 0.0 max |diff| on all three tiny presets, chunked and reference (gdncore's ec33de4; before its layout rework the
# chunked rule gave up to 1.1e-5 on logits below 5 in magnitude).
ATOL = 1e-5
LEAK = 1e-3  # what a dropped reset must move the second document's logits by, at least


# The presets' 3 linear + 1 full layers shrunk to one period of 1 + 1 for the whole-model tests: the same kinds and
# code, half the scan body to compile (the suite's budget).
SHRINK = ("model.num_layers=2", "model.full_attention_interval=2")
# One linear-attention layer: the training run's own part is qwen3.5's separate GDN projections beside the MoE
# feed-forward (qwen3.5-moe-tiny's combination); its full-attention layer (gated attention + MoE) is qwen3-next-tiny's
# kind, and the 2-layer period trains under both shard modes in tests/test_conformance.py (3 moving losses).
ONE_GDN_LAYER = ("model.num_layers=1", "model.hybrid_layer_types=[linear_attention]",
                 "model.full_attention_interval=null")


@functools.cache
def setup(preset: str):
  cfg = load_config(f"model={preset}", *SHRINK, "train.compute_dtype=float32", "cpu_devices=1")
  return cfg, meshlm.init_params(cfg, jax.random.key(0))


def packed_batch(vocab: int):
  """Rows: [doc1 | doc2 | padding] with segment ids 1, 2, 0 and restarted positions; doc1 alone; doc2 alone
  (each alone row padded at its end, which a causal model never reads)."""
  rng = np.random.default_rng(0)
  d1, d2 = rng.integers(0, vocab, LEN1), rng.integers(0, vocab, LEN2)
  toks = np.zeros((3, T), np.int32)
  seg = np.zeros((3, T), np.int32)
  pos = np.zeros((3, T), np.int32)
  toks[0, :LEN1], toks[0, LEN1:LEN1 + LEN2] = d1, d2
  seg[0, :LEN1], seg[0, LEN1:LEN1 + LEN2] = 1, 2
  pos[0, :LEN1], pos[0, LEN1:LEN1 + LEN2] = np.arange(LEN1), np.arange(LEN2)
  for row, d in ((1, d1), (2, d2)):
    toks[row, :len(d)], seg[row, :len(d)], pos[row, :len(d)] = d, 1, np.arange(len(d))
  return toks, pos, seg


def split_docs(logits):
  """(packed doc1, packed doc2, alone doc1, alone doc2) logits."""
  return logits[0, :LEN1], logits[0, LEN1:LEN1 + LEN2], logits[1, :LEN1], logits[2, :LEN2]


# --- nn/short_conv.py against its definition ---------------------------------------------------------

def test_short_conv_matches_its_definition_with_segments_history_and_left_padding():
  rng = np.random.default_rng(0)
  B, n, C, Q = 3, 13, 5, 4
  x = rng.standard_normal((B, n, C)).astype(np.float32)
  w = rng.standard_normal((Q, C)).astype(np.float32)
  # Row 0: one document; row 1: three documents (one of length 1); row 2: left-padded (id 0) then a document.
  seg = np.array([[1] * n, [1] * 4 + [2] + [3] * 8, [0] * 5 + [1] * 8], np.int32)
  conv = jax.jit(causal_conv)  # one program per call below (op by op, some 25 small ones)
  got = np.asarray(conv(jnp.asarray(x), jnp.asarray(w), segment_ids_BT=jnp.asarray(seg)))
  np.testing.assert_allclose(got, causal_conv_reference(x, w, segment_ids_BT=seg), atol=1e-5)
  # The left-padded row's first real token reads no padding: its output is its own tap alone.
  np.testing.assert_allclose(got[2, 5], x[2, 5] * w[Q - 1], atol=1e-6)
  hist = rng.standard_normal((B, Q - 1, C)).astype(np.float32)
  got = np.asarray(conv(jnp.asarray(x), jnp.asarray(w), history=jnp.asarray(hist)))
  np.testing.assert_allclose(got, causal_conv_reference(x, w, history=hist), atol=1e-5)
  # Control: without the segment ids the packed rows read across their boundaries.
  leaky = np.asarray(conv(jnp.asarray(x), jnp.asarray(w)))
  assert np.abs(leaky[1:] - causal_conv_reference(x, w, segment_ids_BT=seg)[1:]).max() > 1e-2


def test_conv_window_is_the_last_inputs_of_each_row():
  x = np.arange(2 * 6 * 1, dtype=np.float32).reshape(2, 6, 1) + 1
  win = np.asarray(jax.jit(window_at, static_argnums=2)(x, np.array([2, 6]), 3))[..., 0]
  np.testing.assert_array_equal(win, [[0, 1, 2], [10, 11, 12]])  # zeros before the row's first token


def test_partial_rope_rotates_the_first_dims_with_half_split_pairs():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 2, 5, 16)), jnp.float32)  # [B, N, T, H]

  @jax.jit  # one program (op by op, some 20 small ones)
  def rotated(x):
    cos, sin = rope_angles(jnp.arange(5)[None], inv_frequencies(4, 10000.0))  # rot = 4 of 16
    return partial_rope(x, cos, fold_sign(sin)), apply_rope(x[..., :4], cos, fold_sign(sin)), cos, sin
  y, y4, cos, sin = (np.asarray(a) for a in rotated(x))
  np.testing.assert_array_equal(y[..., 4:], np.asarray(x)[..., 4:])
  np.testing.assert_allclose(y[..., :4], y4, atol=1e-6)
  # Dim 0 pairs with dim rot / 2 = 2 (transformers' rotate_half inside the rotated block), not with dim 1.
  c, s = cos[0, :, 0], sin[0, :, 0]
  xn = np.asarray(x)
  np.testing.assert_allclose(y[0, :, :, 0], xn[0, :, :, 0] * c[None] - xn[0, :, :, 2] * s[None], atol=1e-6)


# --- the two GDN projection layouts ----------------------------------------------------------------

def test_fused_layout_equals_separate_layout_reshaped_as_documented():
  """qwen3-next's per-key-head in_proj_qkvz / in_proj_ba, reordered into qwen3.5's in_proj_qkv / _z / _b / _a as
  the gdn module docstring says, give the same mixer output: the layouts the HF maps rely on."""
  cfg = load_config("model=qwen3.5-tiny", "train.compute_dtype=float32", "cpu_devices=1",
                    "model.parts.gdn.impl=reference")
  m = cfg.model
  K, N, G, H, J, _ = gdn_mixer.dims(m)
  D = m.embed_dim
  # The parameters rearranged in numpy and each layout's mixer jitted: op by op, this test compiled ~100 programs.
  init = jax.jit(lambda key: S.init_tree(gdn_mixer.spec(m, fused=True), key, jnp.float32))
  fused = jax.tree.map(np.asarray, init(jax.random.key(1)))
  fused = dict(fused, A_log=np.linspace(-1, 1, N, dtype=np.float32), dt_bias=np.linspace(0.5, 1.5, N, dtype=np.float32))
  qkvz, ba = fused["in_proj_qkvz"], fused["in_proj_ba"]  # [D, K, 2H + 2GJ], [D, K, 2G]
  sep = {k: fused[k] for k in ("conv1d", "A_log", "dt_bias", "norm", "out_proj")}
  sep["in_proj_qkv"] = np.concatenate([qkvz[:, :, :H].reshape(D, K * H), qkvz[:, :, H:2 * H].reshape(D, K * H),
                                       qkvz[:, :, 2 * H:2 * H + G * J].reshape(D, N * J)], axis=1)
  sep["in_proj_z"] = qkvz[:, :, 2 * H + G * J:].reshape(D, N, J)
  sep["in_proj_b"], sep["in_proj_a"] = ba[:, :, :G].reshape(D, N), ba[:, :, G:].reshape(D, N)
  x = jax.random.normal(jax.random.key(2), (2, 9, D))
  pos = np.broadcast_to(np.arange(9), (2, 9))
  mixer = {f: jax.jit(lambda p, f=f: gdn_mixer.apply(p, x, decoder.context(cfg, pos), fused=f)[0])
           for f in (True, False)}
  y_fused, y_sep = mixer[True](fused), mixer[False](sep)
  np.testing.assert_allclose(np.asarray(y_fused), np.asarray(y_sep), atol=1e-5)
  # Control: swapping q and k inside each key head's block changes the output.
  swapped = dict(fused, in_proj_qkvz=np.concatenate([qkvz[:, :, H:2 * H], qkvz[:, :, :H], qkvz[:, :, 2 * H:]], -1))
  y_bad = mixer[True](swapped)
  assert np.abs(np.asarray(y_bad) - np.asarray(y_sep)).max() > 1e-3


# --- the gdn mixer: the chunked rule against the reference recurrence --------------------------------

@functools.cache
def mixer_draws(n: int):
  """qwen3-next-tiny's gdn mixer parameters and an input [2, n, D], drawn in one jitted program (op by op, the
  draws compiled some 20 small ones); impl changes neither."""
  m = load_config("model=qwen3-next-tiny", "cpu_devices=1").model
  return jax.jit(lambda: (S.init_tree(gdn_mixer.spec(m, fused=True), jax.random.key(3), jnp.float32),
                          jax.random.normal(jax.random.key(4), (2, n, m.embed_dim))))()


def mixer_setup(impl: str):
  """The qwen3-next gdn mixer with model.parts.gdn.impl=impl on 150 positions (chunks of 64: document boundaries
  inside a chunk and on a chunk edge, a ragged last chunk) holding up to three documents and padding."""
  cfg = load_config("model=qwen3-next-tiny", "train.compute_dtype=float32", "cpu_devices=1",
                    f"model.parts.gdn.impl={impl}")
  m = cfg.model
  n = 150
  params, x = mixer_draws(n)
  params = dict(params, A_log=jnp.asarray(np.linspace(-1.0, 1.0, gdn_mixer.knobs(m).value_heads, dtype=np.float32)))
  seg = np.ones((2, n), np.int32)
  seg[0, 40:], seg[0, 64:], seg[0, 140:] = 2, 3, 0
  seg[1, 100:] = 2
  return cfg, params, x, np.broadcast_to(np.arange(n, dtype=np.int32), (2, n)), seg


@functools.cache
def mixer_grads(impl: str):
  """(y, gradients wrt the mixer's parameters and x) in training."""
  cfg, params, x, pos, seg = mixer_setup(impl)

  def loss(p, x):
    y, _, _ = gdn_mixer.apply(p, x, decoder.context(cfg, pos, seg), fused=True)
    return jnp.sum(jnp.sin(y)), y
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return np.asarray(y), jax.tree.map(np.asarray, grads)


def test_gdn_mixer_chunked_equals_reference_outputs_and_gradients():
  y_c, g_c = mixer_grads("chunked")
  y_r, g_r = mixer_grads("reference")
  # Measured (JAX 0.12.0.1, XLA:CPU): outputs 7.4e-6 apart, gradients 6.7e-6 of max(1, |grad|); the dropped
  # segment reset below moves the outputs by more than LEAK.
  np.testing.assert_allclose(y_c, y_r, atol=1e-5, rtol=0)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_c), jax.tree.leaves(g_r)):
    np.testing.assert_allclose(a, b, atol=3e-5 * max(1.0, np.abs(b).max()), rtol=0, err_msg=jax.tree_util.keystr(path))
  # Control: the chunked mixer without the segment ids (the documents then read each other) differs.
  cfg, params, x, pos, _ = mixer_setup("chunked")
  y_leak = np.asarray(jax.jit(lambda p, x: gdn_mixer.apply(p, x, decoder.context(cfg, pos), fused=True)[0])(params, x))
  assert np.abs(y_leak - y_r).max() > LEAK


# The fused mixer under fsdp, explicit against auto (it regroups batch-sharded rows, which explicit sharding refuses
# outside the mixer's auto-axes region), is tests/test_conformance.py's qwen3-next-tiny row: its train steps on
# fsdp=4 run this mixer's forward and backward under both modes (losses within 1e-5 over 3 moving steps).


# --- the whole model: packed documents ---------------------------------------------------------------
# (Forward and gradients: test_gradients_are_finite_shaped_and_reach_every_gdn_parameter in
# tests/test_gdn_context.py, on its unsharded runs of qwen3.5-tiny and qwen3-next-tiny.)

def test_without_the_rule_reset_the_second_document_reads_the_first(monkeypatch):
  """Control of tests/test_conformance.py's packed-document check: the same forward with the delta rule's segment
  reset switched off (the conv keeps its own; the conv's reset has its control in the short-conv test, and the
  mixer test drops both)."""
  cfg, params = setup("qwen3.5-tiny")
  real = gdn_mixer.delta_rule
  monkeypatch.setattr(gdn_mixer, "delta_rule",
                      lambda m, mode, *k: lambda *a, segment_ids_BT=None, **kw: real(m, mode, *k)(*a, **kw))
  toks, pos, seg = packed_batch(cfg.model.vocab_size)
  logits = np.asarray(jax.jit(lambda p: decoder.forward(cfg, p, toks, pos, seg))(params))
  p1, p2, a1, a2 = split_docs(logits)
  np.testing.assert_allclose(p1, a1, atol=ATOL, rtol=0)  # the first document has nothing before it
  assert np.abs(p2 - a2).max() > LEAK


# --- AdamW: A_log and dt_bias are not decayed ----------------------------------------------------------

def test_a_log_and_dt_bias_are_kept_out_of_weight_decay():
  from meshlm.train.optimizer import make_optimizer
  cfg, _ = setup("qwen3.5-tiny")
  no_decay = S.no_decay_mask(param_specs(cfg))
  skipped = sorted(jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(no_decay) if v)
  assert skipped == ["['layers']['linear_attn']['linear_attn']['A_log']",
                     "['layers']['linear_attn']['linear_attn']['dt_bias']"]
  assert S.no_decay_mask(param_specs(load_config("model=llama2-tiny"))) is None  # others: no mask at all
  # The optimizer on a small tree of the same kind: a zero gradient leaves only the decay in the update.
  params = {"gdn": {"A_log": jnp.ones(3), "dt_bias": jnp.ones(3), "out_proj": jnp.ones(3)}, "embed": jnp.ones(3)}
  mask = {"gdn": {"A_log": True, "dt_bias": True, "out_proj": False}, "embed": False}
  t = cfg.train.model_copy(update={"warmup_steps": 0, "weight_decay": 0.5})
  zeros = jax.tree.map(jnp.zeros_like, params)

  def moved(opt):
    updates, _ = jax.jit(lambda p: opt.update(zeros, opt.init(p), p))(params)  # op by op: ~15 small programs
    return {k: bool(np.abs(np.asarray(v)).max() > 0) for k, v in jax.tree_util.tree_leaves_with_path(updates)
            for k in [jax.tree_util.keystr(k)]}
  assert moved(make_optimizer(t, no_decay=mask)) == {"['embed']": True, "['gdn']['A_log']": False,
                                                     "['gdn']['dt_bias']": False, "['gdn']['out_proj']": True}
  assert all(moved(make_optimizer(t)).values())  # control: without the mask every leaf decays
  # Under train.freeze the mask meets optax.masked's subtree (frozen leaves are MaskedNodes): the same rule.
  frozen = {"gdn": {"A_log": True, "dt_bias": True, "out_proj": True}, "embed": False}
  assert moved(make_optimizer(t, frozen, mask)) == {"['embed']": False, "['gdn']['A_log']": False,
                                                    "['gdn']['dt_bias']": False, "['gdn']['out_proj']": True}


# --- training through `meshlm train`: the loss falls ----------------------------------------------------
# (Explicit equals auto for the three hybrids is tests/test_conformance.py's, on fsdp=4.)

STEPS = 4
TRAIN = ("model=qwen3.5-moe-tiny", *ONE_GDN_LAYER, "cpu_devices=2", "mesh.fsdp=2", "train.compute_dtype=float32",
         "train.seq_len=64", "train.per_device_batch_size=2", f"train.steps={STEPS}", "train.warmup_steps=0", "train.sample_tokens=0",
         "data.source=stdlib", "shard_mode=explicit")


def test_training_qwen3_5_moe_tiny_lowers_the_loss(tmp_path):
  from meshlm.cli import main
  assert main(["train", *TRAIN, f"run_dir={tmp_path}"]) == 0
  with open(f"{tmp_path}/metrics.jsonl") as f:
    losses = [json.loads(line)["loss"] for line in f if "loss" in line]
  assert len(losses) == STEPS and np.isfinite(losses).all()
  assert losses[-1] < losses[0] - 0.3, losses


# --- config errors: one line naming the key -------------------------------------------------------------

ERRORS = {
    "value_heads": (("model.parts.gdn.value_heads=6",),
                    "model.parts.gdn.value_heads: 6 must be a multiple of key_heads=4"),
    "old_value_heads_key": (("model.linear_num_value_heads=6",),
                            "model.parts.gdn.value_heads: 6 must be a multiple of key_heads=4"),
    "chunk": (("model.parts.gdn.chunk_size=48",), "model.parts.gdn.chunk_size: 48 must be a power of two"),
    "old_chunk_key": (("model.gdn_chunk_size=48",), "model.parts.gdn.chunk_size: 48 must be a power of two"),
    "context": (("cpu_devices=2", "mesh.fsdp=1", "mesh.context=2", "train.seq_len=96"),
                "mesh.context=2: train.seq_len=96 does not split into 2 shards whose lengths are multiples of 64, "
                "as the gdn layers need"),
    "kind": (("model.hybrid_layer_types=[linear_attention,linear_attention,mamba,full_attention]",),
             "model.hybrid_layer_types[2]='mamba': unknown layer type"),
    "kinds_per_layer": (("model.hybrid_layer_types=[linear_attention,full_attention]",),
                        "model.hybrid_layer_types: 2 entries for model.num_layers=4; give one per layer"),
    "gdn_heads_missing": (("model.parts.gdn.key_heads=null",), "model.parts.gdn.key_heads: required by "
                          "model.family=qwen3_5_moe (its gdn layers)"),
    "heads_missing": (("model.num_kv_heads=null",), "model.num_kv_heads: required by model.family=qwen3_5_moe "
                      "(its gated_gqa layers)"),
    "pattern_missing": (("model.full_attention_interval=null",), "model.hybrid_layer_types: model.family=qwen3_5 "
                        "needs its layer pattern"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_fails_in_one_line_naming_the_key(name, capsys):
  from meshlm.cli import main
  args, msg = ERRORS[name]
  base = ("model=qwen3.5-moe-tiny",) if name != "pattern_missing" else ("model=qwen3.5-tiny",)
  if name in ("value_heads", "old_value_heads_key"):
    base += ("model.parts.gdn.key_heads=4",)
  assert main(["train", *base, *args, "train.steps=1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"meshlm: error: {msg}") and err.count("\n") == 1, err


# --- the per-head norms in the flat layout (models/mixers/gdn.py head_sums) ----------------------------------------

def _per_head(x, heads):  # numpy [B, T, heads * d] -> [B, T, heads, d]
  return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def _flat_norms(l2, gated, heads=3, d=8):
  """max |flat - per-head numpy reference| of the l2 norm, its gradient and the gated RMS norm (float32)."""
  ks = jax.random.split(jax.random.key(3), 4)
  x, z = (jax.random.normal(k, (2, 5, heads * d), jnp.float32) for k in ks[:2])
  w = jax.random.normal(ks[2], (d,), jnp.float32)
  xn, zn, wn = (np.asarray(a, np.float64) for a in (x, z, w))
  h = _per_head(xn, heads)
  want_l2 = (h / np.sqrt(np.sum(h * h, -1, keepdims=True) + 1e-6)).reshape(xn.shape)
  # d/dx sum(sin(l2(x))): per head (c - u (u . c)) / |x|, c = cos(l2(x)), u = l2(x)
  u, c = _per_head(want_l2, heads), np.cos(_per_head(want_l2, heads))
  norm = np.sqrt(np.sum(h * h, -1, keepdims=True) + 1e-6)
  want_grad = ((c - u * np.sum(u * c, -1, keepdims=True)) / norm).reshape(xn.shape)
  o = _per_head(xn, heads)
  want_gated = (o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-6) * wn).reshape(xn.shape) * zn / (1 + np.exp(-zn))
  got_grad = jax.grad(lambda a: jnp.sum(jnp.sin(l2(a, heads))))(x)
  return (float(np.max(np.abs(np.asarray(l2(x, heads)) - want_l2))), float(np.max(np.abs(got_grad - want_grad))),
          float(np.max(np.abs(np.asarray(gated(w, x, z, 1e-6)) - want_gated))))


def test_the_flat_per_head_norms_are_the_per_head_norms():
  """l2_normalize_heads and gated_rms_norm on [B, T, heads * d] (sums by the heads' indicator, the layout the TPU
  step keeps) against the per-head formulas in float64 numpy: values and the l2 norm's gradient."""
  got = _flat_norms(gdn_mixer.l2_normalize_heads, gdn_mixer.gated_rms_norm)
  assert max(got) < 2e-6, got


def test_a_wrong_head_grouping_fails_the_flat_norm_check(monkeypatch):
  """Control: heads read interleaved (channel c in head c % heads, not c // d) miss by far."""
  monkeypatch.setattr(gdn_mixer, "_heads", lambda C, heads: (
      jnp.arange(C)[:, None] % heads == jnp.arange(heads)[None, :]).astype(jnp.float32))
  got = _flat_norms(gdn_mixer.l2_normalize_heads, gdn_mixer.gated_rms_norm)
  assert min(got) > 1e-2, got
