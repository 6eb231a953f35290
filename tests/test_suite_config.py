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
