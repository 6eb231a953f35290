"""Context parallelism in the GDN hybrids: the whole tiny model with its sequence sharded over mesh.context equals
the same model unsharded, in the loss and every gradient (float32), on context=2 and context=4 and with
context=2 x fsdp=2 under both shard modes. The batch packs documents that span shard edges, one that starts
exactly on an edge, and padding. A negative control drops the conv's halo and must fail the check; the compiled
program's GDN layers run their chunk scans on the local shard only, and their collectives are the small
per-shard states and maps (and the conv halo), never the sequence; full attention gathers K and V. The unsharded
runs' gradients are finite, shaped as the parameters and reach every GDN parameter.

Each program compiles once per module (functools.cache); every program is grads_and_loss (the train step's
loss and gradients), jitted on one mesh.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.analysis.census import hlo_counts
from meshlm.config import load_config
from meshlm.models.params import init_params, param_shardings
from meshlm.models.mixers import gdn as gdn_mixer
from meshlm.nn import short_conv
from meshlm.parallel.mesh import make_mesh
from meshlm.train.step import grads_and_loss
from seams import max_diffs, packed_batch, placed_batch

T = 128
CHUNK = 16
# qwen3.5-tiny (and qwen3-next-tiny) shrunk: tiny widths, two layers (one linear-attention, one full), two GDN
# chunks of 16 per shard at context=4.
SHRINK = ("model.num_layers=2", "model.full_attention_interval=2", "model.embed_dim=32", "model.mlp_dim=64",
          "model.vocab_size=64", f"model.parts.gdn.chunk_size={CHUNK}",
          "model.parts.gdn.key_head_dim=8", "model.parts.gdn.value_head_dim=8", "model.head_dim=8",
          f"train.seq_len={T}", "train.compute_dtype=float32", "train.per_device_batch_size=1")
# Float32 reassociation only (the shards' states are combined in another order than one scan over all chunks).
# Measured max |diff| of any gradient leaf on qwen3.5-tiny shrunk: 1.2e-7 (context=2), 3.1e-7 (context=4),
# 4.8e-7 (context=2 x fsdp=2); the loss is bit-equal on context alone. (With the presets' 3 + 1 layers: 2.6e-6,
# 3.3e-6, 3.2e-6.) Dropping the conv halo moves gradients by 3.7e-2.
ATOL = 1e-5
LEAK = 1e-3  # what the negative control must move some gradient by, at least


def batch(vocab: int) -> dict:
  """Two rows. Row 0: documents [0, 50) | [50, 64) | [64, 128): the first spans the edge at 32 (context=4), the
  third starts exactly on the edge at 64. Row 1: [0, 67) | [67, 120) | padding [120, 128): the first spans
  32 and 64, the second spans 96; padding has segment id 0 and no loss."""
  return packed_batch(vocab, T, ((0, 50, 64, 128), (0, 67, 120)))


# qwen3-next-tiny's fused layout on one linear-attention layer (its MoE feed-forward and gated shared expert with it),
# the MoE by model.parts.moe.impl=reference (every expert on every token, masked): its gated full attention is
# qwen3.5-tiny's, checked here on every mesh, and the dropless MoE dispatch under mesh.context is
# tests/test_mla_context.py's (deepseek-v3-tiny's routed and shared experts, context=2 and context=2 x fsdp=2). The
# two model compiles: 26 s of CPU with the shrunk preset's two layers, 13 s on one, 10 s with the reference MoE.
OWN = {"qwen3-next-tiny": ("model.num_layers=1", "model.hybrid_layer_types=[linear_attention]",
                           "model.full_attention_interval=null", "model.parts.moe.impl=reference")}


def config(preset: str, *over: str):
  return load_config(f"model={preset}", *SHRINK, *OWN.get(preset, ()), *over)


@functools.cache
def params(preset: str):
  cfg = config(preset, "cpu_devices=1")
  return jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), make_mesh(cfg)))


@functools.cache
def run(preset: str, *over: str, halo: bool = True):
  """(loss, grads as numpy, compiled HLO text) of grads_and_loss on the mesh `over` names."""
  cfg = config(preset, *over)
  mesh = make_mesh(cfg)
  p = jax.device_put(params(preset), param_shardings(cfg, mesh))
  b = batch(cfg.model.vocab_size)
  with jax.set_mesh(mesh):
    put = placed_batch(mesh, b)
    conv = short_conv.causal_conv_context_parallel
    try:
      if not halo:  # the negative control: each shard's conv starts from zeros, as if it began a row
        short_conv.causal_conv_context_parallel = functools.partial(conv, halo=False)
      compiled = jax.jit(lambda p, b: grads_and_loss(cfg, p, b)[:2]).lower(p, put).compile()
    finally:
      short_conv.causal_conv_context_parallel = conv
    loss, grads = compiled(p, put)
  return float(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


def errors(got, want) -> dict[str, float]:
  """Max |diff| of the loss and of each gradient leaf, by its path (of two runs' (loss, grads, hlo))."""
  return max_diffs(got[:2], want[:2])


UNSHARDED = ("cpu_devices=1",)
MESHES = {"context2": ("cpu_devices=2", "mesh.context=2", "shard_mode=explicit"),
          "context4": ("cpu_devices=4", "mesh.context=4", "shard_mode=explicit"),
          "context2_fsdp2_explicit": ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2", "shard_mode=explicit"),
          "context2_fsdp2_auto": ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2", "shard_mode=auto")}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_sequence_equals_unsharded(mesh):
  want = run("qwen3.5-tiny", *UNSHARDED)
  errs = errors(run("qwen3.5-tiny", *MESHES[mesh]), want)
  assert len(errs) > 20  # the loss and every parameter's gradient (GDN, attention, GLU, norms, embeddings)
  assert max(errs.values()) < ATOL, {k: v for k, v in errs.items() if v >= ATOL}


def test_explicit_and_auto_losses_agree():
  explicit, auto = run("qwen3.5-tiny", *MESHES["context2_fsdp2_explicit"]), run("qwen3.5-tiny", *MESHES["context2_fsdp2_auto"])
  assert abs(explicit[0] - auto[0]) < ATOL


# qwen3-next-tiny's gradients reach 2.0 (qwen3.5-tiny's stay far smaller) and its MoE sums run in another order
# with the sequence split: XLA's own partitioning of the unchanged model (model.parts.gdn.impl=reference, no
# context-parallel code) already differs from unsharded. Measured here (shrunk to 2 layers): 3.5e-6 of a leaf's max
# |gradient| at most (3.7e-5 with the preset's 4 layers; 2.1e-6 on the one layer of OWN); dropping the halo moves
# leaves by 0.28-0.40 of theirs.
FUSED_RTOL = 3e-5


@pytest.mark.slow  # two more model compiles; -m "not slow" skips it
def test_fused_layout_sharded_equals_unsharded():
  """qwen3-next-tiny (the fused projections, a MoE feed-forward and its gated shared expert, one layer) on
  context=2, each gradient leaf within FUSED_RTOL of its own scale."""
  (lg, got, _), (lw, want, _) = run("qwen3-next-tiny", *MESHES["context2"]), run("qwen3-next-tiny", *UNSHARDED)
  assert abs(lg - lw) < ATOL
  rel = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-3)), got, want)
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(rel)[0]}
  assert max(flat.values()) < FUSED_RTOL, {k: v for k, v in flat.items() if v >= FUSED_RTOL}


# The whole-model forward and gradients of tests/test_qwen3_next.py, read from the unsharded runs above (no compile
# of their own): qwen3.5-tiny (separate projections, linear + full attention, dense GLU) and qwen3-next-tiny (fused
# projections, MoE). The logits of every tiny preset, these two whole, are checked by tests/test_conformance.py's
# 1-device rows (tests/test_conformance_devices.py runs them: packed documents, generate against recomputing).
@pytest.mark.parametrize("preset, family", [("qwen3.5-tiny", "qwen3_5"), ("qwen3-next-tiny", "qwen3_next")])
def test_gradients_are_finite_shaped_and_reach_every_gdn_parameter(preset, family):
  from meshlm.models import registry
  loss, grads, _ = run(preset, *UNSHARDED)
  p = params(preset)
  assert np.isfinite(loss)
  assert jax.tree.structure(grads) == jax.tree.structure(p)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(p)):
    assert g.shape == w.shape and np.isfinite(g).all(), jax.tree_util.keystr(path)
  gdn = grads["layers"]["linear_attn"]["linear_attn"]
  for leaf in ("A_log", "dt_bias", "conv1d", "norm", "out_proj"):
    assert np.abs(gdn[leaf]).max() > 0, leaf  # every GDN parameter is wired into the loss
  assert registry.family(config(preset, *UNSHARDED)).name == family


def test_dropping_the_conv_halo_fails_the_check():
  errs = errors(run("qwen3.5-tiny", *MESHES["context2"], halo=False), run("qwen3.5-tiny", *UNSHARDED))
  assert max(errs.values()) > LEAK, errs


def _collectives(hlo: str, scope: str) -> dict[str, list[dict]]:
  counts, _ = hlo_counts(hlo)
  return {kind: [c for c in d["calls"] if scope in (c["scope"] or "")] for kind, d in counts["collectives"].items()}


@pytest.mark.parametrize("mesh, shards, rows", [("context2", 2, 2), ("context4", 4, 2), ("context2_fsdp2_explicit", 2, 1),
                                               ("context2_fsdp2_auto", 2, 1)])
def test_gdn_layers_do_not_gather_the_sequence(mesh, shards, rows):
  """In the compiled program, every collective inside a GDN layer is the pass-2 gather of the C per-shard
  (S_local [B, N, H, J], M [B, N, H, H]) (and its backward), the conv halo [B, Q - 1, channels] or a
  segment-id boundary exchange: nothing with T / C positions or more. Every chunk scan runs over the local
  chunks only, and with fsdp the gathered states are this device's rows only (rows of B = 2)."""
  cfg = load_config("model=qwen3.5-tiny", *SHRINK)
  m, own = cfg.model, gdn_mixer.knobs(cfg.model)
  B, N, H = 2, own.value_heads, own.key_head_dim
  _, _, hlo = run("qwen3.5-tiny", *MESHES[mesh])
  calls = _collectives(hlo, "linear_attn")
  state_bytes = shards * B * N * H * max(H, own.value_head_dim) * 4  # the gathered [C, B, N, H, J or H]
  halo_bytes = B * (own.conv_kernel_dim - 1) * gdn_mixer.channels(m) * 4
  flat = [(kind, c) for kind, cs in calls.items() for c in cs]
  assert flat  # the pass-2 gathers and the halo are there
  big = [(kind, c["shape"], c["scope"]) for kind, c in flat if c["bytes_per_call"] > max(state_bytes, halo_bytes)]
  assert not big, big
  assert not [c for c in calls["all-gather"] if f",{T}" in c["shape"] or f"{T}," in c["shape"]]
  gathers = [c for c in calls["all-gather"] if "gdn_context_parallel" in c["scope"]]
  gdn_layers = m.hybrid_types().count("linear_attention")
  assert sum(c["count"] for c in gathers) == 2 * gdn_layers  # (S_local, M) per GDN layer
  assert {c["shape"].split("{")[0] for c in gathers} == {f"f32[{shards},{rows},{N},{H},{H}]"}  # H = J here
  permutes = [c for c in calls["collective-permute"] if "conv_context_parallel" in c["scope"]]
  assert permutes and all(c["bytes_per_call"] <= halo_bytes for c in permutes)
  counts, _ = hlo_counts(hlo)
  scans = [w["trip_count"] for w in counts["while_loops"] if "linear_attn" in (w["scope"] or "")]
  local_chunks = T // shards // CHUNK
  # Per GDN layer: pass 1 and pass 3 forward, and their backward scans, each over this shard's chunks.
  assert scans and set(scans) == {local_chunks}, scans


def test_full_attention_gathers_k_and_v():
  """The full-attention layer under mesh.context is XLA's partitioning of the attention core (in its auto-axes
  region under explicit too): K and V all-gathered over context in the forward ([B, Kv, T, H] each, whole T),
  their gradients reduced in the backward; queries, scores and outputs stay sharded by query position. Its other
  gathers are kernels' (parameters shard over context too: parallel/sharding.RULES), none carrying the sequence."""
  cfg = load_config("model=qwen3.5-tiny", *SHRINK)
  m = cfg.model
  _, _, hlo = run("qwen3.5-tiny", *MESHES["context2"])
  assert m.hybrid_types().count("full_attention") == 1
  calls = _collectives(hlo, "full_attn")  # the one full-attention layer (its kind's scope)
  kv = f"f32[2,{m.num_kv_heads},{T},{m.head_dim}]"  # heads-first rows [B, Kv, T, H]
  gathers = [c for c in calls["all-gather"] if "forward" in c["scope"]]
  kv_gathers = [c for c in gathers if c["shape"].startswith(kv)]
  assert sum(c["count"] for c in kv_gathers) == 2, gathers
  assert all(f",{T}," not in c["shape"] and f"[{T}," not in c["shape"] for c in gathers if c not in kv_gathers), gathers
  assert not calls["all-to-all"] and not calls["collective-permute"]


def test_conv_halo_equals_the_whole_row_conv():
  """The conv alone, T sharded: forward bit-equal to the whole-row conv (the same products in the same order),
  its gradients within float32 summation order, on context=4: documents spanning the edges at 32, 64 and 96,
  one starting on the edge at 64, padding. Without the halo a document spanning an edge reads zeros there."""
  shards = 4
  rng = np.random.default_rng(1)
  B, C, Q = 2, 24, 4
  x = jnp.asarray(rng.normal(size=(B, T, C)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(Q, C)), jnp.float32)
  seg = jnp.asarray(batch(64)["segment_ids"])
  ct = jnp.asarray(rng.normal(size=(B, T, C)), jnp.float32)

  def f(conv):
    fn = lambda x, w: conv(x, w, segment_ids_BT=seg)
    return jax.jit(lambda x, w: (fn(x, w),) + jax.vjp(fn, x, w)[1](ct))
  want = f(short_conv.causal_conv)(x, w)
  with jax.set_mesh(make_mesh(load_config(f"cpu_devices={shards}", f"mesh.context={shards}"))):
    got = f(short_conv.causal_conv_context_parallel)(x, w)
    dropped = f(functools.partial(short_conv.causal_conv_context_parallel, halo=False))(x, w)[0]
  got, want, dropped = [np.asarray(a) for a in got], [np.asarray(a) for a in want], np.asarray(dropped)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-6)  # dx: measured 4.8e-7
  np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-5)  # dw, |dw| ~ 20: measured 7.6e-6
  edge = T // shards
  # Row 1 (one document over 0..67) reads across the first edge; without the halo it does not.
  assert np.max(np.abs(dropped[1, edge:edge + Q - 1] - want[0][1, edge:edge + Q - 1])) > LEAK
  np.testing.assert_array_equal(dropped[:, :edge], want[0][:, :edge])
