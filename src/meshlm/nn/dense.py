"""The one dense primitive. Every weight matmul in meshlm goes through `dense`.

Under explicit sharding JAX places a sharding op between a weight-gradient dot and the transpose
that puts dW into the kernel's stored axis order, so XLA cannot fold transpose(dot(a, b)) into
dot(b, a) and keeps the transpose plus relayout copies. With `kernel_order=True` the gradient is
produced in the kernel's own order instead, by one of two implementations:

- "auto_axes": trace the forward dot inside `jax.sharding.auto_axes`, which drops the barrier for
  that one dot; XLA then folds the transpose itself. Bit-identical to the plain gradient.
- "custom_vjp": a VJP whose backward contracts dW straight into the kernel's order
  (`einsum(x, dy) -> kernel`), so there is no transpose to fold. Equal up to reassociation.

The kernel itself (shape, sharding, init) never depends on either choice.

An output in another order than the dot's own ((x's free dims, the kernel's free dims): gqa's heads-first rows
"btd,dnh->bnth" for the splash kernel) is the dot plus a transpose. With the custom VJP its forward einsum then runs
inside `auto_axes`, so the sharding lands after the transpose and none sits between the dot and it (the backward's
dots emit dx and dW in their own order already).

The weight gradient sums over the batch, which FSDP shards: each device has a partial sum of the whole kernel and
keeps its shard of the total, a reduce-scatter. XLA:TPU reduce-scatters a bfloat16 gradient over a leading dim,
but over the minor dim (down's "fd", o's "nhd", sharded on d) it all-reduces some whole and slices them: twice a
reduce-scatter's bytes (sharding.minor_scatter_all_reduced: shards an odd multiple of 128 wide, e.g. D = 512 or
3584 over fsdp=4; llama3-8b's 4096 over 4 is not). Those are contracted dy first, so the dot emits the FSDP dim
leading and XLA reduce-scatters it there, and the shard is transposed into the kernel's order (`weight_grad`,
`scatter_order`); under explicit in the kernel-order VJP, under auto (and in an auto-axes region, the attention's
output projection) in a VJP of its own. Every other gradient, and every one off TPU, is formed as before. Which
gradients are so formed is the scatter_leading key (`scatter`, sharding.scatter_rule: auto is the TPU's rule on TPU,
none elsewhere; "all" forms every sharded one so, the tests' check of the path on CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from meshlm.parallel.sharding import (ACT, Axes, constrain, is_explicit, logical_spec, minor_scatter_all_reduced,
                                      out_sharding, scatter_rule)


def _parse(eqn: str) -> tuple[str, str, str]:
  ins, out = eqn.replace(" ", "").split("->")
  x_sub, k_sub = ins.split(",")
  return x_sub, k_sub, out


def dot_order(eqn: str) -> str:
  """The output dims in the order dot_general emits them for eqn: the batch dims (in x, the kernel and the
  output), x's free dims, then the kernel's."""
  x_sub, k_sub, out_sub = _parse(eqn)
  batch = "".join(c for c in x_sub if c in k_sub and c in out_sub)
  return batch + "".join(c for c in x_sub if c in out_sub and c not in batch) + "".join(
      c for c in k_sub if c in out_sub and c not in x_sub)


def dense(x: jax.Array, kernel: jax.Array, eqn: str, out_axes: Axes, *, kernel_order: bool = False,
          impl: str = "custom_vjp", scatter: str = "auto") -> jax.Array:
  """y = einsum(eqn, x, kernel), sharded as out_axes.

  eqn names the kernel's dimensions in stored order, inputs first (e.g. "btd,dnh->btnh").
  kernel_order asks for the kernel-order weight gradient; it only acts under explicit sharding,
  where the barrier exists. The kernel must already be in x's dtype. scatter: the scatter_leading key (which
  weight gradients are formed with a minor FSDP dim leading: scatter_order).
  """
  x_sub, k_sub, out_sub = _parse(eqn)
  size = dict(zip(x_sub, x.shape)) | dict(zip(k_sub, kernel.shape))
  out_shape = tuple(size[c] for c in out_sub)
  rule = scatter_rule(scatter)
  if not is_explicit():
    if rule != "none" and scatter_order(eqn, *_auto_specs(eqn, kernel.shape), kernel.shape, x.dtype.itemsize,
                                       rule) is not None:
      return _einsum_scatter_leading(eqn, tuple(out_axes), rule, x, kernel)
    return constrain(jnp.einsum(eqn, x, kernel), out_axes)
  spec = out_sharding(out_axes, out_shape)
  if not kernel_order:
    return jnp.einsum(eqn, x, kernel, out_sharding=spec)
  if impl == "auto_axes":
    return jax.sharding.auto_axes(functools.partial(jnp.einsum, eqn), out_sharding=spec)(x, kernel)
  if impl == "custom_vjp":
    return _einsum_kernel_order(eqn, spec, rule, x, kernel)
  raise ValueError(f"weight_grad_impl={impl!r}: expected auto_axes or custom_vjp")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum_kernel_order(eqn, spec, rule, x, kernel):
  return _forward(eqn, spec, x, kernel)


def _forward(eqn, spec, x, kernel):
  """einsum(eqn, x, kernel) sharded as spec; an output in another order than the dot's (dot_order) is
  transposed inside auto_axes, with no sharding op between the dot and its transpose."""
  if _parse(eqn)[2] == dot_order(eqn):
    return jnp.einsum(eqn, x, kernel, out_sharding=spec)
  return jax.sharding.auto_axes(functools.partial(jnp.einsum, eqn), out_sharding=spec)(x, kernel)


def _kernel_order_fwd(eqn, spec, rule, x, kernel):
  return _forward(eqn, spec, x, kernel), (x, kernel)


def _kernel_order_bwd(eqn, spec, rule, res, dy):
  x, kernel = res
  x_sub, k_sub, out_sub = _parse(eqn)
  # dX contracts the output dims against the kernel; dW puts x first so dot_general emits
  # (x's free dims, dy's free dims), which is the kernel's stored order: nothing left to transpose.
  dx = jnp.einsum(f"{out_sub},{k_sub}->{x_sub}", dy, kernel, out_sharding=jax.typeof(x).sharding.spec)
  dk = weight_grad(eqn, x, dy, jax.typeof(kernel).sharding.spec, jax.typeof(x).sharding.spec, rule)
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_einsum_kernel_order.defvjp(_kernel_order_fwd, _kernel_order_bwd)


def _entries(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def _mesh_axes(entry) -> set[str]:
  return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)


def scatter_order(eqn: str, k_spec: P, x_spec: P, k_shape, itemsize: int, rule: str) -> str | None:
  """The order to form eqn's weight gradient in, dy first (`dot_order`), where in the kernel's own order XLA would
  all-reduce it whole (its minor dim is reduced over the batch's mesh axes: sharding.minor_scatter_all_reduced under
  `rule`, sharding.scatter_rule's) and dy first puts that dim leading; else None. k_spec, k_shape: the kernel's
  sharding and shape; x_spec: x's, whose contracted dims' mesh axes (the batch and length: data, fsdp, expert,
  context) are those the gradient is reduced over; itemsize: the gradient's bytes per element."""
  x_sub, k_sub, out_sub = _parse(eqn)
  order = dot_order(f"{out_sub},{x_sub}->{k_sub}")
  if order == k_sub or order[0] != k_sub[-1]:
    return None
  reduced = set().union(*(_mesh_axes(e) for c, e in zip(x_sub, _entries(x_spec, len(x_sub))) if c not in k_sub))
  minor = _entries(k_spec, len(k_sub))[-1]
  if not reduced & _mesh_axes(minor) or not minor_scatter_all_reduced(k_shape[-1], minor, itemsize, rule):
    return None
  return order


def _auto_specs(eqn: str, k_shape) -> tuple[P, P]:
  """(the kernel's spec, x's) as scatter_order reads them where no type carries them (auto, an auto-axes region):
  the kernel's FSDP dim is the one its eqn names d, the embed dim (docs/architecture.md's letters; every kernel
  whose FSDP dim is minor names it so: o "nhd", down "fd", GDN's output "njd"), sharded as RULES shard "embed";
  x's leading dims are the activations' batch and length."""
  x_sub, k_sub, _ = _parse(eqn)
  k_spec = P(*(_entries(logical_spec(("embed",), (n,)), 1)[0] if c == "d" else None for c, n in zip(k_sub, k_shape)))
  return k_spec, logical_spec(ACT[:2] + (None,) * (len(x_sub) - 2))


def weight_grad(eqn: str, x: jax.Array, dy: jax.Array, k_spec: P, x_spec: P, rule: str,
                explicit: bool = True) -> jax.Array:
  """dW of y = einsum(eqn, x, kernel) from dy, in the kernel's stored order and sharding k_spec: x first, so
  dot_general emits (x's free dims, dy's free dims), the kernel's order, with nothing to transpose; or dy first
  where scatter_order says so, sharded with the FSDP dim leading, and the shard transposed into the kernel's
  order. Explicit: out_sharding=; auto: a constraint on the leading dim alone (the others as XLA finds them)."""
  x_sub, k_sub, out_sub = _parse(eqn)
  size = dict(zip(x_sub, x.shape)) | dict(zip(out_sub, dy.shape))
  order = scatter_order(eqn, k_spec, x_spec, tuple(size[c] for c in k_sub), dy.dtype.itemsize, rule)
  if order is None:
    return jnp.einsum(f"{x_sub},{out_sub}->{k_sub}", x, dy, out_sharding=k_spec if explicit else None)
  entry = dict(zip(k_sub, _entries(k_spec, len(k_sub))))
  if explicit:
    dk = jnp.einsum(f"{out_sub},{x_sub}->{order}", dy, x, out_sharding=P(*(entry[c] for c in order)))
  else:
    dk = jnp.einsum(f"{out_sub},{x_sub}->{order}", dy, x)
    dk = jax.lax.with_sharding_constraint(dk, P(entry[order[0]], *([P.UNCONSTRAINED] * (dk.ndim - 1))))
  return jnp.transpose(dk, [order.index(c) for c in k_sub])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum_scatter_leading(eqn, out_axes, rule, x, kernel):
  """y = einsum(eqn, x, kernel) pinned to out_axes, under auto, with dense's weight gradient (weight_grad)."""
  return constrain(jnp.einsum(eqn, x, kernel), out_axes)


def _scatter_leading_fwd(eqn, out_axes, rule, x, kernel):
  return _einsum_scatter_leading(eqn, out_axes, rule, x, kernel), (x, kernel)


def _scatter_leading_bwd(eqn, out_axes, rule, res, dy):
  x, kernel = res
  x_sub, k_sub, out_sub = _parse(eqn)
  dx = jnp.einsum(f"{out_sub},{k_sub}->{x_sub}", dy, kernel)
  dk = weight_grad(eqn, x, dy, *_auto_specs(eqn, kernel.shape), rule, explicit=False)
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_einsum_scatter_leading.defvjp(_scatter_leading_fwd, _scatter_leading_bwd)
