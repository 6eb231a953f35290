"""A new mixer with its own knob and decode state is one part file (with its config section), one registry
line and one preset, and no edit of config/schema.py (tests/newpart/): the part's section carries its knob,
the family refuses a section it has no part for, the section refuses a bad knob (each naming the key), and
sampling from the decode state equals recomputing."""
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import conformance as C
import meshlm
from meshlm.config import ModelConfig, load_config
from meshlm.errors import ConfigError
from meshlm.models import registry
from meshlm.models.family import section

HERE = Path(__file__).parent / "newpart"
PRESET = yaml.safe_load((HERE / "meanfam-tiny.yaml").read_text())


@pytest.fixture(autouse=True)
def registered(monkeypatch):
  # The registry lines the new part and its family would add to models/registry.py.
  monkeypatch.setitem(registry.PARTS, "causal_mean", "newpart.mean_mixer:causal_mean")
  monkeypatch.setitem(registry.FAMILIES, "meanfam", "newpart.meanfam")


def cfg_of(*overrides):
  return load_config("cpu_devices=1", *overrides, base=PRESET)


def test_the_knob_is_the_parts_own_not_a_schema_field():
  from newpart.mean_mixer import PART
  assert "scale" not in ModelConfig.model_fields and "causal_mean" not in Path(
      meshlm.config.schema.__file__).read_text()
  cfg = registry.validate(cfg_of())
  assert section(cfg.model, PART).scale == 0.5  # the preset's
  assert section(cfg_of("model.parts.causal_mean.scale=2").model, PART).scale == 2.0  # a dotted key
  assert section(cfg_of("model.parts={}").model, PART).scale == 1.0  # the section's default


def test_the_knob_changes_the_numbers():
  """The part reads its knob (a section read nowhere would leave the logits alone)."""
  cfg, other = cfg_of(), cfg_of("model.parts.causal_mean.scale=2")
  params = meshlm.init_params(cfg, jax.random.key(0))
  tokens = np.arange(16, dtype=np.int32)[None] % cfg.model.vocab_size
  a, b = (np.asarray(meshlm.forward(c, params, tokens)) for c in (cfg, other))
  assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("override, msg", [
    ("model.parts.causal_mean.scale=-1", r"model.parts.causal_mean.scale: Input should be greater than 0 \(the "
     r"causal_mean part's knobs: scale\)"),
    ("model.parts.causal_mean.scael=2", r"model.parts.causal_mean.scael: unknown knob \(the causal_mean part's knobs: "
     r"scale\)"),
    ("model.parts.glu.scale=2", r"model.parts.glu: model family 'meanfam' has no part 'glu' with knobs of its own "
     r"\(parts with knobs: causal_mean\)"),
])
def test_a_bad_section_is_refused_naming_the_key(override, msg):
  with pytest.raises(ConfigError, match=msg):
    registry.validate(cfg_of(override))


def test_a_model_without_attention_needs_no_head_fields():
  """The preset sets no heads; attention's parts need them (Part.needs), so a family with attention refuses
  each one null, naming the key; the control: the same config with all three set resolves."""
  m = registry.validate(cfg_of()).model
  assert (m.num_heads, m.num_kv_heads, m.head_dim) == (None, None, None)
  llama = dict(PRESET, model=dict(PRESET["model"], family="llama", parts={}))
  heads = ["model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16"]
  registry.validate(load_config(*heads, base=llama))
  for given in heads:
    key = given.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: required by model.family=llama \\(its gqa layers\\); "
                       f"set {key}=...$"):
      registry.validate(load_config(*(h for h in heads if h != given), base=llama))


def test_another_family_refuses_the_section():
  with pytest.raises(ConfigError, match="model.parts.causal_mean: model family 'llama' has no part 'causal_mean'"):
    registry.validate(load_config("model=llama2-tiny", "model.parts.causal_mean.scale=2"))


def test_sampling_from_its_decode_state_equals_recomputing():
  cfg = cfg_of()
  params = meshlm.init_params(cfg, jax.random.key(1))
  got = C.check_generate_equals_recompute(cfg, params)
  assert got["max_logprob_diff"] <= C.LOGPROB_ATOL


def test_a_wrong_decode_state_fails_the_recompute_check(monkeypatch):
  """The negative control: a decode step that drops its running sum samples other tokens or log-probs."""
  from newpart import mean_mixer
  cfg = cfg_of()
  params = meshlm.init_params(cfg, jax.random.key(1))
  real = mean_mixer.apply

  def forgetful(p, x, ctx, state=None):
    return real(p, x, ctx, None if state is None else {"sum": 0 * state["sum"]})
  import dataclasses
  monkeypatch.setattr(mean_mixer, "PART", dataclasses.replace(mean_mixer.PART, apply=forgetful))
  monkeypatch.setitem(registry.FAMILIES, "meanfam", "newpart.meanfam_forgetful")
  import sys
  import types
  from meshlm.models.family import Family, Kind
  from meshlm.models.ffns.glu import glu
  mod = types.ModuleType("newpart.meanfam_forgetful")
  mod.FAMILY = Family("meanfam", kinds={"dense": Kind(mean_mixer.PART, glu())})
  monkeypatch.setitem(sys.modules, "newpart.meanfam_forgetful", mod)
  from meshlm.models import api
  api.clear_programs()  # the compiled programs of the first sampling
  try:
    with pytest.raises(AssertionError):
      C.check_generate_equals_recompute(cfg, params)
  finally:
    api.clear_programs()


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
  (model.parts.causal_mean.scale), a knob its section names COMPUTE may differ (mla's absorb, also under its old
  key, as a checkpoint from before the move saved it)."""
  from meshlm.train.checkpoint import _model_mismatch
  cfg = cfg_of()
  saved = cfg.model.model_dump(mode="json")
  assert _model_mismatch(saved, cfg) is None
  other = dict(saved, parts={"causal_mean": {"scale": 2.0}})
  assert _model_mismatch(other, cfg) == "model.parts.causal_mean.scale is 0.5 here but 2.0 in the checkpoint"
  dsv3 = load_config("model=deepseek-v3-tiny", "model.parts.mla.absorb=false")
  old = {k: v for k, v in load_config("model=deepseek-v3-tiny").model.model_dump(mode="json").items() if k != "parts"}
  assert _model_mismatch(dict(old, mla_absorb=True), dsv3) is None
  assert _model_mismatch(dict(old, parts={"gqa": {}}), dsv3).startswith("model.parts.gqa is None here")


def test_resolve_is_cached_and_follows_the_registry(monkeypatch):
  """The same config resolves to the same Model; a family swapped in the registry (as tests swap them)
  resolves anew rather than from the cache (control: without the swap it is the cached one)."""
  import dataclasses
  from meshlm.models import model
  cfg = cfg_of()
  first = model.resolve(cfg)
  assert model.resolve(cfg_of()) is first and model.resolve(first) is first
  fam = registry.get("meanfam")
  other = dataclasses.replace(fam, embed_scale=True)
  monkeypatch.setattr(registry, "get", lambda name: other if name == "meanfam" else fam)
  assert model.resolve(cfg).family.embed_scale and model.resolve(cfg) is not first


def test_a_checkpoint_knob_the_section_no_longer_takes_is_a_mismatch():
  from meshlm.train.checkpoint import _model_mismatch
  cfg = cfg_of()
  saved = dict(cfg.model.model_dump(mode="json"), parts={"causal_mean": {"scale": 0.5, "gone": 1}})
  assert _model_mismatch(saved, cfg).startswith("model.parts.causal_mean is {'scale': 0.5} here but")
