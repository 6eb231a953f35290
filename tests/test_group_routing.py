"""DeepSeek-V3's group-limited sigmoid routing (nn/moe/routing.py group_route) against a float64 NumPy reference,
router replay through it, the MoE layer and its load counts, and the config checks.

The reference: s = sigmoid(logits); biased = s + bias; each of n_group groups scores the sum of its top 2
biased scores; the topk_group best groups are kept (ties: the lower group); the other groups' experts
score `fill`; the top k of all E (ties: the lower id); weights = s at the ids, / (sum + 1e-20) with
norm_topk, times routed_scaling_factor. The inputs hold exact ties (a group copied onto another, an
expert copied onto its neighbour) and biases that push kept experts' scores below 0, where a fill of
0.0 and of -inf pick different experts.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.nn import moe
from meshlm.nn import router_replay as rr
from meshlm.nn.dense import dense
from meshlm.parallel.mesh import make_mesh
from moe_helpers import settings

M, E, G, KG, K = 64, 16, 4, 2, 4  # tokens, experts, groups, kept groups, top-k
PER = E // G
SCALE = 2.5


def reference(logits, bias, *, k=K, n_group=G, topk_group=KG, norm=True, scale=SCALE, fill=0.0):
  """(ids [M, k], weights [M, k] float64, dropped [M] bool: a chosen expert lies in a dropped group)."""
  s = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
  b = s + np.asarray(bias, np.float64)
  per = b.shape[1] // n_group
  ids, ws, dropped = [], [], []
  for n in range(b.shape[0]):
    gscore = [np.sum(np.sort(b[n, g * per:(g + 1) * per])[-2:]) for g in range(n_group)]
    kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
    choice = np.full(b.shape[1], fill)
    for g in kept:
      choice[g * per:(g + 1) * per] = b[n, g * per:(g + 1) * per]
    top = sorted(range(b.shape[1]), key=lambda e: (-choice[e], e))[:k]
    w = s[n, top]
    if norm:
      w = w / (np.sum(w) + 1e-20)
    ids.append(top)
    ws.append(w * scale)
    dropped.append(any(e // per not in kept for e in top))
  return np.asarray(ids), np.asarray(ws), np.asarray(dropped)


def reference_grad(logits, ids, c, *, norm=True, scale=SCALE):
  """d sum(c * weights) / d logits in float64, the ids held fixed (they are integers)."""
  s = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
  g = np.zeros_like(s)
  for n in range(s.shape[0]):
    sc, cn = s[n, ids[n]], np.asarray(c[n], np.float64)
    if norm:
      S = np.sum(sc) + 1e-20
      ds = scale * (cn / S - np.sum(cn * sc) / S ** 2)
    else:
      ds = scale * cn
    g[n, ids[n]] = ds * sc * (1 - sc)
  return g


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  logits = rng.normal(0.0, 2.0, (M, E)).astype(np.float32)
  bias = rng.uniform(-1.2, 0.3, E).astype(np.float32)  # most biased scores s + bias can go negative
  bias[2 * PER:3 * PER] = bias[:PER]  # group 2 carries group 0's bias ...
  logits[:12, 2 * PER:3 * PER] = logits[:12, :PER]  # ... and, on rows 0-11, its logits: tied groups
  bias[5] = bias[4]
  logits[12:24, 5] = logits[12:24, 4]  # tied experts 4 and 5 on rows 12-23
  logits[40:] -= 3.0  # small scores: the kept groups' biased scores are mostly negative
  return logits, bias


def _route(logits, bias, **kw):
  kw = dict(dict(n_group=G, topk_group=KG, norm_topk=True, scaling=SCALE), **kw)
  s, w, ids = jax.jit(functools.partial(moe.group_route, k=K, **kw))(jnp.asarray(logits), jnp.asarray(bias))
  return np.asarray(s), np.asarray(w, np.float64), np.asarray(ids)


@pytest.mark.parametrize("fill", ["zero", "-inf"])
def test_routing_equals_the_float64_reference(inputs, fill):
  logits, bias = inputs
  want_ids, want_w, dropped = reference(logits, bias, fill=moe.GROUP_MASKS[fill])
  _, w, ids = _route(logits, bias, dropped=moe.GROUP_MASKS[fill])
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=0)
  # The adversarial inputs are there: a tie cut by the top-k (one of the tied experts 4, 5 chosen, the
  # lower), and (with 0.0) dropped experts beating negative kept ones.
  cut = [(4 in r) != (5 in r) for r in want_ids[12:24]]
  assert any(cut) and all(4 in r for r, c in zip(want_ids[12:24], cut) if c)
  if fill == "zero":
    assert 5 <= dropped.sum() < M, dropped.sum()
  else:
    assert not dropped.any()


def test_the_other_fill_and_biased_weights_fail_the_reference(inputs):
  """Negative controls: -inf for the dropped groups (transformers 5's rule) against the 0.0 reference
  (and back), and weights taken from the biased scores, each miss the reference."""
  logits, bias = inputs
  zero_ids, zero_w, _ = reference(logits, bias, fill=0.0)
  _, _, inf_ids = _route(logits, bias, dropped=-np.inf)
  assert np.sum(np.any(inf_ids != zero_ids, axis=1)) >= 5
  s, _, ids = _route(logits, bias)
  biased = np.take_along_axis(s + bias, ids, axis=1).astype(np.float64)
  wrong = biased / (biased.sum(1, keepdims=True) + 1e-20) * SCALE
  assert not np.allclose(wrong, zero_w, rtol=1e-3)


@pytest.mark.parametrize("norm", [True, False])
def test_weights_and_router_gradient_equal_the_reference(inputs, norm):
  """The weights' gradient reaches the logits only through the unbiased scores at the ids; the bias
  gets none (it only picks)."""
  logits, bias = inputs
  ids, want_w, _ = reference(logits, bias, norm=norm)
  c = np.cos(np.arange(M * K, dtype=np.float32)).reshape(M, K)

  def f(lg, b):
    _, w, _ = moe.group_route(lg, b, K, n_group=G, topk_group=KG, norm_topk=norm, scaling=SCALE)
    return jnp.sum(jnp.asarray(c) * w), w

  (_, w), (gl, gb) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(jnp.asarray(logits),
                                                                                jnp.asarray(bias))
  np.testing.assert_allclose(np.asarray(w, np.float64), want_w, rtol=2e-6)
  want_g = reference_grad(logits, ids, c, norm=norm)
  np.testing.assert_allclose(np.asarray(gl, np.float64), want_g, rtol=1e-5, atol=1e-5 * np.abs(want_g).max())  # s (1 - s) near s = 1: float32
  np.testing.assert_array_equal(np.asarray(gb), 0.0)
  wrong = reference_grad(logits, np.roll(ids, 1, axis=0), c, norm=norm)  # control: other ids' gradient
  assert not np.allclose(np.asarray(gl, np.float64), wrong, rtol=1e-3, atol=1e-6)


def _forced(logits, bias, n):
  """The k experts with the lowest biased scores (never routed) for the first n rows, -1 for the rest."""
  s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  low = np.argsort(s + bias, axis=1, kind="stable")[:, :K].astype(np.int32)
  return np.where(np.arange(M)[:, None] < n, low, -1).astype(np.int32)


def _replay(logits, bias, forced, rows, impl="compact", mask=None):
  select = functools.partial(moe.group_limited_topk, n_group=G, topk_group=KG, dropped=0.0)
  weigh = functools.partial(moe.sigmoid_weights, norm_topk=True, scaling=SCALE)
  c = jnp.cos(jnp.arange(M * K, dtype=jnp.float32)).reshape(1, M, K)

  def f(lg):
    _, w, ids = rr.replay_route(lg, forced, K, True, mask, rows=rows, impl=impl, scoring="sigmoid", select=select,
                                select_args=(jnp.asarray(bias),), weigh=weigh)
    return jnp.sum(c * w), (w, ids)
  return jax.value_and_grad(f, has_aux=True)(jnp.asarray(logits)[None])


def test_replayed_ids_bypass_groups_and_bias_and_the_router_keeps_its_gradient(inputs):
  logits, bias = inputs
  want_ids, _, _ = reference(logits, bias)
  forced = jnp.asarray(_forced(logits, bias, 40)[None])
  runs = [jax.jit(functools.partial(_replay, rows=r, impl=i))(logits, bias, forced)
          for r, i in ((32, "compact"), (8, "compact"), (M, "full"))]  # compact, its fallback, the plain path
  (_, (w, ids)), g = runs[0]
  for (_, (w2, ids2)), g2 in runs[1:]:
    np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(w2), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(g2), np.asarray(g))
  ids, w, g = np.asarray(ids)[0], np.asarray(w, np.float64)[0], np.asarray(g, np.float64)[0]
  np.testing.assert_array_equal(ids[:40], np.asarray(forced)[0, :40])  # no group or bias rule applied
  np.testing.assert_array_equal(ids[40:], want_ids[40:])  # the unforced rows: routed as usual
  s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  sc = np.take_along_axis(s, ids, axis=1)
  np.testing.assert_allclose(w, sc / (sc.sum(1, keepdims=True) + 1e-20) * SCALE, rtol=2e-6)
  c = np.cos(np.arange(M * K, dtype=np.float32)).reshape(M, K)
  want_g = reference_grad(logits, ids, c)
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-5 * np.abs(want_g).max())  # s (1 - s) near s = 1: float32
  assert np.abs(g[:40]).max() > 1e-3  # the forced rows' router gradient
  assert not set(map(tuple, ids[:40])) & set(map(tuple, want_ids[:40]))  # control: the forced ids are not routed ones


def test_sharded_replay_gives_the_unsharded_routing(inputs):
  """Under a 2-device fsdp mesh the replay's shard_map gets the bias as a replicated operand."""
  logits, bias = inputs
  forced = jnp.asarray(_forced(logits, bias, 20)[None])
  lg2 = np.concatenate([logits, logits[::-1]])  # B = 2 rows of M tokens: one per shard
  forced2 = jnp.concatenate([forced, forced[:, ::-1]])
  select = functools.partial(moe.group_limited_topk, n_group=G, topk_group=KG, dropped=0.0)
  weigh = functools.partial(moe.sigmoid_weights, norm_topk=True, scaling=SCALE)
  f = jax.jit(lambda lg, fo, b: rr.replay_route(lg, fo, K, True, rows=16, scoring="sigmoid", select=select,
                                                select_args=(b,), weigh=weigh)[1:])
  want = f(jnp.asarray(lg2.reshape(2, M, E)), forced2, jnp.asarray(bias))
  mesh = make_mesh(load_config("cpu_devices=2", "mesh.fsdp=2", "shard_mode=explicit"))
  from jax.sharding import NamedSharding, PartitionSpec as P
  with jax.set_mesh(mesh):
    got = f(jax.device_put(jnp.asarray(lg2.reshape(2, M, E)), NamedSharding(mesh, P("fsdp"))),
            jax.device_put(forced2, NamedSharding(mesh, P("fsdp"))), jnp.asarray(bias))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_the_moe_layer_routes_by_groups_and_counts_real_tokens(inputs):
  """moe_mlp(router_scoring="sigmoid"): dropless equals the every-expert reference with the same routing, its
  ids are group_route's, and moe_expert_load counts each expert's (token, slot) pairs of the real tokens."""
  _, bias = inputs
  D, F, B, T = 16, 8, 2, 12
  rng = np.random.default_rng(1)
  p = {"router": jnp.asarray(rng.normal(0, 1, (D, E)), jnp.float32),
       "gate": jnp.asarray(rng.normal(0, 0.3, (E, D, F)), jnp.float32),
       "up": jnp.asarray(rng.normal(0, 0.3, (E, D, F)), jnp.float32),
       "down": jnp.asarray(rng.normal(0, 0.3, (E, F, D)), jnp.float32)}
  x = jnp.asarray(rng.normal(0, 1, (B, T, D)), jnp.float32)
  mask = np.ones((B, T), bool)
  mask[1, 7:] = False  # a padded tail
  ctx = type("Ctx", (), {"dense": staticmethod(functools.partial(dense, kernel_order=True))})
  s, opts = settings(E, K, norm_topk_prob=True, router_scoring="sigmoid", n_group=G, topk_group=KG,
                     routed_scaling_factor=SCALE)
  kw = dict(router_bias=jnp.asarray(bias), token_mask_BT=jnp.asarray(mask))
  y, side = jax.jit(lambda p, x: moe.moe_mlp(p, x, ctx, s, opts, **kw))(p, x)
  y_ref, _ = jax.jit(lambda p, x: moe.moe_mlp(p, x, ctx, s.model_copy(update=dict(impl="reference")), opts, **kw))(p, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
  logits = np.asarray(x).reshape(-1, D) @ np.asarray(p["router"])
  ids = np.asarray(side["moe_expert_ids"]).reshape(-1, K)
  np.testing.assert_array_equal(ids, reference(logits, bias)[0])
  want_load = np.bincount(ids[mask.reshape(-1)].reshape(-1), minlength=E)
  np.testing.assert_array_equal(np.asarray(side["moe_expert_load"]), want_load)
  assert np.sum(want_load) == K * mask.sum() < K * B * T  # control: the padding's pairs are not in it


# --- config checks ---------------------------------------------------------------------------------

GOOD = dict(num_experts=8, num_experts_per_tok=2, router_scoring="sigmoid", n_group=4, topk_group=2)
KEY = "model.parts.moe."


def _model(**kw):
  from meshlm.config import ModelConfig
  base = load_config("model=llama2-tiny").model.model_dump()
  return ModelConfig(**dict(base, family="groupkind", parts={"moe": dict(mlp_dim=16, **dict(GOOD, **kw))}))


@pytest.mark.parametrize("kw,key", [
    (dict(n_group=3), f"{KEY}n_group=3 does not divide {KEY}num_experts=8"),
    (dict(topk_group=5, n_group=4), f"{KEY}topk_group=5 is larger than {KEY}n_group=4"),
    (dict(num_experts_per_tok=5), f"{KEY}num_experts_per_tok=5 is larger than topk_group x experts per group"),
    (dict(router_scoring="softmax"), f"{KEY}router_scoring=softmax"),
    (dict(n_group=8, topk_group=4), f"{KEY}n_group=8: each group scores the sum of its top 2"),
    (dict(router_aux_loss_coef=0.01), f"{KEY}router_aux_loss_coef=0.01: the Switch load-balancing loss"),
    (dict(router_dtype="bfloat16"), f"{KEY}router_dtype=bfloat16: group-limited sigmoid routing"),
])
def test_bad_group_routing_is_one_line_naming_the_key(kw, key):
  from meshlm.models.ffns.moe import validate_group_routing
  validate_group_routing(_model())  # the good config passes
  with pytest.raises(ConfigError) as e:
    validate_group_routing(_model(**kw))
  assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_the_cli_exits_2_naming_the_key(tmp_path, capsys, monkeypatch):
  from meshlm import cli
  from meshlm.models import registry
  monkeypatch.setitem(registry.FAMILIES, "groupkind", "groupkind")
  args = ["train", "model=llama2-tiny", "model.family=groupkind", f"{KEY}num_experts=8", f"{KEY}mlp_dim=16",
          f"{KEY}shared_expert_mlp_dim=16", f"{KEY}router_scoring=sigmoid", f"{KEY}n_group=3", f"run_dir={tmp_path}"]
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"{KEY}n_group=3 does not divide" in err[0], err


@pytest.mark.parametrize("preset,key", [("mixtral-tiny", f"{KEY}router_scoring=sigmoid"),
                                        ("qwen3-moe-tiny", f"{KEY}router_bias_update_rate=0.1"),
                                        ("qwen3-next-tiny", f"{KEY}n_group=2")])
def test_softmax_families_refuse_the_group_routing_keys(preset, key):
  from meshlm.models import registry
  registry.family(load_config(f"model={preset}"))  # as it is: accepted
  with pytest.raises(ConfigError) as e:
    registry.family(load_config(f"model={preset}", key))
  assert str(e.value).startswith(key) and "routes with softmax" in str(e.value)


def test_a_checkpoint_from_before_these_keys_still_matches():
  """A checkpoint's model record without the routing keys (written before they existed, with the MoE keys flat, as
  before they moved into model.parts.moe) had their defaults: it matches a softmax model, and not one that sets a
  key (control)."""
  from meshlm.train.checkpoint import _model_mismatch
  cfg = load_config("model=mixtral-tiny")
  old = {k: v for k, v in cfg.model.model_dump(mode="json").items() if k != "parts"}
  old.update(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=256, norm_topk_prob=True, router_dtype="float32",
             router_aux_loss_coef=0.0, router_z_loss_coef=0.0, moe_impl="dropless", moe_grouped_matmul="auto",
             moe_kernel_fsdp="embed", shared_expert_mlp_dim=None)
  assert _model_mismatch(old, cfg) is None
  bad = _model_mismatch(old, load_config("model=mixtral-tiny", f"{KEY}router_group_mask=-inf"))
  assert bad == f"{KEY}router_group_mask is '-inf' here but 'zero' in the checkpoint"
