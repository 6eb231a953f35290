"""The decoder: parameter counts, the stored kernel's independence from flags, layer-stack variants."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.config import load_config
from meshlm.models import count, forward, init_params, param_shardings, param_specs
from meshlm import spec as S
from meshlm.parallel.mesh import make_mesh

# Published totals: Llama 2 7B (untied, 32 MHA layers) and Llama 3 8B (GQA 8 KV heads, 128k vocab).
PUBLISHED = {"llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248}


def tiny(*overrides: str):
  """llama2-tiny in float32 on 4 devices, fsdp=4, with a short sequence."""
  return load_config("cpu_devices=4", "mesh.fsdp=4", "train.compute_dtype=float32", "train.seq_len=32",
                     "train.per_device_batch_size=1", "train.sample_tokens=0", *overrides)


def _tokens(cfg, B: int, T: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)


# --- shapes without allocation -----------------------------------------------------------------

@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_count_from_specs(name):
  cfg = load_config(f"model={name}")
  assert count(param_specs(cfg)) == PUBLISHED[name]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_count_from_eval_shape(name):
  cfg = load_config(f"model={name}")
  shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  leaves = jax.tree.leaves(shapes)
  assert all(isinstance(a, jax.ShapeDtypeStruct) and a.dtype == jnp.float32 for a in leaves)
  assert sum(int(np.prod(a.shape)) for a in leaves) == PUBLISHED[name]
  m = cfg.model
  assert shapes["embed"].shape == (m.vocab_size, m.embed_dim)
  assert shapes["lm_head"].shape == (m.embed_dim, m.vocab_size)
  assert shapes["layers"]["dense"]["attn"]["k"].shape == (m.num_layers, m.embed_dim, m.num_kv_heads, m.head_dim)
  assert shapes["layers"]["dense"]["mlp"]["down"].shape == (m.num_layers, m.mlp_dim, m.embed_dim)


def test_real_size_forward_shape_without_allocation():
  cfg = load_config("model=llama3-8b", "train.compute_dtype=bfloat16")
  params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  logits = jax.eval_shape(lambda p, t: forward(cfg, p, t), params, jax.ShapeDtypeStruct((2, 16), jnp.int32))
  assert logits.shape == (2, 16, 128256) and logits.dtype == jnp.bfloat16


def test_tied_embedding_drops_the_head():
  cfg = load_config("model=llama2-7b", "model.tie_embeddings=true")
  specs = param_specs(cfg)
  assert "lm_head" not in specs
  assert count(specs) == PUBLISHED["llama2-7b"] - 32000 * 4096


def test_param_scan_axis_moves_the_layer_axis_only():
  cfg0, cfg1 = load_config("param_scan_axis=0"), load_config("param_scan_axis=1")
  s0, s1 = param_specs(cfg0)["layers"], param_specs(cfg1)["layers"]
  L = cfg0.model.num_layers
  for a, b in zip(jax.tree.leaves(s0, is_leaf=S.is_spec), jax.tree.leaves(s1, is_leaf=S.is_spec)):
    assert a.shape[0] == L and a.axes[0] == "layers"
    assert b.shape[1] == L and b.axes[1] == "layers"
    assert b.shape == (a.shape[1], L) + a.shape[2:]
  # Same numbers, whatever the storage order.
  p0, p1 = init_params(cfg0, jax.random.key(3)), init_params(cfg1, jax.random.key(3))
  for a, b in zip(jax.tree.leaves(p0["layers"]), jax.tree.leaves(p1["layers"])):
    np.testing.assert_array_equal(np.moveaxis(np.asarray(b), 1, 0), np.asarray(a))


def _saved_by_the_period_scan(cfg, G: int) -> set[tuple[str, tuple[int, ...]]]:
  """(dtype, shape) of what the forward's scan over the G periods outputs when differentiated: its carry and the
  residuals it stacks for the backward (inputs it forwards as they are, the parameters among them, are not
  outputs). From the jaxpr of jax.vjp of the forward, on abstract shapes."""
  import jax.extend as jex
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((2, cfg.train.seq_len), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda p, t: jax.vjp(lambda p: forward(cfg, p, t), p)[1])(params, tokens).jaxpr
  outs = set()

  def walk(j):
    for e in j.eqns:
      if e.primitive.name == "scan" and e.params["length"] == G and not e.params["reverse"]:
        outs.update((str(v.aval.dtype), tuple(v.aval.shape)) for v in e.outvars)
      for v in e.params.values():
        for sub in v if isinstance(v, (list, tuple)) else [v]:
          if isinstance(sub, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
            walk(getattr(sub, "jaxpr", sub))
  walk(jaxpr)
  return outs


def test_the_period_scan_saves_the_layer_inputs_not_the_kernels(monkeypatch):
  """qwen3.5-tiny at 6 layers, remat=full, bf16 compute: a scan over 2 periods of 2 GDN layers and 1 attention
  layer. Its forward saves for the backward each layer's input x [G, B, T, D] and nothing else: no copy of a
  layer's kernels. A kind that repeats in a period takes its layer's row inside the rematerialized function
  (models/layers._Run.layer_fn's row), so remat saves the scan's own xs, which the scan forwards. Control: the row
  taken outside, as before; the scan then stacks every GDN layer's parameters (XLA:TPU held them as a float32 copy
  of the GDN layers' kernels: 0.92 GiB more on the 0.6B hybrid, docs/compile.md)."""
  from meshlm.models import layers as L
  # The reference rule: the residuals do not depend on how the rule runs, and it traces faster.
  cfg = load_config("model=qwen3.5-tiny", "model.num_layers=6", "model.full_attention_interval=3",
                    "model.parts.gdn.impl=reference", "train.seq_len=64", "remat=full", "train.compute_dtype=bfloat16")
  G, B, T, D = 2, 2, 64, cfg.model.embed_dim
  assert _saved_by_the_period_scan(cfg, G) == {("bfloat16", (B, T, D)), ("bfloat16", (G, B, T, D))}

  taken_inside = L._Run.layer_fn

  def taken_outside(self, i, row=None):
    f = taken_inside(self, i)
    return f if row is None else (lambda p, x, state, inputs: f(L._layer(p, row, 0), x, state, inputs))
  monkeypatch.setattr(L._Run, "layer_fn", taken_outside)
  rows = {("float32", (G,) + a.shape[1:])
          for a in jax.tree.leaves(param_specs(cfg)["layers"]["linear_attn"], is_leaf=S.is_spec)}
  saved = _saved_by_the_period_scan(cfg, G)
  assert rows <= saved and saved - rows == {("bfloat16", (B, T, D)), ("bfloat16", (G, B, T, D))}, saved


# --- the stored kernel never depends on a flag -------------------------------------------------

FLAG_VARIANTS = [
    (),
    ("lm_head_weight_grad_in_kernel_order=false", "dense_weight_grad_in_kernel_order=false"),
    ("weight_grad_impl=auto_axes",),
    ("shard_mode=auto",),
]


def test_specs_and_init_do_not_depend_on_flags():
  base_cfg = tiny()
  base_specs = param_specs(base_cfg)
  base = init_params(base_cfg, jax.random.key(1))
  for flags in FLAG_VARIANTS[1:]:
    cfg = tiny(*flags)
    assert param_specs(cfg) == base_specs, flags
    params = init_params(cfg, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(flags))


def test_shardings_do_not_depend_on_flags_or_mode():
  base_cfg = tiny("mesh.fsdp=2", "mesh.tensor=2")
  base = jax.tree.map(lambda s: s.spec, param_shardings(base_cfg, make_mesh(base_cfg)))
  for flags in FLAG_VARIANTS[1:]:
    cfg = tiny("mesh.fsdp=2", "mesh.tensor=2", *flags)
    assert jax.tree.map(lambda s: s.spec, param_shardings(cfg, make_mesh(cfg))) == base, flags


# --- forward -----------------------------------------------------------------------------------

def test_public_forward_api():
  cfg = meshlm.load_config("train.compute_dtype=float32")
  params = meshlm.init_params(cfg, jax.random.key(0))
  logits = meshlm.forward(cfg, params, jnp.asarray(_tokens(cfg, 2, 24)))
  assert logits.shape == (2, 24, cfg.model.vocab_size) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))
  # Near-uniform at init: unit-scale embeddings, 1/sqrt(fan_in) kernels.
  assert abs(float(jnp.std(logits)) - 1.0) < 0.5


def test_forward_is_causal_and_respects_segments():
  cfg = load_config("train.compute_dtype=float32")
  params = init_params(cfg, jax.random.key(0))
  fwd = jax.jit(lambda t, s: forward(cfg, params, t, segment_ids_BT=s))
  toks = _tokens(cfg, 1, 16)
  seg = np.ones((1, 16), np.int32)
  base = np.asarray(fwd(toks, seg))
  changed = toks.copy()
  changed[0, 10] = (changed[0, 10] + 1) % cfg.model.vocab_size
  out = np.asarray(fwd(changed, seg))
  np.testing.assert_array_equal(out[0, :10], base[0, :10])  # the past never sees the future
  assert np.max(np.abs(out[0, 10:] - base[0, 10:])) > 1e-3
  # Two packed documents: changing the first leaves the second's logits unchanged (to rounding).
  seg2 = np.array([[1] * 8 + [2] * 8], np.int32)
  first_changed = toks.copy()
  first_changed[0, 2] = (first_changed[0, 2] + 1) % cfg.model.vocab_size
  pos = np.array([list(range(8)) * 2], np.int32)
  fwd_pos = jax.jit(lambda t: forward(cfg, params, t, positions_BT=pos, segment_ids_BT=seg2))
  a, b = np.asarray(fwd_pos(toks)), np.asarray(fwd_pos(first_changed))
  np.testing.assert_allclose(b[0, 8:], a[0, 8:], rtol=0, atol=1e-6)
  # The second document alone, at positions 0..7, gives the same logits.
  alone = np.asarray(jax.jit(lambda t: forward(cfg, params, t))(toks[:, 8:]))
  np.testing.assert_allclose(a[0, 8:], alone[0], rtol=1e-5, atol=1e-5)


def test_tied_head_is_an_einsum_over_the_table():
  cfg = load_config("train.compute_dtype=float32", "model.tie_embeddings=true")
  params = init_params(cfg, jax.random.key(0))
  toks = jnp.asarray(_tokens(cfg, 2, 8))
  logits, hidden = forward(cfg, params, toks, return_hidden=True)
  assert "lm_head" not in params
  from meshlm.nn.norm import rms_norm
  x = np.asarray(rms_norm(params["final_norm"], hidden[-1], cfg.model.norm_eps), np.float64)
  ref = x @ np.asarray(params["embed"], np.float64).T
  np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-5)


def test_every_layer_names_its_scope():
  cfg = load_config("train.compute_dtype=float32", "scan_layers=true")
  params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  text = jax.jit(lambda p, t: forward(cfg, p, t)).lower(params, jax.ShapeDtypeStruct((1, 8), jnp.int32)).as_text(
      debug_info=True)
  scopes = set()
  for name in re.findall(r'loc\("([^"]+)"', text):
    scopes.update(name.split("/"))
  for scope in ("embed", "layers", "attn", "rms_norm", "q", "k", "v", "o", "rope", "attention", "mlp", "gate",
                "up", "down", "lm_head"):
    assert scope in scopes, scope
