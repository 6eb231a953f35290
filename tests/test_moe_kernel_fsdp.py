"""model.parts.moe.kernel_fsdp: what mesh.fsdp shards in the expert kernels (nn/moe/ moe_spec, dispatch_gather).

- On fsdp=4 under explicit and auto, the MoE layer's loss, output and every gradient (float32) with
  `experts` (the experts dim on fsdp: the tokens travel, expert-parallel dispatch over fsdp), `embed`
  and `mlp` (kernels gathered) each equal the unsharded layer within TOL; a wrong expert-to-shard mapping
  fails the same check (the compiled `experts` layer run with its kernels' shards rotated).
- expert=2 x fsdp=2 with `experts`: the experts dim on ("expert", "fsdp"), the layer equals the unsharded
  one, with the batch split over both axes and over fsdp only (gather over fsdp, psum over expert); a
  local-expert offset taken in the other axis order (fsdp major) fails it.
- The stored shardings of each layout, null's resolution (experts; embed when mesh.expert x mesh.fsdp
  does not divide the experts, with no ShardingWarning), and `experts` refused there (one ConfigError).
- The compiled layer under `experts` all-gathers and reduce-scatters no expert kernel (`embed` does:
  control), counted with the census's HLO collectives.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from meshlm.analysis.census import hlo_counts
from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.models import registry
from meshlm.models.params import param_shardings
from meshlm.models.model import resolve
from meshlm.models.ffns.moe import knobs
from meshlm.nn import moe
from meshlm.nn.moe import expert_parallel
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import ShardingWarning, logical_spec

from test_moe_ep import CTX, B, D, E, F, K, TOL, _inputs, _loss, _rel_diffs
from moe_helpers import settings

LAYOUTS = ("experts", "embed", "mlp")


def _layer(layout):
  def f(p, x):
    y, side = moe.moe_mlp(p, x, CTX, *settings(E, K, norm_topk_prob=True,
                                                     kernel_fsdp=layout))
    return _loss(y, side), y
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


def _mesh(axes: dict, mode: str):
  n = int(np.prod(list(axes.values())))
  return make_mesh(load_config("model=mixtral-tiny", f"cpu_devices={n}", "mesh.fsdp=1",
                               *(f"mesh.{a}={s}" for a, s in axes.items()), f"shard_mode={mode}"))


def run(axes: dict, mode: str, layout: str, rows: int = B):
  """(outputs, the gradients' PartitionSpecs, compiled HLO text, a rerun) of the layer's value_and_grad,
  the params placed as moe_spec lays them out for `layout` and x as the model places activations.
  rerun(permutation) runs the same executable with the experts of gate, up and down permuted."""
  x, p = _inputs()
  spec = moe.moe_spec(D, E, F, layout)
  mesh = _mesh(axes, mode)
  with jax.set_mesh(mesh):
    put = lambda a, names: jax.device_put(a, NamedSharding(mesh, logical_spec(names, a.shape, mesh)))  # noqa: E731
    ps = {k: put(v, spec[k].axes) for k, v in p.items()}
    xs = put(x[:rows], ("batch", "length", "act_embed"))
    compiled = jax.jit(_layer(layout)).lower(ps, xs).compile()
    out = compiled(ps, xs)
    shardings = {k: v.sharding.spec for k, v in out[1][0].items()}

  def rerun(perm):
    with jax.set_mesh(mesh):
      return compiled({k: v if k == "router" else put(v[np.asarray(perm)], spec[k].axes) for k, v in p.items()}, xs)
  return out, shardings, compiled.as_text(), rerun


_runs: dict = {}


def cached(axes: dict, mode: str, layout: str, rows: int = B):
  key = (tuple(sorted(axes.items())), mode, layout, rows)
  if key not in _runs:
    _runs[key] = run(axes, mode, layout, rows)
  return _runs[key]


@pytest.fixture(scope="module")
def unsharded():
  x, p = _inputs()
  f = jax.jit(_layer("embed"))  # no mesh: the layout names change nothing
  return {rows: f(p, x[:rows]) for rows in (B, 2)}


FSDP4 = {"fsdp": 4}
EP_FSDP = {"expert": 2, "fsdp": 2}


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_layouts_agree_on_fsdp4(unsharded, mode):
  diffs = {layout: _rel_diffs(cached(FSDP4, mode, layout)[0], unsharded[B]) for layout in LAYOUTS}
  print(mode, {layout: max(d.values()) for layout, d in diffs.items()})
  for layout, d in diffs.items():
    assert set(d) == {"loss", "y", "d_x", "d_router", "d_gate", "d_up", "d_down"}
    assert max(d.values()) <= TOL, (layout, d)
  # The layouts against each other, leaf by leaf (the EP path adds each token's k slots across devices).
  (_, y_ex), (g_ex, gx_ex) = cached(FSDP4, mode, "experts")[0]
  for layout in ("embed", "mlp"):
    (_, y), (g, gx) = cached(FSDP4, mode, layout)[0]
    for a, b in [(y_ex, y), (gx_ex, gx)] + [(g_ex[k], g[k]) for k in g]:
      np.testing.assert_allclose(a, b, rtol=0, atol=TOL * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_the_kernel_gradients_keep_their_layout():
  _, sh, _, _ = cached(FSDP4, "explicit", "experts")
  for k in ("gate", "up", "down"):
    assert tuple(sh[k])[:2] == ("fsdp", None), (k, sh[k])
  _, sh, _, _ = cached(FSDP4, "explicit", "mlp")
  assert tuple(sh["down"])[:3] == (None, "fsdp", None) and tuple(sh["gate"])[:2] == (None, "fsdp"), sh
  _, sh, _, _ = cached(EP_FSDP, "explicit", "experts")
  for k in ("gate", "up", "down"):
    assert tuple(sh[k])[:2] == (("expert", "fsdp"), None), (k, sh[k])


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_a_wrong_expert_to_shard_mapping_fails(unsharded, mode):
  """Negative control: the same compiled `experts` layer on fsdp=4 with the kernels' shards rotated by one
  (each device computing its neighbour's expert ids with its own kernels, as a wrong offset would)."""
  out = cached(FSDP4, mode, "experts")[3](np.roll(np.arange(E), E // 4))
  diffs = _rel_diffs(out, unsharded[B])
  print("rotated shards:", diffs)
  assert diffs["y"] > 1e-2 and diffs["d_gate"] > 1e-2 and diffs["d_x"] > 1e-2


@pytest.mark.parametrize("rows", [B, 2])  # B splits over fsdp x expert; 2 over fsdp only (psum over expert)
def test_experts_over_expert_and_fsdp_equal_one_device(unsharded, rows):
  out, _, _, _ = cached(EP_FSDP, "explicit", "experts", rows)
  diffs = _rel_diffs(out, unsharded[rows])
  print("expert=2 x fsdp=2, rows", rows, diffs)
  assert max(diffs.values()) <= TOL, diffs


def test_the_offset_follows_the_specs_axis_order(unsharded, monkeypatch):
  """Negative control: the experts dim is on ("expert", "fsdp"), expert major; an offset from the
  fsdp-major linear index gives the two middle devices each other's experts."""
  real = expert_parallel.local_expert_offset
  monkeypatch.setattr(expert_parallel, "local_expert_offset", lambda n, axes: real(n, axes[::-1]))
  try:
    out, _, _, _ = run(EP_FSDP, "explicit", "experts")
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  diffs = _rel_diffs(out, unsharded[B])
  print("fsdp-major offset:", diffs)
  assert diffs["y"] > 1e-2 and diffs["d_gate"] > 1e-2


# --- the stored shardings and null's resolution ---------------------------------------------------------

def _specs(layout, mesh_shape: dict, experts: int = E) -> dict:
  mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape), axis_types=(AxisType.Explicit,) * len(mesh_shape))
  spec = moe.moe_spec(D, experts, F, layout)
  return {k: tuple(logical_spec(s.axes, s.shape, mesh)) + (None,) * (3 - len(s.shape)) for k, s in spec.items()}


def test_stored_shardings_per_layout():
  fsdp4 = {"fsdp": 4}
  for layout in ("experts", None):
    assert _specs(layout, fsdp4) | {"router": None} == {
        "gate": ("fsdp", None, None), "up": ("fsdp", None, None), "down": ("fsdp", None, None), "router": None}
  assert _specs("embed", fsdp4)["gate"] == (None, "fsdp", None) and _specs("embed", fsdp4)["down"] == (None, None, "fsdp")
  assert _specs("mlp", fsdp4)["gate"] == (None, "fsdp", None) and _specs("mlp", fsdp4)["down"] == (None, "fsdp", None)
  # With mesh.expert: experts over both axes, expert major; embed keeps today's EP layout.
  both = {"expert": 2, "fsdp": 2}
  assert _specs("experts", both)["down"] == (("expert", "fsdp"), None, None)
  assert _specs("embed", both)["down"] == ("expert", None, "fsdp")
  assert _specs("mlp", both)["down"] == ("expert", "fsdp", None)


def test_null_falls_back_to_embed_quietly():
  """4 experts on fsdp=8 (and 8 on expert=2 x fsdp=8): fsdp drops off the experts dim and shards embed,
  as the embed layout does, with no ShardingWarning."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", ShardingWarning)
    assert _specs(None, {"fsdp": 8}, experts=4) == _specs("embed", {"fsdp": 8}, experts=4)
    assert _specs(None, {"fsdp": 8}, experts=4)["gate"] == (None, "fsdp", None)
    assert _specs(None, {"expert": 2, "fsdp": 8})["down"] == ("expert", None, "fsdp")


def test_the_model_stores_each_layout():
  """The whole model (mixtral-tiny, stacked layers) through param_shardings on fsdp=4; null resolves
  by layout_for: experts at issue 19's geometry (1 row of 128 tokens per device, experts of width 512),
  embed for the preset's 8 rows per device."""
  def down(layout, *extra):
    cfg = load_config("model=mixtral-tiny", "cpu_devices=4", "mesh.fsdp=4", "model.parts.moe.num_experts=8", *extra,
                      *([] if layout is None else [f"model.parts.moe.kernel_fsdp={layout}"]))
    sh = param_shardings(cfg, make_mesh(cfg))
    [moe_p] = [v for v in sh["layers"].values() if "moe" in v]
    return tuple(moe_p["moe"]["down"].spec), tuple(moe_p["moe"]["gate"].spec)
  few = ("train.per_device_batch_size=1", "model.parts.moe.mlp_dim=512")
  assert down(None, *few) == down("experts") == ((None, "fsdp", None, None), (None, "fsdp", None, None))
  assert down(None) == down("embed") == ((None, None, None, "fsdp"), (None, None, "fsdp", None))
  assert down("mlp") == ((None, None, "fsdp", None), (None, None, "fsdp", None))


def test_null_layout_compares_the_dispatch_rows_with_the_kernels():
  """layout_for: experts while ep x rows x k x (D + 2F) <= 3 E D F, embed past it; embed where the fsdp
  size is not known from the config. The config as loaded keeps null; the model resolves it (registry.resolved)."""
  base = ("model=mixtral-tiny", "model.parts.moe.num_experts=8", "model.embed_dim=64", "model.parts.moe.mlp_dim=64",
          "model.num_heads=2", "model.num_kv_heads=2", "train.seq_len=16", "cpu_devices=4", "mesh.fsdp=4")
  kernels = 3 * 8 * 64 * 64  # 98,304; one row of 16 tokens x k=2 x (64 + 128) x ep=4 = 24,576 per sequence
  assert 4 * 4 * 16 * 2 * (64 + 2 * 64) == kernels
  layout = lambda *o: knobs(registry.validate(load_config(*o)).model).kernel_fsdp  # noqa: E731
  assert layout(*base, "train.per_device_batch_size=4") == "experts"  # equal: experts
  assert layout(*base, "train.per_device_batch_size=5") == "embed"
  assert layout(*base, "train.per_device_batch_size=8", "train.micro_batches=2") == "experts"
  assert layout("model=mixtral-tiny") == "embed"  # mesh.fsdp=-1, no cpu_devices
  assert layout(*base, "train.per_device_batch_size=5", "model.parts.moe.kernel_fsdp=experts") == "experts"  # set
  assert knobs(load_config(*base, "train.per_device_batch_size=4").model).kernel_fsdp is None  # not yet resolved
  assert knobs(resolve(load_config(*base, "train.per_device_batch_size=4")).m).kernel_fsdp == "experts"


def test_experts_refused_where_it_cannot_shard():
  cfg = load_config("model=mixtral-tiny", "model.parts.moe.kernel_fsdp=experts")  # 4 experts
  with pytest.raises(ConfigError, match=r"model.parts.moe.kernel_fsdp=experts: mesh.expert x mesh.fsdp = 1 x 8 does "
                                        r"not divide model.parts.moe.num_experts=4"):
    registry.check_mesh(cfg, {"expert": 1, "fsdp": 8})
  registry.check_mesh(cfg, {"expert": 1, "fsdp": 4})
  registry.check_mesh(load_config("model=mixtral-tiny"), {"expert": 1, "fsdp": 8})  # null falls back
  with pytest.raises(ConfigError, match=r"model.parts.moe.kernel_fsdp=experts: mesh.expert x mesh.fsdp = 1 x 8"):
    registry.validate(load_config("model=mixtral-tiny", "model.parts.moe.kernel_fsdp=experts", "mesh.fsdp=8"))


# --- what the compiled layer moves ----------------------------------------------------------------------

def _kernel_calls(hlo: str, kind: str) -> list[str]:
  """The census's collective calls of `kind` whose result is an expert kernel, whole or a shard of one."""
  calls = hlo_counts(hlo)[0]["collectives"][kind]["calls"]
  kernel = lambda s: any(f"[{e},{a},{b}]" in s for e in (E, E // 2, E // 4) for a, b in ((D, F), (F, D)))  # noqa: E731
  return [c["shape"] for c in calls if kernel(c["shape"])]


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_experts_moves_no_kernel(mode):
  experts = cached(FSDP4, mode, "experts")[2]
  embed = cached(FSDP4, mode, "embed")[2]
  assert not _kernel_calls(experts, "all-gather"), _kernel_calls(experts, "all-gather")
  assert not _kernel_calls(experts, "reduce-scatter") and not _kernel_calls(experts, "all-reduce")
  # Control: embed gathers every expert's kernel whole ([8, 24, 20] from [8, 6, 20]).
  assert any(f"[{E},{D},{F}]" in s for s in _kernel_calls(embed, "all-gather")), _kernel_calls(embed, "all-gather")
  ex = hlo_counts(experts)[0]["collectives"]["all-gather"]["bytes"]
  em = hlo_counts(embed)[0]["collectives"]["all-gather"]["bytes"]
  print(mode, "all-gather bytes: experts", ex, "embed", em)
  assert ex < em
