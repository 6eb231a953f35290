"""Kernels gathered once before the layer scan (the RL trainer's router and query speedups).

Under FSDP a stacked kernel [L, ...] is sharded on its embed dim, so every layer would all-gather its
slice on the critical path, and the backward gathers it again. `gather_stack` gathers the whole
stack once, before the scan (stop_gradient'ed), and `gathered` gives each layer that slice with a
backward that pins the layer's gradient to the stored kernel's sharding: a per-layer reduce-scatter
into the sharded stack, not a full-size reduction of the stack after the backward. A stack its layers
read in the compute dtype is cast before the gather (`gather_stack(dtype=)`): the gathered copy, which
lives through the forward and the backward, and the all-gather are half the size of float32 ones, and
the gradient reaches the stored kernel in its own dtype. Numerically the identity.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.parallel.sharding import ACT, PARAM_STORAGE, RULES, constrain


def fsdp_axes(rules: dict[str, tuple[str, ...]]) -> frozenset[str]:
  """The parameter axes FSDP shards: the logical axes whose rule names mesh.fsdp (activations' "batch" aside)."""
  return frozenset(name for name, mesh_axes in rules.items() if "fsdp" in mesh_axes and name not in ACT)


FSDP_AXES = fsdp_axes(RULES)  # {"embed", "latent", "experts_fsdp", "mlp_fsdp"}


def gathered_axes(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
  """The axes of the gathered copy: the FSDP-sharded ones left whole, the rest (layers, tensor) kept.

  Only an axis split just to store it (rule sharding.PARAM_STORAGE, fsdp then expert and context: "embed",
  "latent") can be left whole, as every layer's dot would gather it: "experts_fsdp" and "mlp_fsdp" shard over
  expert (the experts' own split) or tensor as well, and leaving them whole would gather those too (every expert
  on every device). The kernels gathered once today (the query kernel, the router) carry "embed" only; a kernel
  with another FSDP axis is refused here rather than gathered whole."""
  mixed = [a for a in axes if a in FSDP_AXES and RULES[a] != PARAM_STORAGE]
  if mixed:
    raise ValueError(f"gather_once: axes {mixed} shard over {[RULES[a] for a in mixed]}, not for storage alone "
                     f"{PARAM_STORAGE}; a gathered copy would gather their other mesh axes too")
  return tuple(None if a in FSDP_AXES else a for a in axes)


def gather_stack(stack: jax.Array, axes: tuple[str | None, ...], scope: str, dtype=None) -> jax.Array:
  """The stacked kernel (logical axes `axes`, "layers" among them) gathered once, stop_gradient'ed,
  cast to dtype first when given (the dtype its layers compute in): its gradient reaches the stored
  stack through `gathered`, per layer."""
  with jax.named_scope(scope):
    if dtype is not None:
      stack = stack.astype(dtype)
    return jax.lax.stop_gradient(constrain(stack, gathered_axes(axes)))


def gathered(kernel: jax.Array, full: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """full (this layer's slice of the gathered stack, in its dtype), with its gradient sent to kernel
  (the slice of the stored stack, logical axes `axes`) in kernel's dtype, pinned to the kernel's
  sharding. The slice is pinned whole (under auto, XLA would otherwise keep the stack sharded into
  the loop and gather each slice there)."""
  return _gathered(kernel, full, axes, jnp.dtype(kernel.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gathered(kernel: jax.Array, full: jax.Array, axes: tuple[str | None, ...], kernel_dtype: str) -> jax.Array:
  del kernel
  return constrain(full, gathered_axes(axes))


def _gathered_fwd(kernel, full, axes, kernel_dtype):
  return _gathered(kernel, full, axes, kernel_dtype), None


def _gathered_bwd(axes, kernel_dtype, _, g):
  # The cast first, as the float32 copy's `astype(compute dtype)` transposed: the same values reduced.
  return constrain(g.astype(kernel_dtype), axes), None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
