"""deepseek_v3: the mla mixer against a float64 reference of transformers' formulas (q_lora set and unset,
rope_interleave on and off, forward and gradients, YaRN's softmax mscale seen only past position 0), the latent
cache and absorbed decode (cached greedy = uncached, absorbed = plain, the cache's size from the state spec and
the compiled memory), 20 explicit train steps of an MoE layer on expert=2 x fsdp=2 (explicit = auto is
tests/test_conformance.py's on fsdp=4 and tests/test_moe_ep.py's under expert parallelism), the census with every
MLA projection counted, and bad input."""
from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.config import load_config
from meshlm.models import decoder
from meshlm.models.params import init_model_state, merge_state
from meshlm.models.model import resolve
from meshlm.models import generate as G
from meshlm.models.mixers import mla
from meshlm.nn.rope import yarn_inv_frequencies
from meshlm.train.step import build_train_step

PRESET = "deepseek-v3-tiny"
POS0 = 200  # far past the original 64 positions: YaRN's interpolated band and the softmax scale both bite


# --- the reference: transformers' DeepseekV3Attention, written out -------------------------------------------

def reference(p: dict, x, positions, m, xp, *, mscale: bool = True, interleave: bool | None = None):
  """y [B, T, D] of causal MLA from the formulas, in xp (numpy float64, or jax.numpy for gradients).

  cos/sin: YaRN's inverse frequencies (tested against transformers in test_rope_yarn.py) at the positions,
  times the attention factor; the softmax scale qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2.
  mscale=False drops the softmax correction, interleave overrides the knob rope_interleave (negative controls)."""
  own = mla.knobs(m)
  Hn, Hr, R = own.qk_nope_head_dim, own.qk_rope_head_dim, own.kv_lora_rank
  sc = m.rope_scaling
  get = lambda f, ms=1.0: 0.1 * ms * math.log(f) + 1.0 if f > 1 else 1.0

  def rms(w, a):
    return a / xp.sqrt(xp.mean(a * a, axis=-1, keepdims=True) + 1e-6) * w

  if own.q_lora_rank is not None:
    q = xp.einsum("btr,rnh->btnh", rms(p["q_a_norm"], x @ p["q_a"]), p["q_b"])
  else:
    q = xp.einsum("btd,dnh->btnh", x, p["q"])
  ckr = x @ p["kv_a"]
  c, k_rope = rms(p["kv_a_norm"], ckr[..., :R]), ckr[..., R:]
  k_nope, v = xp.einsum("btr,rnh->btnh", c, p["k_b"]), xp.einsum("btr,rnh->btnh", c, p["v_b"])
  with jax.ensure_compile_time_eval():  # constants, also when the reference is traced for its gradients
    inv = np.asarray(yarn_inv_frequencies(Hr, m.rope_theta, sc), np.float64)
  ang = np.asarray(positions, np.float64)[..., None] * inv  # [B, T, Hr / 2]
  attn_factor = get(sc["factor"], sc["mscale"]) / get(sc["factor"], sc["mscale_all_dim"])
  cos, sin = np.cos(ang)[:, :, None] * attn_factor, np.sin(ang)[:, :, None] * attn_factor
  cos, sin = xp.asarray(cos, x.dtype), xp.asarray(sin, x.dtype)

  def rope(a):  # [B, T, n, Hr]
    if own.rope_interleave if interleave is None else interleave:
      a1, a2 = a[..., 0::2], a[..., 1::2]
      return xp.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], axis=-1)
    a1, a2 = a[..., :Hr // 2], a[..., Hr // 2:]
    return xp.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], axis=-1)
  qk = xp.concatenate([q[..., :Hn], rope(q[..., Hn:])], axis=-1)
  kr = rope(k_rope[:, :, None])
  k = xp.concatenate([k_nope, xp.broadcast_to(kr, k_nope.shape[:3] + (Hr,))], axis=-1)
  scale = (Hn + Hr) ** -0.5 * (get(sc["factor"], sc["mscale_all_dim"]) ** 2 if mscale else 1.0)
  s = xp.einsum("btnh,bsnh->bnts", qk, k) * scale
  T = x.shape[1]
  s = xp.where(np.tril(np.ones((T, T), bool)), s, -1e30)
  e = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
  a = e / xp.sum(e, axis=-1, keepdims=True)
  return xp.einsum("btnh,nhd->btd", xp.einsum("bnts,bsnh->btnh", a, v), p["o"])


def model_tree(cfg) -> dict:
  """The parameters with the model state (the MoE layers' router_bias) beside them, as forward reads them."""
  key = jax.random.key(0)
  return merge_state(meshlm.init_params(cfg, key), init_model_state(cfg, key))


def _case(q_lora: bool, interleave: bool):
  over = [f"model={PRESET}", f"model.parts.mla.rope_interleave={str(interleave).lower()}"]
  if not q_lora:
    over.append("model.parts.mla.q_lora_rank=null")
  cfg = load_config(*over)
  params = meshlm.init_params(cfg, jax.random.key(0))
  p = jax.tree.map(lambda a: a[0], params["layers"]["moe"]["attn"])
  # Norm scales away from ones, so that a norm applied to the wrong tensor shows.
  rng = np.random.default_rng(3)
  p = {k: (v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) if k.endswith("norm") else v) for k, v in p.items()}
  return cfg, p


def mla_forward(cfg, p, x, positions):
  return mla.apply(p, x, decoder.context(cfg, positions))[0]


CASES = [(True, True), (False, False)]  # (q_lora_rank set, rope_interleave)


@functools.cache
def _mla_result(q_lora: bool, interleave: bool):
  """(cfg, p, x, positions, y, gradients of sum(y * r) in p and x) from the mla mixer, once per case."""
  cfg, p = _case(q_lora, interleave)
  rng = np.random.default_rng(1)
  B, T = 2, 12
  x = rng.standard_normal((B, T, cfg.model.embed_dim)).astype(np.float32)
  positions = np.broadcast_to(POS0 + np.arange(T, dtype=np.int32), (B, T))
  r = rng.standard_normal((B, T, cfg.model.embed_dim)).astype(np.float32)

  @jax.jit
  def run(p, x):  # one compile: the mixer's output and its gradients, and the jnp reference's gradients
    y, vjp = jax.vjp(lambda p, x: mla_forward(cfg, p, x, positions), p, x)
    ref = lambda mscale: jax.grad(lambda p, x: jnp.sum(reference(p, x, positions, cfg.model, jnp, mscale=mscale) * r),
                                  argnums=(0, 1))(p, x)
    return y, vjp(r), ref(True), ref(False)
  y, grads, ref_grads, wrong_grads = run(p, x)
  return cfg, p, x, positions, r, np.asarray(y), grads, ref_grads, wrong_grads


def _max_rel(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("q_lora, interleave", CASES)
def test_mla_matches_the_float64_reference_forward_and_gradients(q_lora, interleave):
  cfg, p, x, positions, r, y, (gp, gx), (wp, wx), (bad_p, _) = _mla_result(q_lora, interleave)
  m = cfg.model
  p64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
  want = reference(p64, x.astype(np.float64), positions, m, np)
  assert _max_rel(y, want) < 2e-6
  # Negative controls, at the same far positions: no softmax mscale; the other pair layout for RoPE.
  assert _max_rel(y, reference(p64, x.astype(np.float64), positions, m, np, mscale=False)) > 1e-3
  assert _max_rel(y, reference(p64, x.astype(np.float64), positions, m, np, interleave=not interleave)) > 1e-3
  # Gradients: the same formulas in jax.numpy (float32), differentiated. Measured at most 4.3e-7 relative (the
  # parameters) and 2.4e-7 (x); the control (no mscale) moves k_b's gradient by more than 1e-3.
  assert set(gp) == set(wp)
  for k in wp:
    assert _max_rel(gp[k], np.asarray(wp[k], np.float64)) < 5e-6, k
  assert _max_rel(gx, np.asarray(wx, np.float64)) < 5e-6
  assert _max_rel(gp["k_b"], np.asarray(bad_p["k_b"], np.float64)) > 1e-3


def test_softmax_mscale_is_only_seen_past_position_0():
  """At position 0 alone a token attends to itself only: softmax gives weight 1 whatever the scale, so the
  wrong-mscale reference passes there. At positions far past 0 (test above) it fails."""
  cfg, p, x = _mla_result(True, True)[:3]
  x0, pos0 = x[:1, :1], np.zeros((1, 1), np.int32)
  y0 = np.asarray(jax.jit(lambda p, x: mla_forward(cfg, p, x, pos0))(p, x0))
  p64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
  wrong = reference(p64, x0.astype(np.float64), pos0, cfg.model, np, mscale=False)
  assert _max_rel(y0, wrong) < 2e-6
  assert mla.softmax_scale(cfg.model) == pytest.approx(24 ** -0.5 * (0.1 * 0.8 * math.log(4.0) + 1) ** 2)


# --- the latent cache and absorbed decode ---------------------------------------------------------------------

NEW = 24
LENGTHS = (5, 17, 33)
MESH = ("cpu_devices=4", "mesh.fsdp=2", "mesh.tensor=2", "train.compute_dtype=float32")


@functools.cache
def _generated(absorb: bool):
  cfg = load_config(f"model={PRESET}", *MESH, f"model.parts.mla.absorb={str(absorb).lower()}")
  params = model_tree(cfg)
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(0, cfg.model.vocab_size, n)] for n in LENGTHS]
  return cfg, params, prompts, G.generate(cfg, params, prompts, max_new_tokens=NEW)


def test_cached_absorbed_greedy_equals_uncached_in_tokens_and_logprobs():
  cfg, params, prompts, out = _generated(True)
  seqs = [pr + new for pr, new in zip(prompts, out.token_lists())]
  block = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for i, s in enumerate(seqs):
    block[i, :len(s)] = s
  logits = np.asarray(jax.jit(lambda p, t: meshlm.forward(cfg, p, t))(params, block), np.float32)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  for i, (pr, new, lp) in enumerate(zip(prompts, out.token_lists(), out.logprob_lists())):
    rows = [len(pr) - 1 + j for j in range(len(new))]
    assert new == [int(np.argmax(logits[i, r])) for r in rows]  # uncached greedy: the forward's argmax
    np.testing.assert_allclose(lp, [logp[i, r, t] for r, t in zip(rows, new)], atol=1e-5, rtol=0)


def test_absorbed_and_plain_decode_agree():
  _, _, _, absorbed = _generated(True)
  _, _, _, plain = _generated(False)
  assert absorbed.token_lists() == plain.token_lists()
  np.testing.assert_allclose(np.asarray(absorbed.logprobs), np.asarray(plain.logprobs), atol=1e-5, rtol=0)


def test_the_cache_holds_the_latent_per_token_per_layer():
  cfg = load_config(f"model={PRESET}", "train.compute_dtype=float32")
  m, own = cfg.model, mla.knobs(cfg.model)
  per_token = own.kv_lora_rank + own.qk_rope_head_dim
  B, C = 2, 64
  for i in range(m.num_layers):
    spec = resolve(cfg).state_spec(i, B, C)
    assert set(spec) == {"attn"}  # the MoE and GLU halves keep none
    assert sum(math.prod(leaf.shape) for leaf in spec["attn"].values()) == B * C * per_token
  # The compiled prefill's output: the whole cache, and nothing per head.
  params = jax.eval_shape(lambda: model_tree(cfg))
  tokens, lengths = jax.ShapeDtypeStruct((B, 16), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
  build = jax.jit(lambda p, t, n: decoder.prefill(cfg, p, t, n, C)[1]).lower(params, tokens, lengths).compile()
  out_bytes = build.memory_analysis().output_size_in_bytes
  want = m.num_layers * B * C * per_token * 4
  n_buffers = len(jax.tree.leaves(jax.eval_shape(lambda p, t, n: decoder.prefill(cfg, p, t, n, C)[1],
                                                 params, tokens, lengths)))
  assert want <= out_bytes <= want + 8 * n_buffers  # and the output tuple's table of buffer pointers
  per_head_kv = m.num_heads * (own.qk_nope_head_dim + own.qk_rope_head_dim + own.v_head_dim)
  assert per_head_kv > 2 * per_token  # what a K/V cache would hold instead


# --- training under expert parallelism, the census -------------------------------------------------------------

STEPS = 20
SEQ = 96
TRAIN = ("train.per_device_batch_size=1", f"train.seq_len={SEQ}", "train.compute_dtype=float32",
         "train.warmup_steps=0", "train.learning_rate=3e-3")
# Explicit only: it is the mode that refuses a part whose shardings do not compose with the expert axis. Explicit =
# auto is held by its parts: for this family's parts on fsdp=4 by tests/test_conformance.py's
# test_explicit_equals_auto_and_nothing_is_blocked[deepseek-v3-tiny] (the same step on the same keys, two packed
# documents per row whose positions run past YaRN's original 64, 3 steps), and for a whole MoE model under expert
# parallelism by tests/test_moe_ep.py's test_model_explicit_equals_auto_under_ep (the moe part's EP dispatch, the
# same for every family) and test_ep_equals_unsharded (the layer on expert=2 x fsdp=2, both modes).
# One layer, an MoE one: its MLA, routed experts and GLU shared expert are every part of the dense first layer too.
EP = ("cpu_devices=4", "mesh.fsdp=2", "mesh.expert=2", "shard_mode=explicit", "model.num_layers=1",
      "model.first_k_dense_replace=0")


def _losses() -> np.ndarray:
  """STEPS float32 train steps (compiled once) on random tokens, two packed documents per row whose positions
  restart (the second document's run past YaRN's original 64), a ragged loss mask."""
  cfg = load_config(f"model={PRESET}", *EP, *TRAIN)
  step = build_train_step(cfg)
  state = step.init_state(jax.random.key(0))
  rng = np.random.default_rng(0)
  rows, col = step.global_batch, np.arange(SEQ)[None, :]
  out = []
  for _ in range(STEPS):
    toks = rng.integers(0, cfg.model.vocab_size, (rows, SEQ + 1)).astype(np.int32)
    cut = rng.integers(SEQ // 8, SEQ // 4, rows)[:, None]
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.where(col < cut, 1, 2).astype(np.int32),
             "positions": np.where(col < cut, col, col - cut).astype(np.int32),
             "loss_mask": (rng.random((rows, SEQ)) < 0.9).astype(np.float32)}
    state, metrics = step(state, step.put_batch(batch))
    out.append(float(metrics["loss"]))
  return np.asarray(out)


def test_an_moe_layer_trains_over_20_steps_on_expert2_fsdp2():
  losses = _losses()
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]  # it trains
  assert len(set(losses.tolist())) == STEPS  # every step's batch and update reach the loss


MLA_PROJECTIONS = ("q_a", "q_b", "kv_a", "k_b", "v_b", "o")


def test_census_counts_every_mla_projection_and_blocks_no_transpose_under_explicit():
  """From the golden census of the step (tests/test_analysis.py holds the file to the lowering, so no second
  lowering here): under explicit no blocked transpose, and a weight-gradient dot for every MLA projection."""
  with open(os.path.join(os.path.dirname(__file__), "golden", "census", f"{PRESET}.json")) as f:
    counts = json.load(f)["counts"]
  on = counts["explicit"]
  assert on["stablehlo.transpose_of_dot.blocked"] == 0
  for name in MLA_PROJECTIONS:
    # Both layer kinds: the dense prefix layer (unrolled) and the scanned MoE layers (the scan's trip count, 2).
    assert {k: v for k, v in on["stablehlo.weight_grad_dots"].items() if k.endswith(f"attn/{name}")} == {
        f"layer_0/attn/{name}": 1, f"layers/attn/{name}": 2}, name
  # Control: without the kernel-order flags the step has 18 blocked weight-gradient transposes (per call site), 10
  # of them MLA's: q_a, q_b, kv_a, k_b and v_b in the dense layer and in the scanned MoE body (o runs in the
  # attention core's auto-axes region); the GLU's 3, the shared experts' 3, the router's and the head's are the
  # other 8.
  assert counts["explicit-noflags"]["stablehlo.transpose_of_dot.weight_grad.blocked"] == 18


# --- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["model.num_heads", "model.parts.mla.kv_lora_rank", "model.parts.mla.qk_nope_head_dim",
                                 "model.parts.mla.qk_rope_head_dim", "model.parts.mla.v_head_dim",
                                 "model.kv_lora_rank"])  # the last: the old key, which sets the new one
def test_a_missing_mla_field_fails_in_one_line_naming_it(key, capsys):
  """The query heads are a model field the part needs (Part.needs); the ranks and head dims the mla section's
  required knobs."""
  from meshlm.cli import main
  named = "model.parts.mla.kv_lora_rank" if key == "model.kv_lora_rank" else key
  assert main(["train", f"model={PRESET}", f"{key}=null", "train.steps=1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"meshlm: error: {named}: required by model.family=deepseek_v3") and err.count("\n") == 1
