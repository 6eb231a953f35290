"""docs/adding-a-part.md's worked example, run as the page writes it: its mixer, family, registry lines and tiny
preset are read from the page's code blocks, registered (tests/doc_example.py), and held to tests/conformance.py's
checks (cached sampling equals recomputing, packed documents, explicit equals auto with nothing blocked), so the
page cannot drift from the code. Negative controls: the same mixer with a decode that drops its state (what
declaring it position-wise would mean) fails the sampling check, and without its segment mask the packed-document
check. Its config section is tests/test_part_config.py's."""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import jax
import jax.numpy as jnp
import pytest

import meshlm
import conformance as C
import doc_example as E
from meshlm.models import api, registry


def test_the_page_holds_the_four_blocks():
  assert set(E.blocks()) == {E.MIXER, E.FAMILY, E.REGISTRY, E.PRESET} == {
      "models/mixers/mean.py", "models/mean_llama.py", "models/registry.py", "config/presets/mean-llama-tiny.yaml"}


@pytest.fixture(scope="module")
def example():
  """(cfg, params, the mixer module, the preset tree) with the page's part and family registered for this module's
  tests."""
  with E.registered() as ex:
    cfg = E.config()
    yield cfg, meshlm.init_params(cfg, jax.random.key(0)), ex.mixer, E.preset()


def test_the_registered_part_and_family_are_the_pages(example):
  cfg, _, mixer, _ = example
  fam = registry.family(cfg)
  assert fam.name == "mean_llama" and fam.kinds["dense"].mixer.name == "mean"
  assert fam.kinds["dense"].mixer.state_spec is mixer.state_spec
  module, factory = registry.PARTS["mean"].split(":")
  assert getattr(importlib.import_module(module), factory)().name == "mean"


def test_cached_sampling_equals_recomputing(example):
  cfg, params, _, _ = example
  print(C.check_generate_equals_recompute(cfg, params))


def test_packed_documents_equal_each_alone(example):
  cfg, params, _, _ = example
  C.check_packed_documents(cfg, params)


def test_explicit_equals_auto_and_nothing_is_blocked(example):
  _, _, _, base = example
  print(C.check_explicit_equals_auto((), lambda mode: C.train_losses((), mode, base=base)))


def _patched(monkeypatch, cfg, apply, **fields):
  """The family's mixer replaced by the page's with `apply` and other Part fields; programs traced anew."""
  fam = registry.family(cfg)
  kind = fam.kinds["dense"]
  mixer = dataclasses.replace(kind.mixer, apply=apply, **fields)
  bad = types.ModuleType("meshlm.models.mean_llama")
  bad.FAMILY = dataclasses.replace(fam, kinds={"dense": dataclasses.replace(kind, mixer=mixer)})
  monkeypatch.setitem(sys.modules, bad.__name__, bad)
  api.clear_programs()


def test_a_decode_that_drops_its_state_fails_the_sampling_check(example, monkeypatch):
  cfg, params, mixer, _ = example

  def forgetful(p, x_BTD, ctx, state=None):  # declared position-wise: no state reaches the decode step
    if ctx.mode == "decode":
      state = {"sum": jnp.zeros((x_BTD.shape[0], x_BTD.shape[2]), x_BTD.dtype)}
    return mixer.apply(p, x_BTD, ctx, state)
  _patched(monkeypatch, cfg, forgetful, state_spec=None, position_wise=True)
  try:
    with pytest.raises(AssertionError, match=r"row \d .*new token \d+: generate drew|log-probs differ"):
      C.check_generate_equals_recompute(cfg, params)
  finally:
    api.clear_programs()


def test_a_mixer_that_reads_across_documents_fails_the_packed_check(example, monkeypatch):
  cfg, params, mixer, _ = example

  def leaky(p, x_BTD, ctx, state=None):
    here = dataclasses.replace(ctx.here, segment_ids=None)
    return mixer.apply(p, x_BTD, dataclasses.replace(ctx, inputs={**ctx.inputs, ctx.context_name: here}), state)
  _patched(monkeypatch, cfg, leaky)
  try:
    with pytest.raises(AssertionError, match="a packed document's logits differ"):
      C.check_packed_documents(cfg, params)
  finally:
    api.clear_programs()
