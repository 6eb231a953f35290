"""The public-API conformance (tests/test_conformance.py) in a process with 1 device: a user's default is one device
and no cpu_devices, while every other test process has 8 (tests/conftest.py, MESHLM_TEST_DEVICES). The process runs
that module but its tiny_preset rows, which are a 1-device user's calls in every process and so the suite's own
process runs them (none runs twice); which fixture rows it holds follows from its device count, and a skip there
fails here as a failure would. A user of several devices outside any mesh context is the 8-device process's (a
4-device user's calls, in and outside a jax.set_mesh; a 2-device process ran the same rows and was dropped to keep
the suite in budget)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.ci_must_run
def test_the_public_api_conformance_in_a_process_with_one_device():
  devices = 1
  env = dict(os.environ, MESHLM_TEST_DEVICES=str(devices))
  r = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", "-rfEs",
                      "--durations=5", "-m", "not tiny_preset", str(HERE / "test_conformance.py")],
                     env=env, cwd=HERE.parent, capture_output=True, text=True)
  print(r.stdout[-4000:])
  assert r.returncode == 0, f"{devices}-device conformance failed:\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
  summary = r.stdout.strip().splitlines()[-1]
  passed = re.search(r"(\d+) passed", summary)
  assert passed and int(passed.group(1)) > 20, summary
  assert not re.search(r"skipped|failed|error", summary), summary
  assert re.search(r"\d+ deselected", summary), summary  # the tiny_preset rows, which the suite runs once
