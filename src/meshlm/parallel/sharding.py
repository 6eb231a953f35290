"""Logical axes -> mesh axes, and constrain(): the one switch between explicit and auto.

Sharding is data: parameters and activations name their dimensions with logical axes, and the
single table RULES says which mesh axes shard each one. A dimension whose size the mesh axes do not
divide stays whole, so odd shapes (a batch of 1, 1 KV head on tensor=2) never fail to shard. A
model dimension left whole that way is warned about once (ShardingWarning): mesh.tensor=3 with 8
heads would otherwise silently run with replicated heads.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Sequence

import jax
from jax.sharding import AxisType, PartitionSpec as P

from meshlm import spec as S

Axes = Sequence[str | None]

# logical axis -> mesh axes. "embed" is the parameter embed dim (FSDP shards weights along it);
# activations carry "act_embed", which stays whole, as in levanter's parameter/compute split.
# Parameters shard over expert and context too (as MaxText's rules do): the batch is split over fsdp and expert
# and the sequence over context, so a kernel sharded over fsdp alone would be a replica on every expert and
# context device. Their dims take fsdp, then expert (the batch's device order), then context: a kernel is gathered
# whole before its dot either way, and the per-device parameters and AdamW state are the even split
# (tests/test_param_split.py). An expert kernel's experts dim has taken expert already; its embed dim gets the rest.
PARAM_STORAGE = ("fsdp", "expert", "context")  # the rule of a parameter dim split only to store it: embed, latent
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),
    "act_embed": (),
    "embed": PARAM_STORAGE,
    "vocab": ("tensor",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "layers": (),
    "experts": ("expert",),
    # The MoE kernels' layouts under FSDP (model.parts.moe.kernel_fsdp, nn/moe/layer.py moe_spec). "experts_fsdp": the experts
    # dim over mesh.expert and mesh.fsdp (expert-major), so a kernel's embed dim, which comes after it, finds both
    # used (it takes context, if any). "mlp_fsdp": down's mlp dim over fsdp (and tensor), its embed dim then what is
    # left (context, if any).
    "experts_fsdp": ("expert", "fsdp"),
    "mlp_fsdp": ("tensor", "fsdp"),
    # MLA's up-projection kernels' rank dim (q_b [Rq, N, Hn + Hr], k_b and v_b [Rkv, N, H]: models/mixers/mla.py), which
    # have no embed dim. The rank, not the heads: FSDP gathers the kernel whole before its dot and reduce-scatters its
    # gradient, the same bytes whichever dim is split (the rank being the contracted dim makes no partial sum: the
    # gathered kernel is whole), while the heads are tensor's dim (a compound name, and N / (tensor x fsdp) must
    # divide) and the ranks divide further: deepseek-v3's 1536 and 512 split over 256 devices, its 128 heads do not.
    # Measured (deepseek-v3-small, v5p:2x2x2, fsdp=8, seq 1024, remat=full, compiled for TPU): rank or heads, the same
    # collectives per step (74 all-gathers, 485 MiB; 7 all-reduces), 0 blocked transpose-of-dot pairs in both, peak
    # 0.545 / 0.543 GiB (tile rounding), estimated HBM traffic within 0.2%.
    "latent": PARAM_STORAGE,
}
# ParamSpec checks its axes against spec.LOGICAL_AXES (spec.py sits below parallel/): the two name one set.
if set(RULES) != S.LOGICAL_AXES:
  raise RuntimeError(f"sharding.RULES and spec.LOGICAL_AXES disagree: only in RULES {sorted(set(RULES) - S.LOGICAL_AXES)}, "
                     f"only in LOGICAL_AXES {sorted(S.LOGICAL_AXES - set(RULES))}")


def axes(*names: str | None) -> tuple[str | None, ...]:
  """The tuple of logical axis names, checked against RULES now: a module-level activation axes constant with a
  misspelt name fails at import, not only when a mesh exists (logical_spec)."""
  S.check_axes(names, f"activation axes {names}")
  return names


# The logical axes of the activations every layer passes on, and of the logits.
ACT = axes("batch", "length", "act_embed")
LOGITS = axes("batch", "length", "vocab")


# Per-call activation sizes: a batch of 1 (the end-of-run sample) or a short prompt staying whole is
# expected, and the data pipeline sizes training batches to divide. Everything else is a model shape.
UNWARNED = frozenset({"batch", "length"})
# (logical axis, mesh axis) drops that are a designed fallback, not a loss: when fsdp does not divide
# (mesh.expert x mesh.fsdp does not divide the experts), fsdp is left free and the kernel's embed dim takes it.
# A parameter dim that expert or context does not divide after fsdp stays a replica over them, as a kernel was
# before parameters sharded over those axes (mesh.expert=5 picks the experts' split, not embed's).
FALLBACKS = frozenset({("experts_fsdp", "fsdp"), ("embed", "expert"), ("embed", "context"), ("latent", "expert"),
                       ("latent", "context")})


class ShardingWarning(UserWarning):
  """A mesh axis asked to shard a model dimension it does not divide: the dimension stays whole."""


_warned: set[tuple[str, int, str, int]] = set()  # (mesh axis, its size, logical axis, dimension size)


def _warn_whole(mesh_axis: str, axis_size: int, name: str, size: int) -> None:
  key = (mesh_axis, axis_size, name, size)
  if name in UNWARNED or (name, mesh_axis) in FALLBACKS or key in _warned:
    return
  _warned.add(key)
  warnings.warn(f"mesh.{mesh_axis}={axis_size} does not divide the {name} dimension (size {size}): it stays whole, "
                f"replicated over mesh.{mesh_axis} instead of sharded; pick a mesh.{mesh_axis} that divides {size}",
                ShardingWarning, stacklevel=3)


def current_mesh():
  return jax.sharding.get_abstract_mesh()


def platform() -> str:
  """The platform ("cpu", "gpu", "tpu") the program being traced is for: its mesh's devices (a compile-only
  topology's under meshlm compile), else JAX's default backend."""
  device = getattr(current_mesh(), "abstract_device", None)
  return getattr(device, "platform", None) or jax.default_backend()


def device_kind() -> str | None:
  """The device kind ("TPU v5 lite", ...) the program being traced is for, as platform() finds it; None if unknown."""
  device = getattr(current_mesh(), "abstract_device", None)
  kind = getattr(device, "device_kind", None)
  if kind is None and jax.default_backend() == platform():
    kind = jax.devices()[0].device_kind
  return kind


def is_explicit() -> bool:
  mesh = current_mesh()
  return not mesh.empty and all(t == AxisType.Explicit for t in mesh.axis_types)


def context_size() -> int:
  """The current mesh's `context` axis size (1 with no mesh): how many shards the sequence is split into."""
  mesh = current_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get("context", 1)


def logical_spec(axes: Axes, shape: Sequence[int] | None = None, mesh=None) -> P:
  """PartitionSpec for logical axes. Mesh axes of size 1 and non-dividing axes are dropped. An unknown axis
  name is a ValueError with no mesh too, so a misspelt inline tuple fails in a one-device run."""
  S.check_axes(tuple(axes), f"logical axes {tuple(axes)}")
  mesh = current_mesh() if mesh is None else mesh
  if mesh.empty:
    return P()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  used: set[str] = set()
  parts = []
  for i, name in enumerate(axes):
    if name is None:
      parts.append(None)
      continue
    mesh_axes = [a for a in RULES[name] if sizes.get(a, 1) > 1 and a not in used]
    if shape is not None:
      # Keep the longest prefix of mesh axes whose product divides this dimension.
      while mesh_axes and shape[i] % math.prod(sizes[a] for a in mesh_axes):
        dropped = mesh_axes.pop()
        _warn_whole(dropped, sizes[dropped], name, shape[i])
    used.update(mesh_axes)
    parts.append(tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
  return P(*parts)


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
  """Pins x to its logical sharding: reshard under explicit, with_sharding_constraint under auto."""
  mesh = current_mesh()
  if mesh.empty:
    return x
  spec = logical_spec(axes, x.shape, mesh)
  if is_explicit():
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


def out_sharding(axes: Axes, shape: Sequence[int]) -> P | None:
  """The out_sharding= argument for einsum/gather under explicit; None under auto or with no mesh."""
  return logical_spec(axes, shape) if is_explicit() else None


def auto_region(fn, out_axes: Axes, out_shape: Sequence[int]):
  """fn with the mesh's axes made Auto for its duration (`jax.sharding.auto_axes`) under explicit
  sharding, its output pinned to out_axes. Inside, XLA sees no sharding barriers, so a dot and the
  transpose after it fold as they do under auto. Under auto it is fn followed by constrain."""
  if not is_explicit():
    return lambda *args: constrain(fn(*args), out_axes)
  return jax.sharding.auto_axes(fn, out_sharding=logical_spec(out_axes, out_shape))


def auto_region_many(fn, outs: Sequence[tuple[Axes, Sequence[int]]]):
  """auto_region for a fn returning a tuple: outs gives each output's (logical axes, shape)."""
  if not is_explicit():
    return lambda *args: tuple(constrain(y, axes) for y, (axes, _) in zip(fn(*args), outs))
  return jax.sharding.auto_axes(fn, out_sharding=tuple(logical_spec(axes, shape) for axes, shape in outs))


# The scatter_leading key: which weight gradients whose FSDP dim is their minor one (down "fd", o "nhd", the embedding
# table [V, D]) are formed with that dim leading (nn/dense.scatter_order, take_rows), so that XLA reduce-scatters them:
# "tpu", those XLA:TPU (libtpu 0.0.50.1, v5p) would all-reduce whole and slice (minor_scatter_all_reduced); "all",
# every one whose minor dim is sharded (the TPU path on any platform, at any width: the tests' reference check);
# "none", none. "auto" is the platform's: tpu on TPU, none elsewhere.
SCATTER_RULES = ("tpu", "all", "none")


def scatter_rule(key: str = "auto", on: str | None = None) -> str:
  """The scatter_leading key resolved for a platform (`on`; by default the program being traced's, platform()):
  auto is tpu on TPU, else none."""
  if key == "auto":
    return "tpu" if (on or platform()) == "tpu" else "none"
  if key not in SCATTER_RULES:
    raise ValueError(f"scatter_leading={key!r}: expected auto, {', '.join(SCATTER_RULES)}")
  return key


def minor_scatter_all_reduced(size: int, entry, itemsize: int, rule: str) -> bool:
  """Whether a gradient reduce-scattered over its minor dim (`size` long, split over the mesh axes `entry`) is to be
  formed with that dim leading under `rule` (scatter_rule's): under "tpu", where XLA:TPU would make the reduce-scatter
  an all-reduce of the whole array and a slice: a 2-byte (bfloat16) array whose shards are an odd multiple of 128
  elements wide. Measured for [F, D] over v5p:2x2x1's 4 devices (tests/test_compile.py holds one): shards of 128,
  384, 640, 896, 1152 are all-reduced; 64, 192, 256, 320, 512, 768, 1024, 1280, 1792 reduce-scattered, as is every
  float32 one tried, and over a leading dim every one tried. Over 8 devices (v5p:2x2x2) shards of 128 were
  all-reduced over a leading dim too: not covered (docs/compile.md). Under "all" every sharded one; "none", none."""
  if entry is None or rule == "none":
    return False
  if rule == "all":
    return True
  if itemsize != 2:
    return False
  sizes = dict(zip(current_mesh().axis_names, current_mesh().axis_sizes))
  n = math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))
  return size % n == 0 and (size // n) % 256 == 128


def leading_spec(spec: P, shape: Sequence[int], itemsize: int, rule: str) -> P | None:
  """spec with its sharded minor dim's mesh axes moved to dim 0 ([V, D] sharded (None, fsdp) -> (fsdp, None)),
  where `rule` (scatter_rule's) forms that gradient leading (minor_scatter_all_reduced), dim 0 is whole and they
  divide it; else None."""
  full = tuple(spec) + (None,) * (len(shape) - len(spec))
  if full[0] is not None or any(full[1:-1]) or not minor_scatter_all_reduced(shape[-1], full[-1], itemsize, rule):
    return None
  sizes = dict(zip(current_mesh().axis_names, current_mesh().axis_sizes))
  if shape[0] % math.prod(sizes[a] for a in ((full[-1],) if isinstance(full[-1], str) else full[-1])):
    return None
  return P(full[-1], *([None] * (len(shape) - 1)))


def take_rows(table: jax.Array, ids: jax.Array, out_axes: Axes, scatter: str = "auto") -> jax.Array:
  """table[ids] (rows of a [V, ...] table), sharded as out_axes.

  Explicit sharding refuses a gather from a sharded table into sharded rows as ambiguous: gather
  from the whole table straight into the output sharding instead. The table's gradient (a scatter-add of the
  rows' on every device, summed over them) is reduce-scattered to the table's sharding; where XLA would make that
  an all-reduce of the whole table (the embedding table [V, D] with D over fsdp: minor_scatter_all_reduced), it is
  reduce-scattered over V (a leading dim) and then exchanged into the table's sharding (an all-to-all of 1 / fsdp
  of it). scatter: the scatter_leading key (scatter_rule).
  """
  shape = ids.shape + table.shape[1:]
  if not is_explicit():
    return constrain(jax.numpy.take(table, ids, axis=0), out_axes)
  spec = jax.typeof(table).sharding.spec
  lead = leading_spec(spec, table.shape, table.dtype.itemsize, scatter_rule(scatter))
  if lead is not None:
    return _take_rows_scattered(tuple(out_axes), spec, lead, table, ids)
  return _take_rows(tuple(out_axes), table, ids)


def _take_rows(out_axes: Axes, table: jax.Array, ids: jax.Array) -> jax.Array:
  table = constrain(table, (None,) * table.ndim)
  return table.at[ids].get(out_sharding=out_sharding(out_axes, ids.shape + table.shape[1:]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _take_rows_scattered(out_axes, spec, lead, table, ids):
  return _take_rows(out_axes, table, ids)


def _take_rows_scattered_fwd(out_axes, spec, lead, table, ids):
  # The table's shape and dtype as a zero-size residual: nothing of the table is kept for the backward.
  return _take_rows(out_axes, table, ids), (ids, jax.numpy.zeros((0,) + table.shape, table.dtype))


def _take_rows_scattered_bwd(out_axes, spec, lead, res, g):
  ids, like = res
  # The gather's own transpose (the scatter-add autodiff forms, into the whole table), then the reduction.
  _, pull = jax.vjp(lambda t: _take_rows(out_axes, t, ids),
                    jax.numpy.zeros(like.shape[1:], like.dtype, out_sharding=P()))
  (g_table,) = pull(g)
  return jax.sharding.reshard(jax.sharding.reshard(g_table, lead), spec), None


_take_rows_scattered.defvjp(_take_rows_scattered_fwd, _take_rows_scattered_bwd)


def einsum(eqn: str, a: jax.Array, b: jax.Array, out_axes: Axes) -> jax.Array:
  """jnp.einsum with its output sharded as out_axes (out_sharding= under explicit, a constraint under auto)."""
  ins, out = eqn.replace(" ", "").split("->")
  size = dict(zip(ins.split(",")[0], a.shape)) | dict(zip(ins.split(",")[1], b.shape))
  shape = tuple(size[c] for c in out)
  if is_explicit():
    return jax.numpy.einsum(eqn, a, b, out_sharding=out_sharding(out_axes, shape))
  return constrain(jax.numpy.einsum(eqn, a, b), out_axes)
