"""tests/conftest.py's CI rule: under CI=true a skipped golden, parity or HF test fails the run."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SKIPS = """import pytest

def test_skips():
  pytest.skip("fixture missing")
"""
MARKED = """import pytest

@pytest.mark.ci_must_run
def test_marked_skips():
  pytest.skip("fixture missing")

@pytest.mark.skipif(True, reason="not here")
@pytest.mark.ci_must_run
def test_marked_skipif():
  pass

def test_unmarked_skips():
  pytest.skip("optional")
"""


def _run(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
  # A fresh rootdir (no ini, so no xdist addopts) whose conftest is this suite's.
  (tmp_path / "conftest.py").write_text(f"exec(compile(open({os.path.join(HERE, 'conftest.py')!r}).read(), "
                                        f"'conftest.py', 'exec'))\n")
  (tmp_path / "test_conformance.py").write_text(SKIPS)  # a file counted by name
  (tmp_path / "test_other.py").write_text(MARKED)
  # Not the suite: no CI of the caller, and no compile log (tests/compile_log.py is not beside the copied conftest).
  env = {k: v for k, v in os.environ.items() if k not in ("CI", "MESHLM_TEST_COMPILE_LOG")}
  if ci is not None:
    env["CI"] = ci
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "no:xdist",
                         str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_under_ci_a_skip_of_a_must_run_test_fails(tmp_path):
  r = _run(tmp_path, "true")
  assert r.returncode == 1, r.stdout + r.stderr
  assert "2 failed, 1 skipped, 1 error" in r.stdout, r.stdout  # skipif skips in setup: an error
  assert "test_conformance.py::test_skips is a golden/parity/HF test (ci_must_run) and must not skip" in r.stdout
  assert "it skipped: fixture missing" in r.stdout


def test_outside_ci_they_skip(tmp_path):
  r = _run(tmp_path, None)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "4 skipped" in r.stdout, r.stdout
