"""The devices of a topology to compile for: a TPU slice this machine does not have, or fake CPU devices.

`topology=NAME` (meshlm compile) names them:
  cpu:N          N fake host devices (cpu_devices=N); no extra package
  v5p:2x2x1      a TPU slice by chip grid, as libtpu spells it (v4, v5e, v5p, v6e, tpu7x)
  v5p-8          the same by Cloud TPU accelerator type: v4, v5p and tpu7x count TensorCores (two per
                 chip), v5e and v6e count chips; the common slice shapes only (SLICES)

A TPU topology's devices come from `jax.experimental.topologies.get_topology_desc`, which needs the `libtpu`
wheel (`pip install 'meshlm[tpu]'`) and no TPU: the devices can be compiled for, never run on. Nothing here
starts a TPU runtime.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

from meshlm.errors import ConfigError, UsageError

# Cloud TPU accelerator types -> chip grids, for the slice sizes Google documents (the rest: give the grid).
_GRID3 = {1: "1x1x1", 2: "1x1x2", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
          256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_GRID2 = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# version in the accelerator type -> (libtpu's name, cores counted per chip in the type's number, grids)
SLICES = {"v4": ("v4", 2, _GRID3), "v5p": ("v5p", 2, _GRID3), "tpu7x": ("tpu7x", 2, _GRID3),
          "v5e": ("v5e", 1, _GRID2), "v5litepod": ("v5e", 1, _GRID2), "v6e": ("v6e", 1, _GRID2)}
_GRID_NAME = re.compile(r"^([a-z0-9]+)[:=_]((\d+x)*\d+)$")
_TYPE_NAME = re.compile(r"^([a-z0-9]+)-(\d+)$")
_CPU_NAME = re.compile(r"^cpu[:\-](\d+)$")
# What a GPU topology looks like (gpu:8, h100:8, a100-8, b200:4, mi300x:8): refused as one, not passed to libtpu.
_GPU_NAME = re.compile(r"^(gpu|cuda|rocm|[abhl]\d+\w*|gb\d+\w*|mi\d+\w*|rtx\w*)([:\-_=]\d+(x\d+)*)?$")
# What libtpu reads at start-up about the host it runs on. There is none (we only compile): saying so keeps
# it from probing the metadata server and printing a warning per missing variable. Nor is there a TPU for two
# processes to share, so the lock file libtpu takes against that (/tmp/libtpu_lockfile) would only keep a
# second compile (another test worker, another shell) from starting.
_QUIET_LIBTPU = {"TPU_SKIP_MDS_QUERY": "1", "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost",
                 "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@dataclasses.dataclass(frozen=True)
class Topology:
  """name: as the user typed it; platform: "tpu" or "cpu"; grid: libtpu's name ("v5p:2x2x1"), None on CPU;
  chips: chips in the grid (CPU: the devices)."""
  name: str
  platform: str
  grid: str | None
  chips: int


def parse(name: str) -> Topology:
  """The topology a name stands for; a ConfigError naming topology= for one that is not."""
  n = name.strip().lower()
  if _GPU_NAME.match(n):
    raise ConfigError(f"topology={name}: a GPU; meshlm compile compiles for TPU slices (libtpu's compile-only "
                      "devices: v4, v5e, v5p, v6e, tpu7x) and fake CPU devices (cpu:N) only, as a GPU program needs "
                      "its GPUs to compile; on the GPU machine, meshlm census and bench compile the same step")
  m = _CPU_NAME.match(n)
  if m:
    if int(m.group(1)) < 1:
      raise ConfigError(f"topology={name}: needs at least one device (cpu:N)")
    return Topology(name, "cpu", None, int(m.group(1)))
  m = _TYPE_NAME.match(n)
  if m and m.group(1) in SLICES:
    version, count = m.group(1), int(m.group(2))
    lib, per_chip, grids = SLICES[version]
    chips = count // per_chip if count % per_chip == 0 else None
    if chips not in grids:
      sizes = ", ".join(f"{version}-{c * per_chip}" for c in list(grids)[:8])
      raise ConfigError(f"topology={name}: no standard {version} slice of {count} "
                        f"{'TensorCores' if per_chip == 2 else 'chips'} (known: {sizes}, ...); give the chip grid "
                        f"instead, e.g. topology={lib}:{grids[4]}")
    return Topology(name, "tpu", f"{lib}:{grids[chips]}", chips)
  m = _GRID_NAME.match(n)
  if m:
    lib = SLICES.get(m.group(1), (m.group(1),))[0]
    return Topology(name, "tpu", f"{lib}:{m.group(2)}", math.prod(int(d) for d in m.group(2).split("x")))
  raise ConfigError(f"topology={name}: expected cpu:N (fake host devices), a TPU chip grid such as v5p:2x2x1 or "
                    "tpu7x:4x4x8, or an accelerator type such as v5p-8 or v6e-8")


def has_libtpu() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def devices(topo: Topology) -> list:
  """The topology's devices. CPU: the first N host devices (asks JAX for N fake ones when it has not started).
  TPU: compile-only devices from libtpu; a UsageError in one line when libtpu is not installed."""
  import jax
  if topo.platform == "cpu":
    from meshlm.parallel.mesh import set_cpu_devices
    set_cpu_devices(topo.chips)
    found = jax.devices("cpu")
    if len(found) < topo.chips:
      raise ConfigError(f"topology={topo.name}: JAX started with {len(found)} CPU devices; run with "
                        f"topology=cpu:{len(found)} or fewer, or set it before JAX starts")
    return found[:topo.chips]
  if not has_libtpu():
    raise UsageError(f"topology={topo.name}: compiling for TPU needs libtpu, which is not installed "
                     "(pip install 'meshlm[tpu]'); topology=cpu:N compiles for fake CPU devices without it")
  for k, v in _QUIET_LIBTPU.items():
    os.environ.setdefault(k, v)
  try:
    jax.config.update("jax_platforms", "cpu")  # the host's backend; the TPU devices are compile-only
  except RuntimeError:
    pass
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topo.grid).devices)
  except Exception as e:  # libtpu's own words: an unknown chip, a grid it cannot lay out
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f"topology={topo.name}: libtpu refuses it: {msg.removeprefix('INVALID_ARGUMENT: ')}") from None
