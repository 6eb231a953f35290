"""The suite's own settings (tests/conftest.py): Hypothesis is derandomized and writes no database."""
import os

import pytest
from hypothesis import settings

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_hypothesis_runs_derandomized_by_default():
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci":
    pytest.skip("HYPOTHESIS_PROFILE names another profile: a deliberate exploring run")
  assert settings.default.derandomize is True
  assert settings.default.database is None


def test_hypothesis_directory_is_ignored():
  with open(os.path.join(ROOT, ".gitignore")) as f:
    assert ".hypothesis/" in f.read().split()


def test_the_heaviest_files_are_handed_out_first(tmp_path):
  """conftest orders the collected items by tests/file_durations.json, heaviest file first, keeping
  the order inside a file; an unmeasured file goes last."""
  import json
  import pathlib
  import types
  import conftest
  root = pathlib.Path(conftest.__file__).parent.parent
  table = json.loads((root / "tests" / "file_durations.json").read_text())
  heavy, light = sorted(table, key=table.get, reverse=True)[0], sorted(table, key=table.get)[0]
  items = [types.SimpleNamespace(path=root / p, name=n) for p, n in
           [(light, "a"), ("tests/test_unmeasured_file.py", "b"), (heavy, "c"), (heavy, "d")]]
  config = types.SimpleNamespace(rootpath=root)
  conftest.heaviest_first(config, items)
  assert [i.name for i in items] == ["c", "d", "a", "b"]
