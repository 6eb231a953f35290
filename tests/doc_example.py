"""docs/adding-a-part.md's worked example as the tests run it: its fenced blocks read from the page, its mixer and
family made modules and registered, its tiny preset loaded. tests/test_adding_a_part.py holds it to the
conformance checks, tests/test_part_config.py its config section."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest
import yaml

import meshlm
from meshlm.models import api, registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-part.md"
MIXER, FAMILY, REGISTRY, PRESET = ("models/mixers/mean.py", "models/mean_llama.py", "models/registry.py",
                                   "config/presets/mean-llama-tiny.yaml")


def blocks() -> dict[str, str]:
  """The worked example's fenced blocks, by the path in their first line (`# models/mixers/mean.py`)."""
  text = DOC.read_text()
  start = text.index("## Worked example: a new mixer")
  end = text.find("\n## ", start)  # the next section, else the end of the page
  section = text[start:end if end != -1 else len(text)]
  out = {}
  for _, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
    first = body.splitlines()[0]
    assert first.startswith("# "), first
    out[first[2:].split(":")[0].strip()] = body
  return out


def preset() -> dict:
  """The page's tiny preset as a config tree (model_name from the file's name, as a preset file gets it)."""
  base = yaml.safe_load(blocks()[PRESET])
  base.setdefault("model_name", Path(PRESET).stem)
  return base


def config(*overrides: str):
  """The page's preset loaded with overrides, computing in float32."""
  return meshlm.load_config("train.compute_dtype=float32", *overrides, base=preset())


def _module(name: str, source: str) -> types.ModuleType:
  module = types.ModuleType(name)
  exec(compile(source, f"docs/adding-a-part.md ({name})", "exec"), module.__dict__)
  return module


@dataclasses.dataclass(frozen=True)
class Example:
  mixer: types.ModuleType  # the page's models/mixers/mean.py
  family: types.ModuleType  # its models/mean_llama.py


@contextlib.contextmanager
def registered():
  """The page's mixer and family as modules (sys.modules) and its registry lines in registry.PARTS and FAMILIES,
  for the with-block only: each run executes the blocks anew, and on exit every entry is undone. The cached
  programs and resolved Models are dropped on entry and exit, so none traced with another registration of the
  same names (an earlier test's, or a patched family) is reused, and none outlives the registration."""
  b = blocks()
  mp = pytest.MonkeyPatch()
  api.clear_programs()
  try:
    mixer = _module("meshlm.models.mixers.mean", b[MIXER])
    mp.setitem(sys.modules, mixer.__name__, mixer)
    family = _module("meshlm.models.mean_llama", b[FAMILY])
    mp.setitem(sys.modules, family.__name__, family)
    lines: dict = {}
    exec(b[REGISTRY], lines)
    for table in ("PARTS", "FAMILIES"):
      for k, v in lines[table].items():
        mp.setitem(getattr(registry, table), k, v)
    yield Example(mixer, family)
  finally:
    mp.undo()
    api.clear_programs()
