"""Multi-process runs: `jax.distributed.initialize` from the `distributed.*` keys.

It must run after `set_cpu_devices` and before anything touches devices: JAX builds its device
list (local and global) once, at backend start. docs/multihost.md shows how to launch.
"""
from __future__ import annotations

import socket
import time

from meshlm.config import Config
from meshlm.errors import ConfigError


def _wait_for_coordinator(address: str, timeout_s: int) -> None:
  """Blocks until something accepts TCP connections at HOST:PORT, or raises a ConfigError.

  Why probe first: when the coordinator never answers, JAX's client aborts the whole process from
  C++ (a fatal log, no Python exception), so the user would get a stack trace, not a message.
  """
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  last = "no answer"
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      raise ConfigError(f"distributed.coordinator={address}: no answer within {timeout_s} s "
                        f"(distributed.timeout_s; last error: {last}); start process 0 first and check the "
                        "address is reachable from this host")
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=min(left, 2.0)):
        return
    except OSError as e:
      last = e.strerror or type(e).__name__
      time.sleep(min(0.2, max(left, 0)))


def _check_port_free(address: str) -> None:
  """Process 0 serves the coordinator on PORT; a port in use would also abort inside JAX."""
  port = int(address.rpartition(":")[2])
  with socket.socket(socket.AF_INET6 if ":" in address.rpartition(":")[0] else socket.AF_INET) as s:
    # SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is fine; a live listener is not.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("", port))
    except OSError as e:
      raise ConfigError(f"distributed.coordinator={address}: process 0 cannot serve on port {port} "
                        f"({e.strerror}); pick a free port") from None


def init_distributed(cfg: Config) -> None:
  """Joins this process to the others, if the config asks for it; a no-op otherwise.

  Explicit: distributed.coordinator/num_processes/process_id. Auto: distributed.auto=true lets JAX
  read the cluster from the environment (SLURM, Cloud TPU, Open MPI).
  """
  d = cfg.distributed
  if not d.enabled:
    return
  import jax
  if d.auto:
    try:
      jax.distributed.initialize(initialization_timeout=d.timeout_s)
    except (ValueError, RuntimeError) as e:
      # JAX raises ValueError when no cluster environment is found.
      raise ConfigError(f"distributed.auto=true: JAX found no cluster to join ({str(e).splitlines()[0]}); "
                        "set distributed.coordinator, distributed.num_processes and distributed.process_id") from None
    return
  if d.process_id == 0:
    _check_port_free(d.coordinator)
  else:
    _wait_for_coordinator(d.coordinator, d.timeout_s)
  try:
    jax.distributed.initialize(coordinator_address=d.coordinator, num_processes=d.num_processes,
                               process_id=d.process_id, initialization_timeout=d.timeout_s)
  except RuntimeError as e:
    raise ConfigError(f"distributed.coordinator={d.coordinator}: cannot join as process {d.process_id} of "
                      f"{d.num_processes} ({str(e).splitlines()[0]})") from None
