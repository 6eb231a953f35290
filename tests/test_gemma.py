"""gemma, gemma2, gemma3: shape-true parameter counts, a float64 numpy reference written layer by layer,
the grouped scan (period groups plus a remainder) against unrolled layers, the kernel-order dense on every
projection, and the Hugging Face config maps (explicit vs auto: tests/test_conformance.py)."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.hf.adapters import gemma, gemma2, gemma3
from meshlm.models import decoder
from meshlm.models.params import init_params, param_shardings, param_specs
from meshlm import spec as S

# --- sizes -------------------------------------------------------------------------------------

# Published counts, each recomputed from the official config.json values:
# - google/gemma-2b: 2,506,172,416; google/gemma-2-2b: 2,614,341,888; google/gemma-2-9b: 9,241,705,984.
# - google/gemma-3-4b-pt, text model only (text_config over Gemma3TextConfig defaults: vocab 262208,
#   hidden 2560, 34 layers, 8 heads, 4 KV heads, head_dim 256, intermediate 10240, tied): the
#   embedding 262208 * 2560 = 671,252,480, plus 34 layers * 94,382,592 (attention 15,728,640, MLP
#   78,643,200, four norms of 2560 and q/k norms of 256) plus the final norm 2560 = 3,880,263,168.
#   Its non-embedding part, 3,209,010,688, is the "3,209M" of the Gemma 3 technical report (Table 1).
PUBLISHED = {
    "gemma-2b": 2_506_172_416,
    "gemma2-2b": 2_614_341_888,
    "gemma2-9b": 9_241_705_984,
    "gemma3-4b": 3_880_263_168,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_preset_parameter_counts(name):
  cfg = load_config(f"model={name}")
  shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  assert sum(math.prod(a.shape) for a in jax.tree.leaves(shapes)) == PUBLISHED[name]
  assert "lm_head" not in shapes  # tied heads


def test_gemma3_4b_text_model_without_the_embedding():
  cfg = load_config("model=gemma3-4b")
  specs = param_specs(cfg)
  assert S.count(specs) - S.count(specs["embed"]) == 3_209_010_688


# --- a float64 reference, one layer and one head at a time --------------------------------------

def _small(family: str, **extra) -> list[str]:
  """A small config per family: odd sizes, a window shorter than the sequence, a depth that leaves a
  remainder after the last whole pattern period."""
  base = dict(vocab_size=61, embed_dim=48, num_heads=4, num_kv_heads=2, head_dim=12, mlp_dim=40,
              norm_eps=1e-6, tie_embeddings=True, hidden_activation="gelu_tanh")
  per = {
      "gemma": dict(num_layers=2, num_kv_heads=1),
      "gemma2": dict(num_layers=3, sliding_window=5, layer_pattern="[local, global]", query_pre_attn_scalar=20,
                     attn_logit_softcap=4.0, final_logit_softcap=3.0),
      # A shorter period than gemma3's 6 keeps compiles quick; depth 4 = one group of 3 + 1 more layer.
      "gemma3": dict(num_layers=4, sliding_window=5, layer_pattern="[local, local, global]",
                     rope_theta=5e4, rope_scaling="{rope_type: linear, factor: 4.0}", rope_local_theta=100.0,
                     query_pre_attn_scalar=20, qk_norm=True),
  }[family]
  fields = {"family": family, **base, **per, **extra}
  return [f"model.{k}={v}" for k, v in fields.items()] + ["model=gemma-tiny", "train.compute_dtype=float32"]


def _params(cfg, seed: int = 0):
  """Random float32 parameters (drawn in numpy: no compile), with every (1 + w) norm scale perturbed
  away from its zero init."""
  rng = np.random.default_rng(seed)
  def draw(s: S.ParamSpec):
    std = 0.5 if s.init != "normal" else s.scale / math.sqrt(s.fan_in)
    return rng.normal(0.0, std, s.shape).astype(np.float32)
  return S.map_specs(draw, param_specs(cfg))


def _ref_forward(m, params, ids):
  """Logits [B, T, V] and per-layer outputs [L, B, T, D] in float64, straight from the definitions."""
  P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  D, N, K, H = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
  T = ids.shape[1]

  def norm(w, x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + m.norm_eps) * (1.0 + w)

  def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))

  def rope(x, theta, factor):  # x [B, T, n, H], rotate-half layout
    inv = theta ** (-np.arange(0, H, 2) / H) / factor
    ang = np.arange(T)[:, None] * inv[None, :]  # [T, H/2]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  pattern = m.context_pattern()
  scale = (m.query_pre_attn_scalar or H) ** -0.5
  x = P["embed"][ids] * np.sqrt(D)  # [B, T, D]
  hidden = []
  for i in range(m.num_layers):
    p = jax.tree.map(lambda a: a[i], P["layers"]["dense"])
    local = pattern[i % len(pattern)] == "local"
    if local and m.rope_local_theta is not None:
      theta, factor = m.rope_local_theta, 1.0
    else:
      theta, factor = m.rope_theta, (m.rope_scaling or {}).get("factor", 1.0)
    h = norm(p["attn_norm"], x)
    q = np.einsum("btd,dnh->btnh", h, p["attn"]["q"])
    k = np.einsum("btd,dkh->btkh", h, p["attn"]["k"])
    v = np.einsum("btd,dkh->btkh", h, p["attn"]["v"])
    if m.qk_norm:
      q, k = norm(p["attn"]["q_norm"], q), norm(p["attn"]["k_norm"], k)
    q, k = rope(q, theta, factor), rope(k, theta, factor)
    o = np.zeros_like(q)
    for n in range(N):
      kv = n // (N // K)
      s = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, kv]) * scale
      if m.attn_logit_softcap:
        s = m.attn_logit_softcap * np.tanh(s / m.attn_logit_softcap)
      allowed = np.tril(np.ones((T, T), bool))
      if local:
        allowed &= np.subtract.outer(np.arange(T), np.arange(T)) < m.sliding_window
      s = np.where(allowed, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      o[:, :, n] = np.einsum("bts,bsh->bth", w / w.sum(-1, keepdims=True), v[:, :, kv])
    a = np.einsum("btnh,nhd->btd", o, p["attn"]["o"])
    x = x + (norm(p["attn_post_norm"], a) if "attn_post_norm" in p else a)
    h = norm(p["mlp_norm"], x)
    f = np.einsum("btf,fd->btd", gelu_tanh(h @ p["mlp"]["gate"]) * (h @ p["mlp"]["up"]), p["mlp"]["down"])
    x = x + (norm(p["mlp_post_norm"], f) if "mlp_post_norm" in p else f)
    hidden.append(x)
  logits = norm(P["final_norm"], x) @ P["embed"].T
  if m.final_logit_softcap:
    logits = m.final_logit_softcap * np.tanh(logits / m.final_logit_softcap)
  return logits, np.stack(hidden)


def _rel(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_forward_matches_float64_reference(family):
  cfg = load_config(*_small(family))
  params = _params(cfg)
  ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.model.vocab_size))
  logits, hidden = jax.jit(lambda p, t: decoder.forward(cfg, p, t, return_hidden=True))(params, ids)
  ref_logits, ref_hidden = _ref_forward(cfg.model, params, ids)
  assert hidden.shape == ref_hidden.shape == (cfg.model.num_layers, 2, 17, cfg.model.embed_dim)
  for i in range(cfg.model.num_layers):  # in layer order, through the scanned groups and the remainder
    assert _rel(hidden[i], ref_hidden[i]) < 1e-5, f"layer {i}"
  assert _rel(logits, ref_logits) < 1e-5


def test_reference_sees_every_feature():
  """The window, the local theta, the linear scaling, the caps, the scalar and the q/k norms each change
  the reference's logits at these sizes, so the comparison above covers them all."""
  cfg = load_config(*_small("gemma3", attn_logit_softcap=4.0, final_logit_softcap=3.0))
  params = _params(cfg)
  ids = np.asarray(jax.random.randint(jax.random.key(1), (1, 17), 0, cfg.model.vocab_size))
  base, _ = _ref_forward(cfg.model, params, ids)
  for change in ("sliding_window=9", "layer_pattern=[global]", "rope_local_theta=null", "rope_scaling=null",
                 "attn_logit_softcap=null", "final_logit_softcap=null", "query_pre_attn_scalar=null"):
    other = load_config(*_small("gemma3", attn_logit_softcap=4.0, final_logit_softcap=3.0), f"model.{change}")
    assert _rel(_ref_forward(other.model, params, ids)[0], base) > 1e-3, change
  dense = params["layers"]["dense"]
  no_qk = {**params, "layers": {"dense": {**dense, "attn": {**dense["attn"], "q_norm": 0 * dense["attn"]["q_norm"]}}}}
  assert _rel(_ref_forward(cfg.model, no_qk, ids)[0], base) > 1e-3


def test_grouped_scan_matches_unrolled_layers_and_other_layout():
  """The small gemma3 scans one group of 3 then runs 1 layer; unrolled layers and the layer axis stored
  second give the same hidden states."""
  cfg = load_config(*_small("gemma3"))
  params = _params(cfg)
  ids = np.asarray(jax.random.randint(jax.random.key(2), (2, 13), 0, cfg.model.vocab_size))
  run = lambda c, p: jax.jit(lambda p, t: decoder.forward(c, p, t, return_hidden=True))(p, ids)
  a_logits, a_hidden = run(cfg, params)
  b_logits, b_hidden = run(load_config(*_small("gemma3"), "scan_layers=false"), params)
  np.testing.assert_allclose(b_hidden, a_hidden, rtol=0, atol=2e-6)
  np.testing.assert_allclose(b_logits, a_logits, rtol=0, atol=2e-5)
  moved = {**params, "layers": jax.tree.map(lambda a: np.moveaxis(a, 0, min(1, a.ndim - 1)), params["layers"])}
  c_logits, c_hidden = run(load_config(*_small("gemma3"), "param_scan_axis=1"), moved)
  np.testing.assert_allclose(c_hidden, a_hidden, rtol=0, atol=2e-6)
  np.testing.assert_allclose(c_logits, a_logits, rtol=0, atol=2e-5)


def test_stored_stack_is_one_array_per_layer_parameter():
  cfg = load_config(*_small("gemma3"))
  specs = param_specs(cfg)
  L = cfg.model.num_layers
  for s in jax.tree.leaves(specs["layers"], is_leaf=S.is_spec):
    assert s.axes[0] == "layers" and s.shape[0] == L
  assert specs["layers"]["dense"]["attn"]["q_norm"].shape == (L, cfg.model.head_dim)
  assert specs["final_norm"].init == "zeros"  # (1 + w) norms start at unit scale


# --- explicit sharding -------------------------------------------------------------------------

# Explicit == auto is tests/test_conformance.py's, one row per family through 3 float32 train steps on fsdp=4:
# gemma-tiny, gemma2-tiny (both soft-caps, sandwich norms, local and global layers) and gemma3-tiny (q/k norms,
# local rope theta, the scanned period and its remainder). A loss-and-gradients check here of gemma3 with gemma2's
# caps added compiled two more programs for no part or sharding those rows do not already run.


def test_every_projection_goes_through_the_kernel_order_dense():
  """Under explicit with the flag on, each layer's 6 projections outside the attention region (q k v
  gate up down) are kernel-order custom VJPs (besides the query gather-once's), in the scanned group body and in the remainder layers
  alike. The output projection runs inside the attention's auto-axes region, where XLA folds its
  weight-gradient transpose itself (see nn/attention.py)."""
  from jax.sharding import NamedSharding, PartitionSpec
  from meshlm.parallel.mesh import make_mesh
  cfg = load_config("model=gemma3-tiny", "cpu_devices=4", "mesh.fsdp=4", "shard_mode=explicit")
  assert cfg.model.num_layers == 8 and len(cfg.model.context_pattern()) == 6
  mesh = make_mesh(cfg)
  params = S.map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_specs(cfg))
  params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), params,
                        param_shardings(cfg, mesh))
  ids = jax.ShapeDtypeStruct((4, 16), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
  with jax.set_mesh(mesh):
    text = str(jax.make_jaxpr(lambda p, t: decoder.forward(cfg, p, t))(params, ids))
  # The group body holds its 6 layers once; the 2 remainder layers are unrolled. Each layer: the 6
  # kernel-order projections plus the gathered query kernel's gradient pin (nn/gather_once.gathered); the other
  # custom VJPs (the kernels' cast, RoPE) are named apart.
  import re
  from collections import Counter
  vjps = Counter(re.findall(r"name=(\w+)", text))
  assert (vjps["_einsum_kernel_order"], vjps["_gathered"]) == (6 * (6 + 2), 6 + 2), vjps


# --- config errors -----------------------------------------------------------------------------

def test_config_errors_name_the_key():
  with pytest.raises(ConfigError, match=r"layer_pattern: has local layers but sliding_window is null"):
    load_config("model=gemma2-tiny", "model.sliding_window=null")
  with pytest.raises(ConfigError, match=r"layer_pattern: must name at least one attention context"):
    load_config("model=gemma2-tiny", "model.layer_pattern=[]")
  with pytest.raises(ConfigError, match=r"model.layer_pattern.0"):
    load_config("model=gemma2-tiny", "model.layer_pattern=[sliding]")
  with pytest.raises(ConfigError, match=r"rope_scaling.rope_type: 'dynamic' is not supported"):
    load_config("model=gemma3-tiny", "model.rope_scaling={rope_type: dynamic, factor: 2.0}")
  with pytest.raises(ConfigError, match=r"model.hidden_activation"):
    load_config("model=gemma-tiny", "model.hidden_activation=relu")
  with pytest.raises(ConfigError, match=r"model.family='gemma4': unknown"):
    param_specs(load_config("model=gemma-tiny", "model.family=gemma4"))


# --- Hugging Face config maps ------------------------------------------------------------------

@pytest.mark.parametrize("name,fam", [("gemma-2b", gemma), ("gemma2-9b", gemma2), ("gemma3-4b", gemma3),
                                      ("gemma2-tiny", gemma2), ("gemma3-tiny", gemma3)])
def test_hf_config_round_trip(name, fam):
  from meshlm.hf import hf_config
  cfg = load_config(f"model={name}")
  hf = json.loads(json.dumps(hf_config(cfg)))
  assert hf["model_type"] == fam.HF_MODEL_TYPE
  back = load_config(base={"model": fam.from_hf_config(hf)})
  assert back.model == cfg.model


def test_gemma3_reads_the_published_config_json():
  """The text_config of google/gemma-3-4b-pt's config.json (older field names; everything else is at
  Gemma3TextConfig's defaults) reads as the gemma3-4b preset."""
  text_config = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                 "sliding_window": 1024}
  m = load_config(base={"model": gemma3.from_hf_config(text_config)}).model
  preset = load_config("model=gemma3-4b").model
  assert m == preset
  assert m.context_pattern() == ("local",) * 5 + ("global",) and m.rope_local_theta == 10000.0


def test_gemma3_reads_transformers5_rope_parameters():
  hf = {"vocab_size": 61, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e4},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}
  m = load_config(base={"model": gemma3.from_hf_config(hf)}).model
  assert m.layer_pattern == ["local", "global"] and m.num_layers == 3
  assert (m.rope_theta, m.rope_scaling, m.rope_local_theta) == (5e4, {"rope_type": "linear", "factor": 4.0}, 100.0)
  hf["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}
  with pytest.raises(ConfigError, match="rope_parameters.sliding_attention"):
    gemma3.from_hf_config(hf)


def test_hf_activation_names_follow_transformers():
  hf = {"vocab_size": 61, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 4, "head_dim": 12}
  # GemmaConfig reads the legacy "gelu" as the tanh approximation; Gemma2Config means the exact GELU.
  assert gemma.from_hf_config({**hf, "hidden_act": "gelu"})["hidden_activation"] == "gelu_tanh"
  # transformers 5's GemmaMLP reads hidden_act, 4.x's hidden_activation: the export writes both.
  out = gemma.to_hf_config(load_config("model=gemma-tiny").model)
  assert out["hidden_act"] == out["hidden_activation"] == "gelu_pytorch_tanh"
  assert gemma2.from_hf_config({**hf, "hidden_activation": "gelu"})["hidden_activation"] == "gelu"
  with pytest.raises(ConfigError, match=r"hidden_activation='relu' is not supported"):
    gemma2.from_hf_config({**hf, "hidden_activation": "relu"})
  with pytest.raises(ConfigError, match=r"use_bidirectional_attention"):
    gemma3.from_hf_config({**hf, "use_bidirectional_attention": True})
  with pytest.raises(ConfigError, match=r"model.attn_logit_softcap"):
    gemma3.to_hf_config(load_config("model=gemma3-tiny", "model.attn_logit_softcap=50.0").model)
  with pytest.raises(ConfigError, match=r"use model.family=gemma2"):
    gemma.to_hf_config(load_config("model=gemma2-tiny", "model.family=gemma").model)
