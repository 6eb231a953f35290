"""Building the device mesh from the config. The shard mode is the mesh's axis type."""
from __future__ import annotations

import math

from meshlm.config import Config
from meshlm.errors import ConfigError

AXES = ("data", "fsdp", "tensor", "expert", "context")


def set_cpu_devices(n: int | None) -> None:
  """Asks for n fake host devices. Must run before JAX starts its backends."""
  if n is None:
    return
  import jax
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # backends already up (tests, notebooks): fine if the count is enough
    if len(jax.devices()) < n:
      raise ConfigError(f"cpu_devices={n}: JAX already started with {len(jax.devices())} devices; "
                        "set cpu_devices before anything imports and runs JAX") from None
  try:
    jax.config.update("jax_platforms", "cpu")  # fake devices are host devices
  except RuntimeError:
    pass


def resolve_mesh_shape(cfg: Config, num_devices: int, devices_key: str = "cpu_devices=N") -> dict[str, int]:
  """Mesh axis sizes with -1 filled; a clear ConfigError if they do not divide the devices. devices_key: how the
  command sets its device count, named in the error (meshlm compile: topology=cpu:N)."""
  sizes = cfg.mesh.sizes()
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if num_devices % fixed:
      raise ConfigError(f"mesh: the fixed axes ({_fmt(sizes, skip=-1)}) multiply to {fixed}, which does not divide "
                        f"the {num_devices} devices")
    sizes = {k: (num_devices // fixed if s == -1 else s) for k, s in sizes.items()}
  elif fixed != num_devices:
    raise ConfigError(f"mesh: {_fmt(sizes)} needs {fixed} devices but {num_devices} are in use "
                      f"(set {devices_key}, or make one axis -1)")
  return sizes


def _fmt(sizes: dict[str, int], skip: int = 1) -> str:
  # Named as the user types them (mesh.fsdp=3), so the message points at the keys to change.
  return ",".join(f"mesh.{k}={v}" for k, v in sizes.items() if v not in (1, skip)) or "all 1"


def num_devices_for(cfg: Config) -> int:
  import jax
  available = len(jax.devices())
  # cpu_devices counts this process's devices; with several processes the mesh spans all of theirs.
  n = cfg.cpu_devices * jax.process_count() if cfg.cpu_devices else available
  if n > available:
    raise ConfigError(f"cpu_devices={n}: only {available} devices exist in this process")
  return n


def make_mesh(cfg: Config, devices=None):
  """The jax Mesh for cfg: axis types Explicit or Auto, on the first N devices, or on all of `devices` (a
  topology's, which may be compile-only: meshlm compile)."""
  import jax
  from jax.sharding import AxisType
  if devices is None:
    n = num_devices_for(cfg)
    devices = jax.devices()[:n]
  sizes = resolve_mesh_shape(cfg, len(devices))
  kind = AxisType.Explicit if cfg.shard_mode == "explicit" else AxisType.Auto
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(kind,) * len(AXES), devices=list(devices))


def mesh_of(tree):
  """The mesh the first array of `tree` with a NamedSharding on a meshlm mesh lives on, else None (arrays
  on one device, numpy, or a mesh without meshlm's axes)."""
  import jax
  from jax.sharding import NamedSharding
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and set(AXES) <= set(sharding.mesh.axis_names):
      return sharding.mesh
  return None


def resolve_mesh(cfg: Config, tree=None, mesh=None):
  """Where a Python API call (forward, generate, hf.load) runs: `mesh` when given, else the mesh of an
  enclosing `jax.set_mesh`, else the mesh `tree`'s arrays live on, else the config's (make_mesh)."""
  import jax
  if mesh is None:
    current = jax.sharding.get_mesh()
    mesh = None if current.empty else current
  if mesh is None:
    return mesh_of(tree) or make_mesh(cfg)
  missing = [a for a in AXES if a not in mesh.axis_names]
  if missing:
    raise ConfigError(f"mesh: axes {tuple(mesh.axis_names)} lack meshlm's {', '.join(missing)}; meshlm runs on a mesh "
                      f"with axes {', '.join(AXES)} (meshlm.parallel.make_mesh(cfg), or jax.make_mesh with those names)")
  return mesh
