"""The TPU set-up in the repository (docs/tpu.md "Setting up"): the platform `make train` picks, and the offline
install script and its pinned set. Shell only: nothing here starts JAX or installs anything."""
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The environment of a user's shell: no JAX_PLATFORMS (conftest sets it for the tests), no parent make's flags.
ENV = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}


def _pci(tmp_path: Path, *devices: tuple[str, str]) -> str:
  """A fake /sys/bus/pci/devices holding one function per (vendor, device)."""
  for i, (vendor, device) in enumerate(devices):
    d = tmp_path / "pci" / f"0000:00:{i + 4:02x}.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
  (tmp_path / "pci").mkdir(exist_ok=True)
  return str(tmp_path / "pci")


@pytest.mark.parametrize("devices,jax_platforms,expected", [
    ((), None, "cpu"),
    ((("0x1ae0", "0x0042"), ("0x8086", "0x0063")), None, "cpu"),  # Google's gVNIC; another vendor's 0x0063
    ((("0x1ae0", "0x0042"), ("0x1ae0", "0x0063")), None, "tpu"),  # a TPU v5e chip
    ((("0x1ae0", "0x0062"),), "cpu", "cpu"),  # JAX_PLATFORMS, when set, is kept
])
def test_platform_script(tmp_path, devices, jax_platforms, expected):
  env = {**ENV, "MESHLM_PCI": _pci(tmp_path, *devices)}
  if jax_platforms:
    env["JAX_PLATFORMS"] = jax_platforms
  out = subprocess.run(["sh", "scripts/platform.sh"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == expected


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("tpu", [True, False])
def test_make_train_runs_on_the_chip_of_a_tpu_machine_and_on_cpu_elsewhere(tmp_path, tpu):
  """`make -n -B train` (prints every command it would run, runs none): on a TPU machine the tpu extra is installed
  and the demo runs with JAX_PLATFORMS=tpu; elsewhere with JAX_PLATFORMS=cpu and no libtpu."""
  env = {**ENV, "MESHLM_PCI": _pci(tmp_path, *([("0x1ae0", "0x0063")] if tpu else []))}
  out = subprocess.run(["make", "-n", "-B", "train"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  train = [line for line in out.stdout.splitlines() if "meshlm train" in line]
  assert train == [f"JAX_PLATFORMS={'tpu' if tpu else 'cpu'} .venv/bin/meshlm train model=llama2-tiny train.steps=600"]
  assert ("requirements-tpu.lock" in out.stdout) is tpu


def test_tpu_install_script_parses_and_names_a_missing_wheel(tmp_path):
  assert subprocess.run(["bash", "-n", "scripts/tpu_install.sh"], cwd=ROOT).returncode == 0
  (tmp_path / "wheels").mkdir()
  (tmp_path / "wheels" / "grain-0.2.18-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
  out = subprocess.run(["bash", "scripts/tpu_install.sh", str(tmp_path / "site"), str(tmp_path / "wheels")], cwd=ROOT,
                       env={**ENV, "INDEX": "file:///nowhere", "PYTHON": "false"}, capture_output=True, text=True)
  assert out.returncode == 1
  assert out.stderr.strip() == (f"tpu_install: no array_record wheel in {tmp_path / 'wheels'} (docs/tpu.md, "
                                "'Setting up', says how to fetch it)")


def _uncovered(dependencies: list[str]) -> list[str]:
  """The dependencies that the offline set (scripts/tpu_offline.lock, the carried wheels, the machine's own JAX and
  numpy) leaves out, by normalized name."""
  norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
  pinned = {norm(line.split("==")[0]) for line in (ROOT / "scripts/tpu_offline.lock").read_text().splitlines()
            if line and not line.startswith("#")}
  covered = pinned | {"grain", "array_record", "portpicker", "jax", "numpy"}
  names = [norm(re.match(r"[A-Za-z0-9_.-]+", d).group()) for d in dependencies]
  return [n for n in names if n not in covered]


def test_the_offline_set_covers_every_dependency():
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  assert _uncovered(deps) == []
  assert _uncovered([*deps, "sentencepiece>=0.2"]) == ["sentencepiece"]  # a new dependency would fail it
