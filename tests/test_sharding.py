"""Logical axes -> mesh axes, constrain() under both modes, where parameters land, odd shapes."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from meshlm.config import load_config
from meshlm.models import forward, init_params, param_specs
from meshlm import spec as S
from meshlm.parallel import RULES, constrain, is_explicit, logical_spec, make_mesh, out_sharding
from meshlm.parallel.sharding import axes

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "src/meshlm/config/presets").glob("*.yaml"))


def mesh_of(*overrides: str, devices: int = 4):
  return make_mesh(load_config(f"cpu_devices={devices}", *overrides))


def assert_sharded(x: jax.Array, mesh, spec: P) -> None:
  """x's sharding places data exactly as spec on mesh (trailing Nones do not matter)."""
  assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding, spec)


# --- the rule table ----------------------------------------------------------------------------

def test_mesh_axes_and_types():
  for mode, kind in (("explicit", AxisType.Explicit), ("auto", AxisType.Auto)):
    mesh = mesh_of("mesh.data=2", "mesh.fsdp=2", f"shard_mode={mode}")
    assert mesh.axis_names == ("data", "fsdp", "tensor", "expert", "context")
    assert tuple(mesh.axis_sizes) == (2, 2, 1, 1, 1)
    assert all(t == kind for t in mesh.axis_types)
    assert list(mesh.devices.flat) == jax.devices()[:4]


def test_logical_spec_maps_through_the_rules():
  mesh = mesh_of("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", devices=8)
  assert logical_spec(("batch", "length", "act_embed"), (8, 16, 32), mesh) == P(("data", "fsdp"), None, None)
  assert logical_spec(("embed", "vocab"), (32, 64), mesh) == P("fsdp", "tensor")
  assert logical_spec(("embed", "heads", "head_dim"), (32, 4, 8), mesh) == P("fsdp", "tensor", None)
  assert logical_spec(("layers", "mlp", "embed"), (2, 48, 32), mesh) == P(None, "tensor", "fsdp")
  assert logical_spec((None, "vocab"), (3, 64), mesh) == P(None, "tensor")


def test_logical_spec_drops_axes_that_do_not_divide():
  mesh = mesh_of("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", devices=8)
  # A batch of 2 keeps the longest dividing prefix of (data, fsdp); a batch of 1 stays whole.
  assert logical_spec(("batch", "length"), (2, 16), mesh) == P("data", None)
  assert logical_spec(("batch", "length"), (1, 16), mesh) == P(None, None)
  assert logical_spec(("batch", "length"), (6, 16), mesh) == P("data", None)
  # An odd vocab, or a single KV head, under tensor=2.
  assert logical_spec(("embed", "vocab"), (32, 257), mesh) == P("fsdp", None)
  assert logical_spec(("embed", "kv_heads", "head_dim"), (32, 1, 8), mesh) == P("fsdp", None, None)
  assert logical_spec(("embed",), (3,), mesh) == P(None)
  # Without a shape nothing is dropped but size-1 mesh axes.
  assert logical_spec(("batch", "vocab"), None, mesh) == P(("data", "fsdp"), "tensor")


def test_logical_spec_drops_size_one_axes_and_never_reuses_a_mesh_axis():
  mesh = mesh_of("mesh.fsdp=4")
  assert logical_spec(("batch", "vocab"), (8, 64), mesh) == P("fsdp", None)  # tensor has size 1
  # batch takes fsdp first; embed may not shard on it again.
  assert logical_spec(("batch", "embed"), (8, 32), mesh) == P("fsdp", None)


def test_logical_spec_without_a_mesh_and_unknown_axes():
  """No mesh: no sharding, but an unknown name fails as it does on a mesh (an inline tuple in a part is checked
  in a one-device run too)."""
  assert logical_spec(("batch", "embed"), (8, 32)) == P()
  for mesh in (None, mesh_of("mesh.fsdp=4")):
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
      logical_spec(("hidden",), (8,), mesh)


def test_a_misspelt_axis_fails_where_it_is_declared():
  """Negative controls: a ParamSpec (directly or through a builder), a StateLeaf and an activation axes tuple with a name the
  rules lack each raise at construction, with no mesh, naming the axis and the known names."""
  with pytest.raises(ValueError, match=r"unknown logical axis 'kv_head'; known: .*kv_heads"):
    S.ParamSpec((4, 2), ("embed", "kv_head"))
  with pytest.raises(ValueError, match=r"unknown logical axis 'mpl'"):
    S.kernel((4, 8), ("embed", "mpl"))
  with pytest.raises(ValueError, match=r"unknown logical axis 'lenght'; known: .*length"):
    axes("batch", "lenght", None)
  assert axes("batch", "length", None) == ("batch", "length", None)
  assert S.ParamSpec((4, 2), ("embed", None)).axes == ("embed", None)
  from meshlm.models.family import StateLeaf
  with pytest.raises(ValueError, match=r"StateLeaf axes .*unknown logical axis 'kv_head'"):
    StateLeaf((2, 4, 8), ("batch", "kv_head", None))
  assert StateLeaf((2, 4, 8), ("batch", "kv_heads", None)).axes == ("batch", "kv_heads", None)


def test_the_rules_name_the_known_axes():
  """spec.LOGICAL_AXES (what a ParamSpec checks, below parallel/) is the rule table's set of names."""
  assert set(RULES) == S.LOGICAL_AXES


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_declares_known_axes(preset):
  """Every preset's parameter specs build (each ParamSpec checks its axes), real sizes included: no arrays."""
  specs = param_specs(load_config(f"model={preset}"))
  names = {a for s in jax.tree.leaves(specs, is_leaf=S.is_spec) for a in s.axes}
  assert names - {None} <= S.LOGICAL_AXES and "embed" in names


def test_mode_switches():
  assert not is_explicit() and out_sharding(("batch",), (8,)) is None
  with jax.set_mesh(mesh_of("mesh.fsdp=4")):
    assert is_explicit() and out_sharding(("batch", "length"), (8, 4)) == P("fsdp", None)
  with jax.set_mesh(mesh_of("mesh.fsdp=4", "shard_mode=auto")):
    assert not is_explicit() and out_sharding(("batch", "length"), (8, 4)) is None


# --- constrain ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_constrain_places_values_unchanged(mode):
  mesh = mesh_of("mesh.fsdp=2", "mesh.tensor=2", f"shard_mode={mode}")
  x = np.arange(8 * 6 * 4, dtype=np.float32).reshape(8, 6, 4)
  with jax.set_mesh(mesh):
    f = jax.jit(lambda a: constrain(a * 2.0, ("batch", "vocab", None)))
    y = f(jax.device_put(x, NamedSharding(mesh, P())))
    if mode == "explicit":
      # Under explicit the sharding is part of the type, visible while tracing.
      typed = jax.eval_shape(f, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())))
      assert typed.sharding.spec == P("fsdp", "tensor", None)
  np.testing.assert_array_equal(np.asarray(y), x * 2.0)
  assert_sharded(y, mesh, P("fsdp", "tensor", None))
  # The dimension tensor=2 cannot divide (3) stays whole.
  with jax.set_mesh(mesh):
    z = jax.jit(lambda a: constrain(a, ("batch", "vocab", None)))(jnp.ones((8, 3, 4)))
  assert_sharded(z, mesh, P("fsdp", None, None))


def test_constrain_without_a_mesh_is_the_identity():
  x = jnp.arange(6.0)
  assert constrain(x, ("batch",)) is x


def test_constrain_under_explicit_is_a_reshard_under_auto_a_constraint():
  for mode, primitive in (("explicit", "reshard"), ("auto", "sharding_constraint")):
    with jax.set_mesh(mesh_of("mesh.fsdp=4", f"shard_mode={mode}")):
      jaxpr = str(jax.make_jaxpr(lambda a: constrain(a, ("batch",)))(jnp.ones(8)))
    assert primitive in jaxpr, (mode, jaxpr)


# --- parameters and forward on a mesh ----------------------------------------------------------

@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("mesh_args", [("mesh.fsdp=4",), ("mesh.fsdp=2", "mesh.tensor=2"),
                                       ("mesh.data=2", "mesh.fsdp=2")])
def test_params_land_on_their_declared_shardings(mode, mesh_args):
  cfg = load_config("cpu_devices=4", *mesh_args, f"shard_mode={mode}")
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  specs = param_specs(cfg)
  for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(specs, is_leaf=S.is_spec)):
    want = NamedSharding(mesh, logical_spec(spec.axes, spec.shape, mesh))
    assert leaf.shape == spec.shape, path
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (jax.tree_util.keystr(path), leaf.sharding, want)
  # Spot checks against the rule table: FSDP shards the embed dim, tensor the vocab / heads / mlp.
  tensor = "tensor" if "mesh.tensor=2" in mesh_args else None
  assert_sharded(params["lm_head"], mesh, P("fsdp", tensor))
  assert_sharded(params["layers"]["dense"]["mlp"]["down"], mesh, P(None, tensor, "fsdp"))
  assert_sharded(params["layers"]["dense"]["attn"]["q"], mesh, P(None, "fsdp", tensor, None))
  assert_sharded(params["final_norm"], mesh, P(None))


@pytest.fixture(scope="module")
def tiny_params():
  cfg = load_config("train.compute_dtype=float32")
  return cfg, jax.device_get(init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope="module")
def batch_of_one(tiny_params):
  """(tokens, the unsharded forward's logits): the reference, computed once for both modes."""
  ref_cfg, host_params = tiny_params
  toks = np.random.default_rng(0).integers(0, 512, (1, 24)).astype(np.int32)
  return toks, np.asarray(jax.jit(lambda p, t: forward(ref_cfg, p, t))(host_params, toks))


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_batch_of_one_under_fsdp4(batch_of_one, mode):
  """A batch of 1 cannot shard over fsdp=4: it stays whole and the forward still matches."""
  toks, ref = batch_of_one
  cfg = load_config("cpu_devices=4", "mesh.fsdp=4", f"shard_mode={mode}", "train.compute_dtype=float32")
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda p, t: forward(cfg, p, t))(params, jnp.asarray(toks))
  assert logits.shape == (1, 24, 512)
  np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-5)


def test_odd_shapes_under_tensor_parallelism(tiny_params):
  """One KV head, an odd vocab and a batch of 3 under data=2, tensor=2: nothing divides, all works."""
  overrides = ("model.num_kv_heads=1", "model.vocab_size=259", "train.compute_dtype=float32")
  ref_cfg = load_config(*overrides)
  toks = np.random.default_rng(1).integers(0, 259, (3, 8)).astype(np.int32)
  host = jax.device_get(init_params(ref_cfg, jax.random.key(0)))
  ref = np.asarray(jax.jit(lambda p, t: forward(ref_cfg, p, t))(host, toks))
  cfg = load_config("cpu_devices=4", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", *overrides)
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  assert_sharded(params["layers"]["dense"]["attn"]["k"], mesh, P())
  assert_sharded(params["lm_head"], mesh, P())
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda p, t: forward(cfg, p, t))(params, jnp.asarray(toks))
  np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-5)


def test_rule_derived_sets_follow_the_rules():
  """gather_once's FSDP axes and expert parallelism's mesh axis are read from RULES: a new fsdp-sharded
  logical axis, or the experts moved to another mesh axis, needs no second edit. Controls: an axis that FSDP
  does not shard, and the hand copy the FSDP set once was, are not the derived set."""
  from meshlm.nn import gather_once as GO
  from meshlm.nn.moe import expert_parallel as EP
  assert GO.FSDP_AXES == {"embed", "experts_fsdp", "mlp_fsdp"} == GO.fsdp_axes(RULES)
  assert "batch" not in GO.FSDP_AXES  # an activation axis: never a gathered kernel's
  assert GO.fsdp_axes(dict(RULES, rows_fsdp=("tensor", "fsdp"))) == GO.FSDP_AXES | {"rows_fsdp"}
  assert GO.fsdp_axes(dict(RULES, rows=("tensor",))) == GO.FSDP_AXES  # control: not fsdp-sharded
  assert GO.FSDP_AXES != {"embed"}  # control: the old hand copy
  assert EP.EXPERT_AXIS == "expert" == EP.expert_axis(RULES)
  assert EP.expert_axis(dict(RULES, experts=("data",))) == "data"
  # gather_once leaves whole only what fsdp shards alone; a mixed axis would gather expert/tensor too.
  assert GO.gathered_axes(("layers", "embed", "heads")) == ("layers", None, "heads")
  with pytest.raises(ValueError, match="experts_fsdp"):
    GO.gathered_axes(("layers", "experts_fsdp", "embed"))
