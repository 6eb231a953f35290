"""Every registered family against the declared layer interface (models/family.py), by abstract
evaluation (jax.eval_shape: no compile): each part's parameters are ParamSpecs, apply returns exactly
its declared side outputs, no update when training, and in prefill and decode an update whose leaves
are the ones its state_spec declares, shaped by their commit rule. The generic decoder imports no part. Every
field of Part and of its opt-in records is documented in its own class's docstring."""
import ast
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from meshlm import spec as S
from meshlm.config import load_config, preset_names
from meshlm.models import decoder, registry
from meshlm.models import family as F
from meshlm.models.family import COMMITS, Kind, LayerInput, Part, StateLeaf

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "meshlm"
B, T, C = 2, 8, 16


def _preset(family: str) -> str:
  names = [n for n in preset_names() if n.endswith("-tiny") and load_config(f"model={n}").model.family == family]
  assert names, f"no tiny preset of family {family}"
  return names[0]


def test_every_registered_part_is_a_factory_of_its_name():
  import importlib
  for name, where in registry.PARTS.items():
    module, factory = where.split(":")
    part = getattr(importlib.import_module(module), factory)()
    assert isinstance(part, Part) and part.name == name


def test_every_family_is_registered_with_a_tiny_preset():
  assert sorted(registry.FAMILIES) == sorted({load_config(f"model={n}").model.family for n in preset_names()})


def _abstract(tree):
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), tree, is_leaf=S.is_spec)


def _run(cfg, kind: Kind, part: Part, mode: str, context_name: str):
  """(y, update, side) of part.apply on one layer's abstract parameters (after its prepare)."""
  m = cfg.model
  specs = S.stack(part.spec(m), 1, 0)
  T_in = 1 if mode == "decode" else T
  x = jax.ShapeDtypeStruct((B, T_in, m.embed_dim), jnp.float32)
  size = C if context_name == "global" else min(C, m.sliding_window)
  state = None
  if mode == "decode" and part.state_spec is not None:
    state = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32) for k, v in part.state_spec(m, B, size).items()}

  def f(p, x, state):
    if part.compute.prepare is not None:
      p = part.compute.prepare(p, specs, jnp.float32)
    p = jax.tree.map(lambda a: a[0], p)
    if part.model_state is not None:
      p = dict(p, **jax.tree.map(lambda s: jnp.zeros(s.shape), part.model_state.spec(m), is_leaf=S.is_spec))
    pos = jnp.broadcast_to(jnp.arange(T_in, dtype=jnp.int32), (B, T_in)) + (C - 1 if mode == "decode" else 0)
    kw = {} if mode == "train" else dict(cache_len=C)
    if mode == "prefill":
      kw["lengths_B"] = jnp.full((B,), T, jnp.int32)
    ctx = decoder.context(cfg, pos, mode=mode, **kw).as_context(context_name)
    return part.apply(p, x, ctx, state)
  return jax.eval_shape(f, _abstract(specs), x, state), size


def _cases():
  for fam_name in sorted(registry.FAMILIES):
    fam = registry.get(fam_name)
    for kind_name, kind in fam.kinds.items():
      for part in kind.parts:
        yield pytest.param(fam_name, kind_name, part.name, id=f"{fam_name}-{kind_name}-{part.name}")


@pytest.mark.parametrize("fam_name, kind_name, part_name", list(_cases()))
def test_part_honours_its_declaration(fam_name, kind_name, part_name):
  cfg = load_config(f"model={_preset(fam_name)}", "train.compute_dtype=float32", "cpu_devices=1")
  m = cfg.model
  kind = registry.get(fam_name).kinds[kind_name]
  part = next(p for p in kind.parts if p.name == part_name)
  assert isinstance(kind, Kind) and isinstance(part, Part)
  assert part.name in registry.PARTS, f"part {part.name!r} is not in models/registry.PARTS"
  assert kind.mixer.key != kind.ffn.key and part.key not in ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm")
  assert all(S.is_spec(s) for s in jax.tree.leaves(part.spec(m), is_leaf=S.is_spec))
  for li in part.replay.layer_inputs.values():  # the trailing shape a batch field and the decoder's input take
    assert isinstance(li, LayerInput) and callable(li.check) and all(isinstance(n, int) for n in li.trailing(m))
  assert set(part.replay.replays) <= set(part.side_names)
  assert set(part.replay.replays.values()) <= set(part.replay.layer_inputs)
  if part.model_state is not None:
    assert part.side_names and set(part.state_side()) <= set(part.side_names)
  contexts = sorted(set(registry.family(cfg).layer_plan(m).contexts))
  for context_name in contexts:
    (y, update, side), size = _run(cfg, kind, part, "train", context_name)
    assert y.shape == (B, T, m.embed_dim) and update is None
    assert sorted(side) == sorted(part.side_names)
    for mode, rows in (("prefill", T), ("decode", 1)):
      (y, update, side), size = _run(cfg, kind, part, mode, context_name)
      assert sorted(side) == sorted(part.side_names)
      if part.state_spec is None:
        assert update is None
        continue
      leaves = part.state_spec(m, B, size)
      assert sorted(update) == sorted(leaves)
      for name, leaf in leaves.items():
        assert isinstance(leaf, StateLeaf) and leaf.commit in COMMITS and len(leaf.axes) == len(leaf.shape)
        want = list(leaf.shape)
        if leaf.commit == "rows":
          want[leaf.slot_axis] = rows
        want = tuple(want)
        assert update[name].shape == want, (mode, name, update[name].shape, want)


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
  return names


# The context builds the attention masks (nn.attention.attention_mask) for every attention-like mixer;
# the attention math itself belongs to the parts.
PART_MODULES = ("meshlm.models.mixers", "meshlm.models.ffns", "meshlm.nn.moe", "meshlm.nn.attention.gqa",
                "meshlm.nn.router_replay", "meshlm.nn.mlp", "meshlm.nn.gather_once")


def _part_imports(path: pathlib.Path) -> list[str]:
  return sorted(n for n in _imports(path) if n.startswith(PART_MODULES))


def test_the_generic_decoder_imports_no_part(tmp_path):
  for name in ("decoder.py", "model.py", "params.py", "layers.py", "context.py", "family.py", "generate.py"):
    assert _part_imports(SRC / "models" / name) == [], name
  # Control: the check sees such an import, at module level or in a function.
  bad = tmp_path / "bad.py"
  bad.write_text("import jax\n\ndef f():\n  from meshlm.nn import moe\n  from meshlm.nn.moe import route\n")
  assert _part_imports(bad) == ["meshlm.nn.moe", "meshlm.nn.moe.route"]


def test_a_wrong_declaration_fails_the_check():
  """Control: a part whose apply returns a side output it does not declare is caught."""
  cfg = load_config("model=llama2-tiny", "train.compute_dtype=float32", "cpu_devices=1")
  kind = registry.get("llama").kinds["dense"]
  sloppy = dataclasses.replace(kind.ffn, apply=lambda p, x, ctx, state=None: (x, None, {"extra": jnp.zeros(())}))
  (_, _, side), _ = _run(cfg, kind, sloppy, "train", "global")
  assert sorted(side) != sorted(sloppy.side_names)


RECORDS = (Part, F.Compute, F.Replay, F.ModelState, F.MeshRules, F.LayerMemory, F.Instrument)


def undocumented(cls) -> list[str]:
  """The dataclass fields of cls that its docstring does not document as an item (`- name: ...` or `- name(...`)."""
  return [f.name for f in dataclasses.fields(cls) if not re.search(rf"^\s*- {f.name}\b", cls.__doc__ or "", re.M)]


@pytest.mark.parametrize("cls", RECORDS, ids=[c.__name__ for c in RECORDS])
def test_every_field_of_the_part_and_its_records_is_documented_once_in_its_class(cls):
  assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
  assert undocumented(cls) == [], f"{cls.__name__}: fields with no `- name` item in its docstring"


def test_an_undocumented_field_is_named():
  """Control: a record with a field its docstring leaves out."""
  @dataclasses.dataclass(frozen=True)
  class Sloppy:
    """- axes: documented."""
    axes: tuple = ()
    check: object = None
  assert undocumented(Sloppy) == ["check"]


def test_the_parts_opt_in_records_default_to_declaring_nothing():
  """A part that sets only the core fields (glu) gets records that declare nothing, and the readers see nothing."""
  part = registry.parts()["glu"]
  assert (part.compute, part.replay, part.model_state, part.mesh, part.instrument) == (
      F.Compute(), F.Replay(), None, F.MeshRules(), F.Instrument())
  cfg = load_config("model=llama2-tiny")
  assert part.mesh.shard_multiple(cfg.model) == 1 and part.mesh.run_knobs(cfg) == {} and part.state_side() == {}
  assert part.instrument.attention_width is None and part.compute.prepare is None


RECORD_OF = {"compute": "Compute", "replay": "Replay", "model_state": "ModelState", "mesh": "MeshRules",
             "instrument": "Instrument"}


def doc_field_lists(text: str) -> tuple[set[str], dict[str, str]]:
  """Part fields a doc names: those of a signature `Part(a, b | c, ...)` (no `=` in it), and {field: record} of
  its `field=Record(` items."""
  names = set()
  for sig in re.findall(r"\bPart\(([\w ,|.]*)\)", text):
    names.update(n for n in re.split(r"[ ,|]+", sig) if n and n != "...")
  return names, dict(re.findall(r"\b(\w+)=(" + "|".join(RECORD_OF.values()) + r")\(", text))


def test_the_docs_name_only_parts_fields_and_records():
  """Where a doc keeps (part of) Part's field list, each name is a field, and each record sits at its field."""
  fields = {f.name for f in dataclasses.fields(Part)}
  assert set(RECORD_OF) <= fields and {f.name: f.type.split(" ")[0] for f in dataclasses.fields(Part)
                                       if f.name in RECORD_OF} == RECORD_OF
  docs = sorted((SRC.parents[1] / "docs").glob("*.md"))
  for doc in docs:
    names, records = doc_field_lists(doc.read_text())
    assert names <= fields, f"{doc.name}: not Part fields: {sorted(names - fields)}"
    assert all(RECORD_OF.get(k) == v for k, v in records.items()), f"{doc.name}: {records}"
  # Control: the old signature names fields that moved into records.
  names, _ = doc_field_lists("Part(name, key, spec, apply, state_spec, prepare, mesh_axes)")
  assert names - fields == {"prepare", "mesh_axes"}
  assert doc_field_lists("x = Part(name='a', mesh=Instrument(census=()))")[1] == {"mesh": "Instrument"}
