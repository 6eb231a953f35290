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


def test_one_fresh_compilation_cache_per_run_shared_with_subprocesses():
  """conftest points every test process at one compilation cache made for this run (MESHLM_TEST_COMPILE_CACHE),
  which a subprocess inherits, and a program compiled twice under new jit objects hits it the second time."""
  import subprocess
  import sys
  import jax
  import jax.numpy as jnp
  from jax import monitoring
  if os.environ.get("MESHLM_TEST_COMPILE_CACHE") == "off":
    pytest.skip("MESHLM_TEST_COMPILE_CACHE=off: a deliberate run without the shared cache")
  cache = os.environ["MESHLM_TEST_COMPILE_CACHE"]
  assert os.path.basename(cache).startswith("meshlm-test-compile-cache-") and os.path.isdir(cache)
  assert jax.config.jax_compilation_cache_dir == cache
  child = subprocess.run([sys.executable, "-c", "import jax; print(jax.config.jax_compilation_cache_dir)"],
                         capture_output=True, text=True, check=True, env=dict(os.environ))
  assert child.stdout.strip() == cache
  from jax._src import monitoring as jax_monitoring
  hits = []
  listener = lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None
  monitoring.register_event_listener(listener)
  # Lower the 1 s threshold for this one small program, compile it under two jit objects, expect one hit
  # (a negative control of sorts: the first compile of a program never hits a fresh cache).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  try:
    x = jnp.arange(7.0)
    for _ in range(2):
      jax.jit(lambda v: jnp.cumsum(jnp.sin(v) * 3.25) - 0.125)(x).block_until_ready()
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax_monitoring.unregister_event_listener(listener)
  assert len(hits) == 1, hits
