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
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import Axes, constrain, is_explicit, out_sharding


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
          impl: str = "custom_vjp") -> jax.Array:
  """y = einsum(eqn, x, kernel), sharded as out_axes.

  eqn names the kernel's dimensions in stored order, inputs first (e.g. "btd,dnh->btnh").
  kernel_order asks for the kernel-order weight gradient; it only acts under explicit sharding,
  where the barrier exists. The kernel must already be in x's dtype.
  """
  x_sub, k_sub, out_sub = _parse(eqn)
  size = dict(zip(x_sub, x.shape)) | dict(zip(k_sub, kernel.shape))
  out_shape = tuple(size[c] for c in out_sub)
  if not is_explicit():
    return constrain(jnp.einsum(eqn, x, kernel), out_axes)
  spec = out_sharding(out_axes, out_shape)
  if not kernel_order:
    return jnp.einsum(eqn, x, kernel, out_sharding=spec)
  if impl == "auto_axes":
    return jax.sharding.auto_axes(functools.partial(jnp.einsum, eqn), out_sharding=spec)(x, kernel)
  if impl == "custom_vjp":
    return _einsum_kernel_order(eqn, spec, x, kernel)
  raise ValueError(f"weight_grad_impl={impl!r}: expected auto_axes or custom_vjp")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum_kernel_order(eqn, spec, x, kernel):
  return _forward(eqn, spec, x, kernel)


def _forward(eqn, spec, x, kernel):
  """einsum(eqn, x, kernel) sharded as spec; an output in another order than the dot's (dot_order) is
  transposed inside auto_axes, with no sharding op between the dot and its transpose."""
  if _parse(eqn)[2] == dot_order(eqn):
    return jnp.einsum(eqn, x, kernel, out_sharding=spec)
  return jax.sharding.auto_axes(functools.partial(jnp.einsum, eqn), out_sharding=spec)(x, kernel)


def _kernel_order_fwd(eqn, spec, x, kernel):
  return _forward(eqn, spec, x, kernel), (x, kernel)


def _kernel_order_bwd(eqn, spec, res, dy):
  x, kernel = res
  x_sub, k_sub, out_sub = _parse(eqn)
  # dX contracts the output dims against the kernel; dW puts x first so dot_general emits
  # (x's free dims, dy's free dims), which is the kernel's stored order: nothing left to transpose.
  dx = jnp.einsum(f"{out_sub},{k_sub}->{x_sub}", dy, kernel, out_sharding=jax.typeof(x).sharding.spec)
  dk = jnp.einsum(f"{x_sub},{out_sub}->{k_sub}", x, dy, out_sharding=jax.typeof(kernel).sharding.spec)
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_einsum_kernel_order.defvjp(_kernel_order_fwd, _kernel_order_bwd)
