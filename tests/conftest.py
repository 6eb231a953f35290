"""Every test process sees 8 fake CPU devices (MESHLM_TEST_DEVICES=N: N); meshes use the first N they need. Hypothesis runs
derandomized (profile "ci") unless HYPOTHESIS_PROFILE names another, e.g. "explore". Every process of
one run shares one compilation cache that starts empty."""
import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tiny test programs spend their time compiling, not running: without LLVM's optimization
# passes XLA:CPU compiles them about 30% faster (tests/test_moe.py: 89.7 -> 61.9 CPU s). HLO passes
# still run, so the compiled HLO the census counts is the same. Subprocesses inherit it.
# Benchmarks never set it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# One persistent compilation cache per run, shared by the xdist workers and every subprocess the tests
# start (`meshlm train` runs inherit the environment): a program that several files, tests or processes
# build (the same tiny `meshlm train` config, two processes of a multi-process run, a step rebuilt after
# jax.clear_caches()) compiles once per run. The controller makes it empty and removes it at exit, so every
# run is cold; a user's own JAX_COMPILATION_CACHE_DIR is not used. Entries are written under the cache's
# file lock (a max size turns it on), so a worker never reads another's half-written entry. Only programs
# that took at least 1 s to compile are written: the rest cost less to compile than to store.
# Measured, docs/test-durations.md: the files that start `meshlm train` subprocesses, -n 0, 97 s of XLA
# compile in the pytest process without the cache and 55 s with it (146 -> 125 s user CPU in all).
# MESHLM_TEST_COMPILE_CACHE=off runs without it (every process compiles everything itself).
COMPILE_CACHE = {}
if os.environ.get("MESHLM_TEST_COMPILE_CACHE") != "off":
  if "MESHLM_TEST_COMPILE_CACHE" not in os.environ:
    os.environ["MESHLM_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="meshlm-test-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["MESHLM_TEST_COMPILE_CACHE"], True)
  COMPILE_CACHE = {"jax_compilation_cache_dir": os.environ["MESHLM_TEST_COMPILE_CACHE"],
                   "jax_persistent_cache_min_compile_time_secs": 1.0, "jax_persistent_cache_min_entry_size_bytes": 0,
                   "jax_compilation_cache_max_size": 16 << 30}
  os.environ.update({k.upper(): str(v) for k, v in COMPILE_CACHE.items()})

import jax  # noqa: E402

for _key, _value in COMPILE_CACHE.items():  # also when jax was imported before this file
  jax.config.update(_key, _value)
# MESHLM_TEST_DEVICES=N: a process with N devices instead (tests/test_conformance_devices.py runs the public-API
# conformance on 1, a user's default).
DEVICES = int(os.environ.get("MESHLM_TEST_DEVICES", "8"))
jax.config.update("jax_num_cpu_devices", DEVICES)
# Start the backend now: a later cpu_devices=N in some test's config must find it running (and then
# only checks the count) rather than set the device count for every test after it.
assert len(jax.devices()) == DEVICES

from hypothesis import settings  # noqa: E402

# The same examples on every run and worker: a red suite reproduces, and none turns red by luck.
# database=None: a derandomized run has no failures of earlier runs to replay. (Hypothesis still
# caches source constants in .hypothesis/, which .gitignore lists.)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
# Random examples, for looking for new failures by hand: HYPOTHESIS_PROFILE=explore make test.
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# --- Under CI (CI=true), a skipped golden, parity or HF test fails the run --------------------------
# A skip there would switch a check off without a word: the golden census comparisons skip on a JAX
# other than the one requirements.lock pins, and a missing fixture or family would skip parity. The
# tests that count: every test in CI_MUST_RUN_FILES (tests/golden/ is read by test_analysis.py) and
# any test marked @pytest.mark.ci_must_run. Outside CI they skip as before.
import pytest  # noqa: E402

CI_MUST_RUN_FILES = ("test_analysis.py", "test_conformance.py", "test_conformance_devices.py", "test_hf.py",
                     "test_hf_qwen3_next.py")


def _under_ci() -> bool:
  return os.environ.get("CI", "").strip().lower() in ("true", "1")


def pytest_configure(config):
  if os.environ.get("MESHLM_TEST_COMPILE_LOG"):
    # Every test's CPU seconds and compiles into that folder (tests/compile_log.py, found beside this file).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_log
    compile_log.register(config)
  config.addinivalue_line("markers", "ci_must_run: under CI=true a skip of this test fails the run")
  config.addinivalue_line("markers", "tiny_preset: a tiny preset's public-API conformance row, a 1-device user's "
                          "calls in every process (tests/test_conformance.py)")


def pytest_collection_modifyitems(session, config, items):
  for item in items:
    if item.path.name in CI_MUST_RUN_FILES:
      item.add_marker("ci_must_run")
  heaviest_first(config, items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if report.skipped and not hasattr(report, "wasxfail") and _under_ci() and item.get_closest_marker("ci_must_run"):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (f"CI=true: {item.nodeid} is a golden/parity/HF test (ci_must_run) and must not skip; "
                       f"it skipped: {reason}")


# Heaviest files first. Each file runs on one xdist worker (--dist loadfile), handed out in collection
# order; collected alphabetically, the slow MoE and parity files would start last and one worker would
# idle at the end. tests/file_durations.json (scripts/record_test_durations.py) holds each file's
# measured seconds; a file missing from it goes after the measured ones.
def heaviest_first(config, items):
  import json
  import pathlib
  table = pathlib.Path(__file__).with_name("file_durations.json")
  weights = json.loads(table.read_text()) if table.exists() else {}
  root = pathlib.Path(str(config.rootpath))

  def weight(item):
    rel = pathlib.Path(str(item.path)).relative_to(root).as_posix()
    return -weights.get(rel, -1.0)
  items.sort(key=weight)  # stable: the order inside a file is kept
