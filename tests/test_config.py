"""Config: presets, dotted overrides, one-line errors that name the key, tri-state flag resolution."""
import warnings

import pytest
import yaml
from jax.sharding import PartitionSpec as P

from meshlm.config import Config, load_config, parse_overrides, preset_names, to_yaml
from meshlm.errors import ConfigError
from meshlm.parallel.mesh import make_mesh, resolve_mesh_shape

KO_LM = "lm_head_weight_grad_in_kernel_order"
KO_DENSE = "dense_weight_grad_in_kernel_order"


def _error(*overrides: str) -> str:
  with pytest.raises(ConfigError) as info:
    load_config(*overrides)
  msg = str(info.value)
  assert "\n" not in msg, f"error spans lines: {msg!r}"
  return msg


# --- presets and overrides ---------------------------------------------------------------------

def test_presets_exist_and_load():
  names = preset_names()
  for name in ("llama2-tiny", "llama2-7b", "llama3-8b"):
    assert name in names
    cfg = load_config(f"model={name}")
    assert cfg.model_name == name
  assert load_config().model_name == "llama2-tiny"  # the default preset


def named_families(description: str) -> set[str]:
  """The family names a `model family: a, b, ...` description lists."""
  return {name.strip() for name in description.split(":", 1)[1].split(",")}


def test_the_family_key_lists_the_registered_families():
  """models/registry.FAMILIES is the one family list; the schema (config/ sits below models/ and cannot import
  it) gets its family key's description from models/registry.py, so a new family needs no second edit.
  Control: one family more or less is a difference."""
  from meshlm.config.keys import leaf_keys
  from meshlm.models.registry import FAMILIES, family_description
  (key,) = [k for k in leaf_keys() if k.name == "model.family"]
  assert named_families(key.meaning) == set(FAMILIES)
  assert named_families(family_description({**FAMILIES, "mamba": "m"})) == set(FAMILIES) | {"mamba"}
  assert named_families(key.meaning + ", mamba") != set(FAMILIES)


def test_preset_shapes():
  m = load_config("model=llama3-8b").model
  assert (m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim) == (
      128256, 4096, 32, 32, 8, 128, 14336)
  assert m.rope_theta == 500000.0 and not m.tie_embeddings
  m = load_config("model=llama2-7b").model
  assert (m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim) == (
      32000, 4096, 32, 32, 32, 128, 11008)


def test_overrides_parse_yaml_scalars():
  assert parse_overrides(["train.steps=20", "a.b=true", "c=null", "d=1.5", "e=abc", "f=", "g=a=b"]) == [
      ("train.steps", 20), ("a.b", True), ("c", None), ("d", 1.5), ("e", "abc"), ("f", ""), ("g", "a=b")]


def test_overrides_set_nested_fields():
  cfg = load_config("train.steps=7", "train.learning_rate=1e-3", "mesh.fsdp=2", "mesh.tensor=2",
                    "model.num_layers=3", "shard_mode=auto", "train.compute_dtype=float32")
  assert cfg.train.steps == 7 and cfg.train.learning_rate == pytest.approx(1e-3)
  assert cfg.mesh.sizes() == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1, "context": 1}
  assert cfg.model.num_layers == 3 and cfg.shard_mode == "auto" and cfg.train.compute_dtype == "float32"
  # The rest of the preset is untouched.
  assert cfg.model.embed_dim == load_config().model.embed_dim


def test_model_preset_applies_first_wherever_it_appears():
  cfg = load_config("train.steps=5", "model.num_layers=1", "model=llama2-7b")
  assert cfg.model_name == "llama2-7b" and cfg.model.embed_dim == 4096
  assert cfg.train.steps == 5 and cfg.model.num_layers == 1


def test_later_override_wins():
  assert load_config("train.steps=5", "train.steps=9").train.steps == 9


def test_yaml_round_trip_keeps_the_resolved_config():
  cfg = load_config("model.tie_embeddings=true", "mesh.fsdp=2", "train.steps=3")
  text = to_yaml(cfg)
  back = Config.model_validate(yaml.safe_load(text))
  assert back == cfg
  assert yaml.safe_load(text)[KO_LM] is False and yaml.safe_load(text)[KO_DENSE] is True


# --- errors: one line, naming the key ----------------------------------------------------------

HELP_HINT = " (docs/config.md lists every key)"


@pytest.mark.parametrize("overrides, expected", [
    (["train.foo=1"], "train.foo: unknown key"),
    (["foo=1"], "foo: unknown key"),
    (["model.hidden=64"], "model.hidden: unknown key"),
    (["mesh.pipeline=2"], "mesh.pipeline: unknown key"),
])
def test_unknown_key(overrides, expected):
  assert _error(*overrides) == expected + HELP_HINT  # nothing close: no suggestion


@pytest.mark.parametrize("key, near", [
    ("model.embed_dm", "model.embed_dim"),  # a typo: the closest sibling
    ("train.stepz", "train.steps"),
    ("train.learnig_rate", "train.learning_rate"),
    ("checkpoint.load_param_from", "checkpoint.load_params_from"),
    ("shard_mod", "shard_mode"),
    ("train.embed_dim", "model.embed_dim"),  # the right name in the wrong section
    ("mesh.tensr", "mesh.tensor"),
    ("modle", "model"),  # a misspelt section
])
def test_unknown_key_suggests_the_closest_known_one(key, near):
  assert _error(f"{key}=3") == f"{key}: unknown key; did you mean {near}?" + HELP_HINT


def test_suggestions_come_from_the_schema():
  from meshlm.config.keys import leaf_keys, suggest
  names = [k.name for k in leaf_keys()]
  assert len(names) == len(set(names)) and "train.steps" in names and "distributed.timeout_s" in names
  for name in names:  # every key is its own closest match, and a one-letter typo finds it
    assert suggest(name) == name
    twin = any(o != name and o[:-1] == name[:-1] for o in names)  # rl.top_k / rl.top_p: a typo there is ambiguous
    if len(name.rpartition(".")[2]) >= 4 and not twin:  # train.b1 -> train.bx is as near to train.b2
      assert suggest(name[:-1] + ("x" if name[-1] != "x" else "y")) == name, name


@pytest.mark.parametrize("overrides, key, detail", [
    (["train.steps=0"], "train.steps", "greater than 0"),
    (["train.steps=abc"], "train.steps", "'abc'"),
    (["train.learning_rate=-1"], "train.learning_rate", "-1"),
    (["shard_mode=manual"], "shard_mode", "'manual'"),
    (["train.compute_dtype=float16"], "train.compute_dtype", "'float16'"),
    (["weight_grad_impl=fast"], "weight_grad_impl", "'fast'"),
    (["loss_impl=fused"], "loss_impl", "'fused'"),
    (["loss_block=0"], "loss_block", "greater than or equal to 1"),
    (["param_scan_axis=2"], "param_scan_axis", "0 or 1"),
    (["remat=some"], "remat", "'some'"),
    (["cpu_devices=0"], "cpu_devices", "greater than 0"),
    ([f"{KO_LM}=maybe"], KO_LM, "'maybe'"),
    (["model.vocab_size=1.5"], "model.vocab_size", "1.5"),
    (["mesh.fsdp=0"], "mesh", "mesh.fsdp must be a positive size or -1, got 0"),
    (["mesh.fsdp=-1", "mesh.data=-1"], "mesh", "at most one mesh axis may be -1"),
    (["train.steps.x=1"], "train.steps", "not a section"),
    (["train=3"], "train", "3"),
    (["model.num_kv_heads=3"], "model", "num_heads (8) must be a multiple of num_kv_heads (3)"),
    (["model.head_dim=33"], "model", "head_dim (33) must be even"),
])
def test_bad_value(overrides, key, detail):
  msg = _error(*overrides)
  assert msg.startswith(f"{key}:"), msg
  assert detail in msg, msg


@pytest.mark.parametrize("item, expected", [("train.steps", "expected key=value"), ("=3", "empty key"),
                                            ("train..steps=3", "empty key")])
def test_malformed_override(item, expected):
  assert expected in _error(item)


def test_unknown_preset():
  msg = _error("model=llama9-1t")
  assert msg.startswith("model=llama9-1t: unknown preset")
  assert "llama2-tiny" in msg  # lists the known ones


def test_preset_name_must_be_a_string():
  assert _error("model=3").startswith("model:")


def test_moe_impl_capacity_is_not_offered():
  """Rough edge 5: capacity was in the schema and --help but not built (a 61-line traceback at trace time). The
  knob is the moe part's (model.parts.moe.impl; model.moe_impl, its old key, still sets it)."""
  import meshlm
  from meshlm.cli import _part_keys
  from meshlm.config.keys import render_keys
  from meshlm.models.ffns.moe import knobs
  for key in ("model.parts.moe.impl", "model.moe_impl"):
    with pytest.raises(ConfigError) as info:
      meshlm.load_config("model=qwen3-moe-tiny", f"{key}=capacity")
    msg = str(info.value)
    assert msg.startswith("model.parts.moe.impl:") and "'dropless' or 'reference'" in msg and "'capacity'" in msg, msg
  assert "model.parts.moe.impl" in render_keys(extra=_part_keys()) and "capacity" not in render_keys(extra=_part_keys())
  assert knobs(meshlm.load_config("model=qwen3-moe-tiny", "model.parts.moe.impl=reference").model).impl == "reference"


def test_expert_axis_on_a_dense_model_is_refused():
  """Rough edge 15: mesh.expert=2 on a dense model trained silently; a MoE model still takes it. Only the moe part
  shards over mesh.expert (MeshRules.axes), so the family checks it."""
  import meshlm
  with pytest.raises(ConfigError) as info:
    meshlm.load_config("model=llama2-tiny", "mesh.expert=2")
  msg = str(info.value)
  assert msg.startswith("mesh.expert=2: llama2-tiny (model.family=llama) has no moe layers, the only ones that shard "
                        "over mesh.expert") and "leave mesh.expert at 1" in msg, msg
  assert meshlm.load_config("model=qwen3-moe-tiny", "mesh.expert=2").mesh.expert == 2
  assert meshlm.load_config("model=llama2-tiny", "mesh.expert=1").mesh.expert == 1


def test_data_source_follows_the_path_when_unset():
  """Rough edge 3: data.path without data.source trained on the stdlib corpus; now the ending says it."""
  for path, source in (("c/*.jsonl", "jsonl"), ("c/**/*.txt", "text"), ("c/a.parquet", "parquet")):
    assert load_config(f"data.path={path}").data.source == source
  assert load_config("data.source=text", "data.path=c/*.jsonl").data.source == "text"  # a given source wins
  assert load_config().data.source == "stdlib"
  msg = _error("data.path=corpus/**")
  assert "data.path=corpus/**: data.source is not set" in msg and "set data.source=text|jsonl|parquet" in msg, msg


def test_tied_embedding_refuses_the_lm_head_flag():
  msg = _error("model.tie_embeddings=true", f"{KO_LM}=true")
  assert msg.startswith(f"{KO_LM}=true") and "model.tie_embeddings" in msg
  # Unset or false is fine with a tied head, in either mode.
  for mode in ("explicit", "auto"):
    for value in ("null", "false"):
      cfg = load_config("model.tie_embeddings=true", f"{KO_LM}={value}", f"shard_mode={mode}")
      assert getattr(cfg, KO_LM) is False


@pytest.mark.parametrize("mesh, devices, expected", [
    (["mesh.fsdp=3"], 4, "mesh: mesh.fsdp=3 needs 3 devices but 4 are in use"),
    (["mesh.data=2", "mesh.fsdp=4"], 4, "mesh: mesh.data=2,mesh.fsdp=4 needs 8 devices but 4 are in use"),
    (["mesh.tensor=3"], 4, "mesh: the fixed axes (mesh.tensor=3) multiply to 3, which does not divide the 4"),
])
def test_mesh_that_does_not_divide_the_devices(mesh, devices, expected):
  cfg = load_config(*mesh)  # the schema cannot know the device count; the mesh builder checks it
  with pytest.raises(ConfigError) as info:
    resolve_mesh_shape(cfg, devices)
  assert str(info.value).startswith(expected), str(info.value)
  with pytest.raises(ConfigError, match="^mesh: "):
    make_mesh(load_config(f"cpu_devices={devices}", *mesh))


@pytest.fixture
def fresh_sharding_warnings():
  from meshlm.parallel import sharding
  sharding._warned.clear()
  yield sharding
  sharding._warned.clear()


def test_a_mesh_axis_that_does_not_divide_a_model_dimension_warns_once(fresh_sharding_warnings):
  from meshlm.parallel import logical_spec
  from meshlm.parallel.sharding import ShardingWarning
  mesh = make_mesh(load_config("cpu_devices=6", "mesh.fsdp=2", "mesh.tensor=3"))
  with pytest.warns(ShardingWarning) as caught:
    assert logical_spec(("embed", "heads", "head_dim"), (256, 8, 32), mesh) == P("fsdp", None, None)
  assert [str(w.message) for w in caught] == [
      "mesh.tensor=3 does not divide the heads dimension (size 8): it stays whole, replicated over mesh.tensor "
      "instead of sharded; pick a mesh.tensor that divides 8"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # any further warning fails the test
    logical_spec(("embed", "heads", "head_dim"), (256, 8, 32), mesh)  # once per (axis, dimension)
    assert logical_spec(("mlp", "embed"), (768, 256), mesh) == P("tensor", "fsdp")  # 3 divides 768: silent
    assert logical_spec(("batch", "length"), (1, 16), mesh) == P(None, None)  # a batch of 1 (sampling) is fine
  with pytest.warns(ShardingWarning, match=r"mesh.tensor=3 does not divide the kv_heads dimension \(size 4\)"):
    logical_spec(("embed", "kv_heads", "head_dim"), (256, 4, 32), mesh)
  with pytest.warns(ShardingWarning, match=r"mesh.fsdp=2 does not divide the embed dimension \(size 5\)"):
    logical_spec(("embed",), (5,), mesh)


def test_more_cpu_devices_than_the_process_has():
  with pytest.raises(ConfigError, match="^cpu_devices=64: only 8 devices"):
    make_mesh(load_config("cpu_devices=64"))


@pytest.mark.parametrize("mesh, devices, expected", [
    ([], 4, {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1, "context": 1}),
    (["mesh.data=2"], 8, {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1, "context": 1}),
    (["mesh.fsdp=2", "mesh.tensor=2"], 4, {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1, "context": 1}),
    (["mesh.fsdp=1", "mesh.tensor=-1"], 8, {"data": 1, "fsdp": 1, "tensor": 8, "expert": 1, "context": 1}),
])
def test_mesh_fill(mesh, devices, expected):
  assert resolve_mesh_shape(load_config(*mesh), devices) == expected


# --- tri-state flags ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode, tied, lm, dense", [
    ("explicit", False, True, True),
    ("explicit", True, False, True),
    ("auto", False, False, False),
    ("auto", True, False, False),
])
def test_null_flags_resolve_at_load_time(mode, tied, lm, dense):
  cfg = load_config(f"shard_mode={mode}", f"model.tie_embeddings={str(tied).lower()}")
  assert getattr(cfg, KO_LM) is lm and getattr(cfg, KO_DENSE) is dense
  # Explicit null behaves exactly like leaving the flag out.
  assert load_config(f"shard_mode={mode}", f"model.tie_embeddings={str(tied).lower()}",
                     f"{KO_LM}=null", f"{KO_DENSE}=null") == cfg


def test_default_mode_is_explicit_with_flags_on():
  cfg = load_config()
  assert cfg.shard_mode == "explicit"
  assert getattr(cfg, KO_LM) is True and getattr(cfg, KO_DENSE) is True
  assert cfg.lm_head_kernel_order and cfg.dense_kernel_order


def test_set_flags_are_kept():
  cfg = load_config(f"{KO_LM}=false", f"{KO_DENSE}=false")
  assert getattr(cfg, KO_LM) is False and getattr(cfg, KO_DENSE) is False
  assert not cfg.lm_head_kernel_order and not cfg.dense_kernel_order


def test_flags_are_inert_under_auto():
  """true is kept (and saved) under auto, but the layers see it off: XLA folds the transpose there."""
  cfg = load_config("shard_mode=auto", f"{KO_LM}=true", f"{KO_DENSE}=true")
  assert getattr(cfg, KO_LM) is True and getattr(cfg, KO_DENSE) is True
  assert not cfg.lm_head_kernel_order and not cfg.dense_kernel_order


def test_resolved_flags_are_written_as_booleans():
  for mode, expected in (("explicit", True), ("auto", False)):
    data = yaml.safe_load(to_yaml(load_config(f"shard_mode={mode}")))
    assert data[KO_LM] is expected and data[KO_DENSE] is expected


def test_rope_scaling_missing_keys_fail_before_tracing():
  with pytest.raises(ConfigError, match=r"rope_scaling: llama3 scaling needs original_max_position"):
    load_config("model.rope_scaling.factor=8")
  with pytest.raises(ConfigError, match=r"rope_scaling: linear scaling needs factor"):
    load_config("model.rope_scaling={rope_type: linear}")
  cfg = load_config("model.rope_scaling={factor: 8, original_max_position: 512}")
  assert cfg.model.rope_scaling["factor"] == 8
