"""The compact expert-parallel dispatch (model.parts.moe.ep_impl=compact, expert_parallel.py `dispatch_compact`):
only the rows routed to a device's experts move, by all_to_all, in a buffer of C rows per peer.

- Dropless (ep_buffer_factor null) it equals the unsharded dispatch (forward and every gradient, float32, within
  test_moe_ep's TOL) on expert=2 x fsdp=2 under both shard modes (and explicit = auto directly), on expert=4, and on
  expert=2 with 3 rows (the batch not split over the expert axis: the group's copies split the tokens).
- A skewed routing (test_moe_ep's: expert 0 takes every token) on expert=4, one row per device: the dropped
  fraction equals a NumPy count of the slots past C per (device, destination) (C from factor 1.0: many drop);
  one row short of the largest count (negative control) exactly one slot drops per fullest pair, y equals the
  dispatch with exactly those slots' weights zeroed, and differs from the dropless y.
- Gradients when slots drop: on expert=2 (two rows per device, the routing given), with a buffer two rows under the
  second-hottest (sender, destination) count, so both senders drop and each cut falls inside one expert's slots
  (the stable order within an expert decides which drop), the dispatch's output and its gradients w.r.t. x, the
  routing weights and the three kernels equal the unsharded dispatch with the dropped slots' weights zeroed (the
  set from NumPy: per sender, per destination, the slots past C in stable expert order; float32, within TOL); the
  dropped weights get exactly zero gradient.
  Control: a mask dropping one different slot (the last kept neighbour instead) fails every leaf by > 100 x TOL.
- The compiled program moves no group tokens: no all-gather or reduce-scatter of token rows, all-to-alls instead
  (the gather dispatch's compile has them: control).
- The drop metrics (Part.metrics): on only under compact, token-weighted mean and unweighted max over
  micro-batches; the progress text; the config's one-line refusals.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm.analysis.census import hlo_counts
from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.models.model import resolve
from meshlm.nn import moe
from meshlm.nn.moe import layer
from meshlm.parallel.sharding import logical_spec
from meshlm.train.loop import part_metrics_text
from meshlm.train.step import part_losses
from test_moe_ep import CTX, SPEC, B, D, E, K, T, TOL, _inputs, _loss, _mesh, _rel_diffs
from moe_helpers import settings

COMPACT = dict(ep_impl="compact")


def _settings(**kw):
  return settings(E, K, norm_topk_prob=True, **kw)


def _grad_fn(**kw):
  def f(p, x):
    y, side = moe.moe_mlp(p, x, CTX, *_settings(**kw))
    return _loss(y, side), (y, side[moe.DROPPED])
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


def _placed(mesh, p, x):
  put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
  return {k: put(v, SPEC[k].axes) for k, v in p.items()}, put(x, ("batch", "length", "act_embed"))


_runs: dict = {}


def run(axes: dict, mode: str = "explicit", rows: int = B, **kw):
  """((loss, (y, dropped)), grads), compiled HLO text: the layer's value_and_grad on a mesh (cached)."""
  key = (tuple(axes.items()), mode, rows, tuple(sorted(kw.items())))
  if key not in _runs:
    x, p = _inputs()
    mesh = _mesh(axes, mode)
    with jax.set_mesh(mesh):
      ps, xs = _placed(mesh, p, x[:rows])
      compiled = jax.jit(_grad_fn(**kw)).lower(ps, xs).compile()
      _runs[key] = jax.device_get(compiled(ps, xs)), compiled.as_text()
  return _runs[key]


def _as_ep(out):
  """test_moe_ep's ((loss, y), (d_params, d_x)) from this file's ((loss, (y, dropped)), grads)."""
  (loss, (y, _)), grads = out
  return (loss, y), grads


@pytest.fixture(scope="module")
def unsharded():
  x, p = _inputs()
  f = jax.jit(_grad_fn())
  return {rows: _as_ep(f(p, x[:rows])) for rows in (B, 3)}


CASES = [({"expert": 2, "fsdp": 2}, "explicit", B), ({"expert": 2, "fsdp": 2}, "auto", B),
         ({"expert": 4}, "explicit", B), ({"expert": 2}, "explicit", 3)]


@pytest.mark.parametrize("axes, mode, rows", CASES, ids=["expert2-fsdp2-explicit", "expert2-fsdp2-auto", "expert4",
                                                         "expert2-3rows"])
def test_compact_dropless_equals_the_unsharded_dispatch(unsharded, axes, mode, rows):
  out, _ = run(axes, mode, rows, **COMPACT)
  diffs = _rel_diffs(_as_ep(out), unsharded[rows])
  print(axes, mode, rows, diffs)
  assert set(diffs) == {"loss", "y", "d_x", "d_router", "d_gate", "d_up", "d_down"}
  assert max(diffs.values()) <= TOL, diffs
  assert float(out[0][1][1]) == 0.0  # dropless: nothing dropped


def test_compact_explicit_equals_auto():
  ex, _ = run({"expert": 2, "fsdp": 2}, "explicit", **COMPACT)
  au, _ = run({"expert": 2, "fsdp": 2}, "auto", **COMPACT)
  diffs = _rel_diffs(_as_ep(ex), _as_ep(au))
  assert max(diffs.values()) <= TOL, diffs


# --- drops: expert=4, one row of T tokens per device, E_l = 2 experts each ----------------------------------------

EP = 4
E_L = E // EP
SLOTS = T * K  # routed slots per device


def _factor(c: int, ep: int = EP) -> float:
  """An ep_buffer_factor whose capacity is exactly c rows of a device's SLOTS x EP / ep slots over ep peers
  (ceil((c - 0.5) x ep / slots x slots / ep) = c)."""
  return (c - 0.5) * ep / (SLOTS * EP // ep)


@functools.lru_cache(maxsize=None)
def forward(factor: float):
  """(y, dropped fraction, ids) of the layer's forward on expert=4 with the buffer factor."""
  x, p = _inputs()
  mesh = _mesh({"expert": EP}, "explicit")
  with jax.set_mesh(mesh):
    ps, xs = _placed(mesh, p, x)
    y, side = jax.jit(lambda p, x: moe.moe_mlp(p, x, CTX, *_settings(ep_impl="compact", ep_buffer_factor=factor)))(
        ps, xs)
  return np.asarray(y), float(side[moe.DROPPED]), np.asarray(side["moe_expert_ids"])


def numpy_drops(ids_BTk: np.ndarray, C: int, ep: int = EP) -> list[tuple[int, int]]:
  """The (sender, flat slot) pairs the compact dispatch drops: the batch split over ep devices, each sorts its
  slots ([B / ep, T, k] flattened) by expert id (stable), and each destination d = id // E_l keeps its first C."""
  out = []
  for s, flat in enumerate(ids_BTk.reshape(ep, -1)):
    order = np.argsort(flat, kind="stable")
    for d in range(ep):
      mine = [a for a in order if flat[a] // (E // ep) == d]
      out += [(s, a) for a in mine[C:]]
  return out


def _counts(ids_BTk: np.ndarray) -> np.ndarray:
  """[rows, EP]: each device's slots per destination."""
  return np.stack([np.bincount(ids_BTk[b].reshape(-1) // E_L, minlength=EP) for b in range(ids_BTk.shape[0])])


def test_capacity():
  assert moe.capacity(SLOTS, EP, None) == SLOTS  # dropless: the worst case
  assert moe.capacity(SLOTS, EP, 1.0) == -(-SLOTS // EP)
  assert moe.capacity(SLOTS, EP, 100.0) == SLOTS  # never more than every slot
  assert [moe.capacity(SLOTS, EP, _factor(c)) for c in (1, 4, 9)] == [1, 4, 9]


def test_drop_count_equals_numpy_and_one_row_short_drops_exactly_the_last_rows(unsharded):
  x, p = _inputs()
  _, w, ids = moe.route(x.reshape(-1, D) @ p["router"], K, True)
  ids = np.asarray(ids).reshape(B, T, K)
  y_all = np.asarray(unsharded[B][0][1])
  counts = _counts(ids)
  c0 = int(counts.max())
  assert c0 > -(-SLOTS // EP) + 1 and counts.min() < c0  # skewed: one destination is hot
  # One row short of the fullest pair: each fullest (device, destination) pair drops its last slot in expert
  # order, nothing else.
  y_short, dropped, ids_short = forward(_factor(c0 - 1))
  np.testing.assert_array_equal(ids_short, ids)
  lost = numpy_drops(ids, c0 - 1)
  assert len(lost) == int(np.sum(counts == c0)) >= 1
  assert dropped == np.float32(len(lost) / ids.size)
  w_kept = np.asarray(w).reshape(B, T * K).copy()
  for b, a in lost:
    w_kept[b, a] = 0.0
  want, _ = moe.dispatch(x.reshape(-1, D), ids.reshape(-1, K), jnp.asarray(w_kept.reshape(-1, K)), p["gate"],
                         p["up"], p["down"], *settings(E, K))
  np.testing.assert_allclose(y_short, np.asarray(want).reshape(y_short.shape), rtol=0, atol=1e-5)
  assert np.max(np.abs(y_short - y_all)) > 1e-2  # control: the dropped slots change y
  # A balanced buffer (factor 1.0) on the skewed routing drops many: the NumPy count of the slots past C.
  C = moe.capacity(SLOTS, EP, 1.0)
  _, dropped, _ = forward(1.0)
  assert len(numpy_drops(ids, C)) == np.maximum(counts - C, 0).sum() > 0.1 * ids.size
  assert dropped == np.float32(np.maximum(counts - C, 0).sum() / ids.size)


# --- drops with gradients: expert=2, the batch split over it (2 rows per device), E_l = 4 experts each -------------

EP2 = 2
NAMES = ("loss", "y", "d_x", "d_w", "d_gate", "d_up", "d_down")


def _weighted(y):
  return jnp.sum(jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape) * y) / y.shape[0]


def _grads(f):
  """value_and_grad of f(x, w, gate, up, down, *rest) -> (loss, aux) w.r.t. x, the routing weights and the kernels."""
  return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True)


@jax.jit
@_grads
def masked_dispatch(x, w, gate, up, down, ids, mask):
  """The unsharded dropless dispatch with the routing weights times mask (0 at the slots to drop)."""
  y, _ = moe.dispatch(x.reshape(-1, D), ids.reshape(-1, K), (w * mask).reshape(-1, K), gate, up, down,
                      *settings(E, K))
  y = y.reshape(x.shape)
  return _weighted(y), y


def compact_on_expert2(c: int, x, w, ids, p):
  """((loss, (y, dropped)), grads) of the layer's compact dispatch (layer._experts_dropless, routing given) on
  expert=2 with a buffer of c rows per peer."""
  s = _settings(ep_impl="compact", ep_buffer_factor=_factor(c, EP2))

  def f(x, w, gate, up, down, ids):
    y, dropped = layer._experts_dropless({"gate": gate, "up": up, "down": down}, x, ids, w, *s)
    return _weighted(y), (y, dropped)
  mesh = _mesh({"expert": EP2}, "explicit")
  with jax.set_mesh(mesh):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
    args = [put(x, ("batch", "length", "act_embed")), put(w, moe.TOKENS)]
    args += [put(p[n], SPEC[n].axes) for n in ("gate", "up", "down")] + [put(ids, moe.TOKENS)]
    return jax.device_get(jax.jit(_grads(f))(*args))


def _leaf_diffs(out, ref) -> dict:
  """max |diff| / max(1, max |ref|) per leaf, as test_moe_ep's _rel_diffs."""
  (loss, (y, _)), grads = out
  (rloss, ry), rgrads = ref
  return {n: float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, float(np.max(np.abs(b)))))
          for n, a, b in zip(NAMES, (loss, y, *grads), (rloss, ry, *rgrads))}


def test_compact_drops_equal_the_dispatch_without_the_dropped_slots_forward_and_gradients():
  x, p = _inputs()
  _, w, ids = moe.route(x @ p["router"], K, True)  # [B, T, k] each
  ids_np = np.asarray(ids)
  counts = np.stack([np.bincount(f // (E // EP2), minlength=EP2) for f in ids_np.reshape(EP2, -1)])
  # Two below the second-hottest pair's count: both senders drop, and each cut falls inside one expert's slots
  # (ranks C - 1 and C of the hot destination's sorted slots share an expert), so the stable order decides which.
  C = int(np.sort(counts, axis=None)[-2]) - 2
  assert (counts.max(axis=1) > C).all(), (counts, C)
  hot = [np.sort(f[f // (E // EP2) == d]) for f, d in zip(ids_np.reshape(EP2, -1), counts.argmax(axis=1))]
  assert all(h[C - 1] == h[C] for h in hot), (hot, C)
  out = compact_on_expert2(C, x, w, ids, p)
  lost = numpy_drops(ids_np, C, EP2)
  assert int(out[0][1][1].sum()) == len(lost) == int(np.maximum(counts - C, 0).sum())

  def mask_of(drops):
    m = np.ones((EP2, B * T * K // EP2), np.float32)
    for s_, a in drops:
      m[s_, a] = 0.0
    return jnp.asarray(m.reshape(w.shape))
  ref = masked_dispatch(x, w, p["gate"], p["up"], p["down"], ids, mask_of(lost))
  diffs = _leaf_diffs(out, ref)
  print(C, counts.tolist(), len(lost), diffs)
  assert max(diffs.values()) <= TOL, diffs
  d_w = np.asarray(out[1][1]).reshape(EP2, -1)
  assert all(d_w[s_, a] == 0.0 for s_, a in lost)  # a dropped slot's weight gets no gradient
  # Control: one different slot dropped (the last kept slot of a pair that drops instead of its first dropped
  # one, the neighbour in expert order) fails the same check.
  s0, a0 = lost[0]
  flat = ids_np.reshape(EP2, -1)[s0]
  kept = [a for a in np.argsort(flat, kind="stable") if flat[a] // (E // EP2) == flat[a0] // (E // EP2)][C - 1]
  wrong = [(s0, kept)] + lost[1:]
  bad = _leaf_diffs(out, masked_dispatch(x, w, p["gate"], p["up"], p["down"], ids, mask_of(wrong)))
  print(bad)
  assert min(bad[n] for n in ("y", "d_x", "d_w", "d_gate", "d_up", "d_down")) > 100 * TOL, bad


# --- the census: no group tokens gathered, only all-to-alls -------------------------------------------------------

def _moved(hlo: str) -> dict[str, list[str]]:
  """Per collective kind, the result shapes of the calls inside the MoE layer's scope."""
  counts, _ = hlo_counts(hlo)
  return {kind: [c["shape"] for c in v["calls"] if moe.SCOPE in c["scope"]]
          for kind, v in counts["collectives"].items()}


def _token_rows(shapes: list[str]) -> list[str]:
  """The shapes of token rows: [.., T, D] activations or [.., T, k] ids and weights."""
  return [s for s in shapes if f",{T},{D}]" in s or f",{T},{K}]" in s]


def test_census_has_no_token_gather_under_compact():
  moved = _moved(run({"expert": 2, "fsdp": 2}, "explicit", **COMPACT)[1])
  print(moved)
  assert not _token_rows(moved["all-gather"]) and not _token_rows(moved["reduce-scatter"]), moved
  assert len(moved["all-to-all"]) >= 3, moved  # x and the ids out, y back (and their transposes)
  # Control: the gather dispatch (its forward) all-gathers the group's tokens and reduce-scatters its outputs.
  x, p = _inputs()
  mesh = _mesh({"expert": 2, "fsdp": 2}, "explicit")
  with jax.set_mesh(mesh):
    ps, xs = _placed(mesh, p, x)
    gather = _moved(jax.jit(lambda p, x: moe.moe_mlp(p, x, CTX, *_settings())[0]).lower(ps, xs).compile().as_text())
  assert _token_rows(gather["all-gather"]) and _token_rows(gather["reduce-scatter"]), gather
  assert not gather["all-to-all"], gather


# --- the metrics and the config ----------------------------------------------------------------------------------

def _cfg(*keys):
  return load_config("model=mixtral-tiny", "model.num_layers=2", *keys)


def test_drop_metrics_are_logged_under_compact_only():
  assert not resolve(_cfg()).metrics
  cfg = _cfg("model.parts.moe.ep_impl=compact", "model.parts.moe.ep_buffer_factor=1.5")
  assert set(resolve(cfg).metrics) == {"moe_dropped", "moe_dropped_max"}
  side = {moe.DROPPED: jnp.asarray([0.1, 0.3], jnp.float32), "moe_load_balance_loss": jnp.zeros(2),
          "moe_z_loss": jnp.zeros(2)}
  extra, metrics = part_losses(cfg, side, jnp.float32(0.25))
  assert float(extra) == 0.0  # never in the loss
  # The mean over the layers is token-weighted (micro-batches sum to the batch's); the max is not (METRIC_REDUCE).
  np.testing.assert_allclose([float(metrics["moe_dropped"]), float(metrics["moe_dropped_max"])], [0.05, 0.3],
                             rtol=1e-6)
  text = part_metrics_text(cfg)({"loss": 1.0, "moe_dropped": 0.05, "moe_dropped_max": 0.3})
  assert text == "moe_dropped 0.05  moe_dropped_max 0.3"
  assert part_metrics_text(_cfg()) is None


def test_config_refusals():
  with pytest.raises(ConfigError, match=r"^model\.parts\.moe\.ep_buffer_factor: 2\.0: only ep_impl=compact reads"):
    resolve(_cfg("model.parts.moe.ep_buffer_factor=2"))
  with pytest.raises(ConfigError, match=r"^model\.parts\.moe\.ep_impl: "):
    resolve(_cfg("model.parts.moe.ep_impl=ring"))
  with pytest.raises(ConfigError, match=r"^model\.parts\.moe\.ep_buffer_factor: "):
    resolve(_cfg("model.parts.moe.ep_impl=compact", "model.parts.moe.ep_buffer_factor=0"))
