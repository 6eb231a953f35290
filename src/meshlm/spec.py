"""Parameter specs: every parameter declared once, with shape, logical axes and initializer."""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# Every logical axis a parameter or an activation may name. parallel/sharding.RULES maps each to mesh axes and
# is held equal to this set at import; the set lives here, below parallel/, so that a ParamSpec can check its
# axes when it is built: a misspelt name would otherwise fail only once a mesh exists.
LOGICAL_AXES = frozenset({"batch", "length", "act_embed", "embed", "vocab", "mlp", "heads", "kv_heads",
                          "head_dim", "layers", "experts", "experts_fsdp", "mlp_fsdp", "latent"})


def check_axes(names: tuple[str | None, ...], what: str) -> None:
  """Raises ValueError naming the first of `names` that is neither None nor a known logical axis."""
  for name in names:
    if name is not None and name not in LOGICAL_AXES:
      raise ValueError(f"{what}: unknown logical axis {name!r}; known: {', '.join(sorted(LOGICAL_AXES))} "
                       "(a new one needs a rule in parallel/sharding.RULES and a name in spec.LOGICAL_AXES)")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"  # normal | ones | zeros
  fan_in: int = 1  # normal draws have std = scale / sqrt(fan_in)
  scale: float = 1.0
  decay: bool = True  # False: AdamW's weight decay skips it (GDN's A_log, dt_bias)

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)
    check_axes(self.axes, f"ParamSpec{self.shape} with axes {self.axes}")


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


def init_leaf_host(s: ParamSpec, seed: tuple[int, ...], path) -> np.ndarray:
  """The same draw rule as init_leaf, on the host with numpy (no compile), float32."""
  if s.init in ("ones", "zeros"):
    return (np.ones if s.init == "ones" else np.zeros)(s.shape, np.float32)
  rng = np.random.default_rng([*seed, _path_hash(path)])
  la = _layer_axis(s)
  shape = s.shape if la in (None, 0) else (s.shape[la],) + s.shape[:la] + s.shape[la + 1:]
  x = rng.standard_normal(shape, np.float32) * np.float32(s.scale / math.sqrt(s.fan_in))
  return np.moveaxis(x, 0, la) if la not in (None, 0) else x


def _path_hash(path) -> int:
  return zlib.crc32(jax.tree_util.keystr(path).encode()) & 0x7FFFFFFF


def path_key(key: jax.Array, path) -> jax.Array:
  return jax.random.fold_in(key, _path_hash(path))


def init_tree(specs: Any, key: jax.Array, dtype) -> Any:
  return jax.tree_util.tree_map_with_path(lambda p, s: init_leaf(s, path_key(key, p), dtype), specs,
                                          is_leaf=is_spec)


def vector(dim: int, init: str, decay: bool = True) -> ParamSpec:
  """A per-head vector [dim] (no mesh axis), initialized to ones or zeros."""
  return ParamSpec((dim,), (None,), init, decay=decay)


def no_decay_mask(specs: Any) -> Any | None:
  """True for each leaf kept out of weight decay (ParamSpec.decay=False); None when no leaf is."""
  mask = map_specs(lambda s: not s.decay, specs)
  return mask if any(jax.tree.leaves(mask)) else None


def count(specs: Any) -> int:
  return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
  return jax.tree.map(fn, specs, is_leaf=is_spec)
