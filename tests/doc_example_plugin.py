"""A pytest plugin (`-p doc_example_plugin`, with tests/ on PYTHONPATH) that registers docs/adding-a-part.md's worked
example (tests/doc_example.py: a new mixer, a family with no Hugging Face adapter, a tiny preset) for the whole
process, its preset among the package's, as a part author's new family is registered: so the tree's own
conformance runs on it by its preset's name,

    PYTHONPATH=src:tests pytest -p doc_example_plugin tests/test_conformance.py -k mean-llama-tiny

It registers beside it FORGETFUL, the same family but with a mixer whose decode drops its state (declared
position-wise, so no state reaches it), and that family's preset FORGETFUL_PRESET: its generate row must fail.
tests/test_adding_a_part.py runs both."""
from __future__ import annotations

import copy
import dataclasses
import sys
import types

import jax.numpy as jnp
import pytest

import doc_example as E

FORGETFUL = "mean_llama_forgetful"
FORGETFUL_PRESET = "mean-llama-forgetful-tiny"
_HELD: list = []  # (the registration's context manager, the MonkeyPatch) while the process runs


def forgetful(family):
  """family with its mixer's decode given a zero state instead of its own (declared position-wise)."""
  kind = family.kinds["dense"]
  mixer = kind.mixer

  def apply(p, x_BTD, ctx, state=None):
    if ctx.mode == "decode":
      state = {"sum": jnp.zeros((x_BTD.shape[0], x_BTD.shape[2]), x_BTD.dtype)}  # [B, D]
    return mixer.apply(p, x_BTD, ctx, state)
  broken = dataclasses.replace(mixer, apply=apply, state_spec=None, position_wise=True)
  return dataclasses.replace(family, name=FORGETFUL, kinds={"dense": dataclasses.replace(kind, mixer=broken)})


def presets() -> dict[str, dict]:
  """{preset name: config tree} of the page's preset and the forgetful family's."""
  page = E.preset()
  bad = copy.deepcopy(page)
  bad["model"]["family"], bad["model_name"] = FORGETFUL, FORGETFUL_PRESET
  return {page["model_name"]: page, FORGETFUL_PRESET: bad}


def pytest_configure(config):
  from meshlm import config as meshlm_config
  from meshlm.config import loader
  from meshlm.models import registry
  held = E.registered()
  example = held.__enter__()
  mp = pytest.MonkeyPatch()
  _HELD.append((held, mp))
  module = types.ModuleType(f"meshlm.models.{FORGETFUL}")
  module.FAMILY = forgetful(example.family.FAMILY)
  mp.setitem(sys.modules, module.__name__, module)
  mp.setitem(registry.FAMILIES, FORGETFUL, module.__name__)
  extra = presets()
  real_names, real_load = loader.preset_names, loader.load_preset
  names = lambda: sorted([*real_names(), *extra])  # noqa: E731
  load = lambda name: copy.deepcopy(extra[name]) if name in extra else real_load(name)  # noqa: E731
  for where in (loader, meshlm_config):
    mp.setattr(where, "preset_names", names)
    mp.setattr(where, "load_preset", load)


def pytest_unconfigure(config):
  while _HELD:
    held, mp = _HELD.pop()
    mp.undo()
    held.__exit__(None, None, None)
