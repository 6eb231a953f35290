"""Parameter specs: every parameter declared once, with shape, logical axes and initializer."""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"  # normal | ones | zeros
  fan_in: int = 1  # normal draws have std = scale / sqrt(fan_in)
  scale: float = 1.0

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def kernel(shape: tuple[int, ...], axes: tuple[str | None, ...], n_in: int = 1) -> ParamSpec:
  """A dense kernel whose first n_in dims are contracted with the input."""
  return ParamSpec(tuple(shape), tuple(axes), "normal", fan_in=math.prod(shape[:n_in]))


def ones(dim: int, axis: str = "act_embed") -> ParamSpec:
  return ParamSpec((dim,), (axis,), "ones")


def zeros(dim: int, axis: str = "act_embed") -> ParamSpec:
  return ParamSpec((dim,), (axis,), "zeros")


def stack(tree: Any, n: int, axis: int) -> Any:
  """Stacks a layer's specs n times along a new "layers" axis at position axis (0 or 1)."""
  def one(s: ParamSpec) -> ParamSpec:
    a = min(axis, len(s.shape))
    return dataclasses.replace(s, shape=s.shape[:a] + (n,) + s.shape[a:], axes=s.axes[:a] + ("layers",) + s.axes[a:])
  return jax.tree.map(one, tree, is_leaf=is_spec)


def is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def _layer_axis(s: ParamSpec) -> int | None:
  return s.axes.index("layers") if "layers" in s.axes else None


def init_leaf(s: ParamSpec, key: jax.Array, dtype) -> jax.Array:
  if s.init == "ones":
    return jnp.ones(s.shape, dtype)
  if s.init == "zeros":
    return jnp.zeros(s.shape, dtype)
  # Draw with the layer axis leading, whatever the storage order, so that param_scan_axis 0 and 1
  # hold the same numbers.
  la = _layer_axis(s)
  shape = s.shape if la in (None, 0) else (s.shape[la],) + s.shape[:la] + s.shape[la + 1:]
  x = jax.random.normal(key, shape, jnp.float32) * (s.scale / math.sqrt(s.fan_in))
  if la not in (None, 0):
    x = jnp.moveaxis(x, 0, la)
  return x.astype(dtype)


def path_key(key: jax.Array, path) -> jax.Array:
  name = jax.tree_util.keystr(path)
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def init_tree(specs: Any, key: jax.Array, dtype) -> Any:
  return jax.tree_util.tree_map_with_path(lambda p, s: init_leaf(s, path_key(key, p), dtype), specs,
                                          is_leaf=is_spec)


def count(specs: Any) -> int:
  return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
  return jax.tree.map(fn, specs, is_leaf=is_spec)
