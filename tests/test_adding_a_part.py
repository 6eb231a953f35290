"""docs/adding-a-part.md's worked example, run as the page writes it: its mixer, family, registry lines and tiny
preset are read from the page's code blocks, registered (tests/doc_example.py), and held to the conformance as a
part author runs it, `pytest tests/test_conformance.py -k <its preset>` in a process of the default device count
(tests/doc_example_plugin.py registers it there): cached sampling equals recomputing, packed documents, explicit
equals auto with nothing blocked, and no HF row asked of a family with no adapter; so the page cannot drift from
the code. Negative controls: the same mixer with a decode that drops its state (what declaring it position-wise
would mean) fails the sampling row there, and without its segment mask the packed-document check here. Its config
section is tests/test_part_config.py's."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

import meshlm
import conformance as C
import doc_example as E
import doc_example_plugin as P
from meshlm.models import api, registry

HERE = Path(__file__).resolve().parent
FAMILY, PRESET_NAME = E.preset()["model"]["family"], E.preset()["model_name"]  # mean_llama, mean-llama-tiny


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


def test_the_page_part_sets_only_the_core_fields(example):
  """A new part with no replay, model state or mesh rules sets only Part's core fields: its records declare
  nothing."""
  from meshlm.models import family as F
  _, _, mixer, _ = example
  calls = [n for n in ast.walk(ast.parse(E.blocks()[E.MIXER])) if isinstance(n, ast.Call)
           and getattr(n.func, "id", None) == "Part"]
  records = {"compute", "replay", "model_state", "mesh", "instrument"}
  assert len(calls) == 1 and not {k.arg for k in calls[0].keywords} & records
  part = mixer.PART
  assert (part.compute, part.replay, part.model_state, part.mesh, part.instrument) == (
      F.Compute(), F.Replay(), None, F.MeshRules(), F.Instrument())


def test_conformance_runs_on_the_page_family_by_its_preset_name():
  """What a part author runs, `pytest tests/test_conformance.py -k <preset>`, in a process of the default 8 devices
  with the page's family registered (tests/doc_example_plugin.py): its needs row and every product row of its
  preset are collected and pass (generate = recompute and packed = alone as a 1-device user's calls, explicit ==
  auto on fsdp=4), no HF row is asked of a family with no adapter; and the same family with a decode that drops its
  state (declared position-wise) fails its generate row, naming the check."""
  forgetful = f"{P.FORGETFUL_PRESET} and generate"
  env = {k: v for k, v in os.environ.items() if k != "MESHLM_TEST_DEVICES"}
  env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
  r = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-v", "-p", "no:cacheprovider", "--tb=short",
                      "-p", "doc_example_plugin", str(HERE / "test_conformance.py"),
                      "-k", f"{FAMILY} or {PRESET_NAME} or ({forgetful})"],
                     env=env, cwd=HERE.parent, capture_output=True, text=True)
  print(r.stdout[-6000:])
  rows = dict(re.findall(r"::(\S+) (PASSED|FAILED|SKIPPED|ERROR)", r.stdout))
  want = {f"test_every_family_has_what_conformance_needs[{FAMILY}]": "PASSED",
          f"test_every_family_has_what_conformance_needs[{P.FORGETFUL}]": "PASSED",
          f"test_generate_equals_recomputing_with_forward[{PRESET_NAME}]": "PASSED",
          f"test_packed_documents_equal_each_alone[{PRESET_NAME}]": "PASSED",
          f"test_explicit_equals_auto_and_nothing_is_blocked[{PRESET_NAME}]": "PASSED",
          f"test_remat_flash_and_the_blockwise_loss_train_alike[{PRESET_NAME}]": "PASSED",
          f"test_generate_equals_recomputing_with_forward[{P.FORGETFUL_PRESET}]": "FAILED"}
  assert rows == want, f"rows {rows}, want {want}:\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
  failure = r.stdout[r.stdout.index("= FAILURES ="):]
  assert "in check_generate_equals_recompute" in failure, failure
  assert re.search(r"AssertionError: row \d .*new token \d+: generate drew|log-probs differ", failure), failure


def _patched(monkeypatch, cfg, apply, **fields):
  """The family's mixer replaced by the page's with `apply` and other Part fields; programs traced anew."""
  fam = registry.family(cfg)
  kind = fam.kinds["dense"]
  mixer = dataclasses.replace(kind.mixer, apply=apply, **fields)
  bad = types.ModuleType("meshlm.models.mean_llama")
  bad.FAMILY = dataclasses.replace(fam, kinds={"dense": dataclasses.replace(kind, mixer=mixer)})
  monkeypatch.setitem(sys.modules, bad.__name__, bad)
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
