"""A mixer's own config section, on docs/architecture.md's worked example (tests/doc_example.py registers it):
the part's knob is no schema field and changes the numbers; the family refuses a section none of its parts
declares and the section a bad or unknown knob, each naming the key; another family refuses the section; a model
without attention needs no head fields; a checkpoint compares the parts' knobs (but a COMPUTE one); a moved key
still sets its part's knob (mla's absorb; gdn's chunk_size, impl and conv_kernel_dim, a checkpoint resuming under
another chunk or rule but not another conv); the resolve cache follows the registry. Sampling from the mixer's
decode state against recomputing, and its negative control, are tests/test_architecture_example.py's (run at the
preset's knob)."""
import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

import doc_example as E
import meshlm
from meshlm.config import ModelConfig, load_config
from meshlm.errors import ConfigError
from meshlm.models import model, registry
from meshlm.models.family import section
from meshlm.train.checkpoint import _model_mismatch

PRESET = E.preset()


@pytest.fixture(autouse=True)
def example():
  """The page's mixer and family registered for one test (undone after it, the caches dropped)."""
  with E.registered() as ex:
    yield ex


def test_the_knob_is_the_parts_own_not_a_schema_field(example):
  """No schema field or schema text names the part, its family or its knob; the section reads the preset's value,
  a dotted override and, with no section given, its default."""
  schema = Path(meshlm.config.schema.__file__).read_text()
  assert "scale" not in ModelConfig.model_fields
  assert [w for w in ("MeanConfig", "parts.mean", "mean_llama") if w in schema] == []
  part = example.mixer.PART
  assert section(registry.validate(E.config()).model, part).scale == 0.5  # the preset's
  assert section(E.config("model.parts.mean.scale=2").model, part).scale == 2.0  # a dotted key
  assert section(E.config("model.parts={}").model, part).scale == 1.0  # the section's default


def test_the_knob_changes_the_numbers():
  """The part reads its knob (a section read nowhere would leave the logits alone)."""
  cfg, other = E.config(), E.config("model.parts.mean.scale=2")
  params = meshlm.init_params(cfg, jax.random.key(0))
  tokens = np.arange(16, dtype=np.int32)[None] % cfg.model.vocab_size
  a, b = (np.asarray(meshlm.forward(c, params, tokens)) for c in (cfg, other))
  assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("override, msg", [
    ("model.parts.mean.scale=-1", r"model.parts.mean.scale: Input should be greater than 0 \(the mean part's knobs: "
     r"scale\)"),
    ("model.parts.mean.scael=2", r"model.parts.mean.scael: unknown knob \(the mean part's knobs: scale\)"),
    ("model.parts.glu.scale=2", r"model.parts.glu: model family 'mean_llama' has no part 'glu' with knobs of its own "
     r"\(parts with knobs: mean\)"),
])
def test_a_bad_section_is_refused_naming_the_key(override, msg):
  with pytest.raises(ConfigError, match=msg):
    registry.validate(E.config(override))


def test_a_model_without_attention_needs_no_head_fields():
  """The preset sets no heads; attention's parts need them (Part.needs), so a family with attention refuses
  each one null, naming the key; the control: the same config with all three set resolves."""
  m = registry.validate(E.config()).model
  assert (m.num_heads, m.num_kv_heads, m.head_dim) == (None, None, None)
  llama = dict(PRESET, model=dict(PRESET["model"], family="llama", parts={}))
  heads = ["model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=32"]
  registry.validate(load_config(*heads, base=llama))
  for given in heads:
    key = given.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: required by model.family=llama \\(its gqa layers\\); "
                       f"set {key}=...$"):
      registry.validate(load_config(*(h for h in heads if h != given), base=llama))


def test_another_family_refuses_the_section():
  with pytest.raises(ConfigError, match="model.parts.mean: model family 'llama' has no part 'mean'"):
    registry.validate(load_config("model=llama2-tiny", "model.parts.mean.scale=2"))


# --- a knob that moved into its part's section: model.mla_absorb -> model.parts.mla.absorb -------------------

def test_a_moved_key_still_sets_the_parts_knob():
  from meshlm.models.mixers.mla import PART
  absorb = lambda *o: section(registry.validate(load_config("model=deepseek-v3-tiny", *o)).model, PART).absorb
  assert absorb() is True
  assert absorb("model.mla_absorb=false") is False  # the old key, as presets and saved run configs have it
  assert absorb("model.parts.mla.absorb=false") is False
  assert absorb("model.mla_absorb=true", "model.parts.mla.absorb=false") is False  # the new name wins
  assert "mla_absorb" not in ModelConfig.model_fields
  with pytest.raises(ConfigError, match="model.parts.mla: model family 'llama' has no part 'mla'"):
    registry.validate(load_config("model=llama2-tiny", "model.mla_absorb=false"))  # a knob llama has no part for


def test_a_checkpoint_compares_the_parts_knobs_but_a_compute_knob():
  """A checkpoint's saved model config against this run's: a part's knob that changes the numbers must match
  (model.parts.mean.scale), a knob its section names COMPUTE may differ (mla's absorb, also under its old key, as
  a checkpoint from before the move saved it)."""
  cfg = E.config()
  saved = cfg.model.model_dump(mode="json")
  assert _model_mismatch(saved, cfg) is None
  other = dict(saved, parts={"mean": {"scale": 2.0}})
  assert _model_mismatch(other, cfg) == "model.parts.mean.scale is 0.5 here but 2.0 in the checkpoint"
  dsv3 = load_config("model=deepseek-v3-tiny", "model.parts.mla.absorb=false")
  old = {k: v for k, v in load_config("model=deepseek-v3-tiny").model.model_dump(mode="json").items() if k != "parts"}
  assert _model_mismatch(dict(old, mla_absorb=True), dsv3) is None
  assert _model_mismatch(dict(old, parts={"gqa": {}}), dsv3).startswith("model.parts.gqa is None here")


def test_a_checkpoint_knob_the_section_no_longer_takes_is_a_mismatch():
  cfg = E.config()
  saved = dict(cfg.model.model_dump(mode="json"), parts={"mean": {"scale": 0.5, "gone": 1}})
  assert _model_mismatch(saved, cfg).startswith("model.parts.mean is {'scale': 0.5} here but")


def test_resolve_is_cached_and_follows_the_registry(monkeypatch):
  """The same config resolves to the same Model; a family swapped in the registry (as tests swap them)
  resolves anew rather than from the cache (control: without the swap it is the cached one)."""
  cfg = E.config()
  first = model.resolve(cfg)
  assert model.resolve(E.config()) is first and model.resolve(first) is first
  fam = registry.get("mean_llama")
  other = dataclasses.replace(fam, embed_scale=True)
  monkeypatch.setattr(registry, "get", lambda name: other if name == "mean_llama" else fam)
  assert model.resolve(cfg).family.embed_scale and model.resolve(cfg) is not first


# --- gdn's knobs, moved into its section: model.gdn_chunk_size, gdn_impl, linear_conv_kernel_dim -------------

def gdn_knobs(*overrides, base=None):
  from meshlm.models.mixers import gdn
  own = gdn.knobs(registry.validate(load_config("model=qwen3.5-tiny", *overrides, base=base)).model)
  return own.chunk_size, own.impl, own.conv_kernel_dim


def test_the_old_gdn_keys_still_set_its_knobs():
  """On the CLI the old key overrides what the preset sets under the new name (qwen3.5-tiny's parts.gdn.chunk_size:
  64); in a tree (a saved run config, a base dict) it sets the knob, and the new name given there too wins."""
  assert gdn_knobs() == (64, "chunked", 4)
  assert gdn_knobs("model.gdn_chunk_size=16", "model.gdn_impl=reference", "model.linear_conv_kernel_dim=3") == (
      16, "reference", 3)
  assert gdn_knobs("model.parts.gdn.chunk_size=16", "model.parts.gdn.impl=reference",
                   "model.parts.gdn.conv_kernel_dim=3") == (16, "reference", 3)
  assert gdn_knobs("model.gdn_chunk_size=16", "model.parts.gdn.chunk_size=32")[0] == 32  # in order: the last wins
  tree = load_config("model=qwen3.5-tiny").model_dump(mode="json")
  flat = dict(tree, model={**{k: v for k, v in tree["model"].items() if k != "parts"}, "gdn_chunk_size": 16,
                           "gdn_impl": "reference", "linear_conv_kernel_dim": 3})
  assert gdn_knobs(base=flat) == (16, "reference", 3)
  both = dict(flat, model=dict(flat["model"], parts={"gdn": {"chunk_size": 32}}))
  assert gdn_knobs(base=both) == (32, "reference", 3)
  assert not {"gdn_chunk_size", "gdn_impl", "linear_conv_kernel_dim"} & set(ModelConfig.model_fields)
  assert not {"gdn_chunk_size", "gdn_impl"} & set(ModelConfig.COMPUTE_FIELDS)


def test_an_old_key_at_its_default_sets_nothing_for_a_family_without_the_part():
  """A model config saved before the move holds every field (llama's too, at the defaults): it loads; an old key
  off its default still is a knob llama has no part for (control)."""
  tree = load_config("model=llama2-tiny").model_dump(mode="json")
  old = dict(tree, model=dict(tree["model"], gdn_chunk_size=64, gdn_impl="chunked", linear_conv_kernel_dim=4,
                              mla_absorb=True))
  assert registry.validate(load_config(base=old)).model.parts == {}
  with pytest.raises(ConfigError, match="model.parts.gdn: model family 'llama' has no part 'gdn'"):
    registry.validate(load_config(base=dict(old, model=dict(old["model"], gdn_chunk_size=32))))


@pytest.mark.parametrize("key", ["model.parts.gdn.chunk_size", "model.gdn_chunk_size"])
def test_a_gdn_chunk_not_a_power_of_two_is_refused_naming_the_section_key(key):
  with pytest.raises(ConfigError, match=r"^model\.parts\.gdn\.chunk_size: 48 must be a power of two"):
    gdn_knobs(f"{key}=48")
  assert gdn_knobs(f"{key}=32")[0] == 32  # control


def test_a_checkpoint_resumes_under_another_gdn_chunk_or_rule_but_not_another_conv():
  """chunk_size and impl are COMPUTE knobs (the same parameters, computed in other pieces); conv_kernel_dim is a
  parameter's shape. A checkpoint saved before the move (the flat keys) compares as the new ones."""
  cfg = load_config("model=qwen3.5-tiny")
  saved = cfg.model.model_dump(mode="json")
  assert _model_mismatch(saved, cfg) is None
  assert _model_mismatch(dict(saved, parts={"gdn": {"chunk_size": 16, "impl": "reference"}}), cfg) is None
  assert _model_mismatch(dict(saved, parts={"gdn": {"conv_kernel_dim": 3}}), cfg) == (
      "model.parts.gdn.conv_kernel_dim is 4 here but 3 in the checkpoint")
  old = {k: v for k, v in saved.items() if k != "parts"}
  assert _model_mismatch(dict(old, gdn_chunk_size=32, gdn_impl="reference", linear_conv_kernel_dim=4), cfg) is None
  assert _model_mismatch(dict(old, linear_conv_kernel_dim=2), cfg) == (
      "model.parts.gdn.conv_kernel_dim is 4 here but 2 in the checkpoint")
  llama = load_config("model=llama2-tiny")
  before_the_move = dict(llama.model.model_dump(mode="json"), gdn_chunk_size=64, gdn_impl="chunked",
                         linear_conv_kernel_dim=4, mla_absorb=True)
  assert _model_mismatch(before_the_move, llama) is None
