"""What the kernel keys of the config accept and refuse: a splash block (sa_block_*: auto or a multiple of the
kernel's 128 lanes) and the splash core over a sequence split on mesh.context. Imported by the schema and by
nn/attention (which checks a mesh the config did not ask for); imports nothing of meshlm."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator


def _splash_block(v):
  if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 128 or v % 128):
    raise ValueError(f"{v!r}: expected auto or a multiple of 128 (the kernel's lanes)")
  return v


# A splash block key: auto or a multiple of 128.
SplashBlock = Annotated[Union[Literal["auto"], int], AfterValidator(_splash_block)]


def splash_refusal(attention_impl: str, context: int) -> str | None:
  """The refusal of the splash core over mesh.context > 1, or None: the config's check, and nn/attention's for a
  mesh of context shards that a config did not ask for (a jax.set_mesh around meshlm.forward)."""
  if attention_impl == "splash" and context > 1:
    return (f"attention_impl=splash with mesh.context={context}: the splash kernel does not split the sequence over "
            "mesh.context; use attention_impl=flash (or auto)")
  return None
