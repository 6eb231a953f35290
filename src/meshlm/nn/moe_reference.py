"""The plain MoE layer that the dropless one is tested against: every expert on every token, masked.

Costs E / k times the dropless compute and E times its activation memory; only for tests and the
reference arm of benchmarks. Routing is written out again here (softmax, top-k, renormalize) rather
than imported, so a routing bug in nn/moe/routing.py cannot hide in both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.nn.dense import dense as dense_primitive

ROUTER_LOGITS = ("batch", "length", None)


def experts_reference(x_BTD: jax.Array, ids_BTk: jax.Array, w_BTk: jax.Array, gate_EDF: jax.Array,
                      up_EDF: jax.Array, down_EFD: jax.Array, *, activation=jax.nn.silu) -> jax.Array:
  """y[b, t] = sum_k w[b, t, k] * down_e(act(gate_e(x)) * up_e(x)) with e = ids[b, t, k], computed as
  every expert on every token times a [B, T, E] combine matrix that is zero off the top-k."""
  dt = x_BTD.dtype
  E = gate_EDF.shape[0]
  g = jnp.einsum("btd,edf->btef", x_BTD, gate_EDF.astype(dt))
  u = jnp.einsum("btd,edf->btef", x_BTD, up_EDF.astype(dt))
  y = jnp.einsum("btef,efd->bted", activation(g) * u, down_EFD.astype(dt))  # [B, T, E, D]
  combine = jnp.einsum("btk,btke->bte", w_BTk.astype(jnp.float32), jax.nn.one_hot(ids_BTk, E, dtype=jnp.float32))
  return jnp.einsum("bted,bte->btd", y.astype(jnp.float32), combine).astype(dt)


def moe_mlp_reference(p: dict, x_BTD: jax.Array, *, num_experts: int, k: int, norm_topk: bool,
                      activation=jax.nn.silu, dense=dense_primitive) -> tuple[jax.Array, dict]:
  """(y [B, T, D], {"logits", "probs", "weights", "ids"}) for p = {router, gate, up, down}."""
  x32 = x_BTD.astype(jnp.float32)
  logits = dense(x32, p["router"].astype(jnp.float32), "btd,de->bte", ROUTER_LOGITS)
  probs = jax.nn.softmax(logits, axis=-1)
  w, ids = jax.lax.top_k(probs, k)
  if norm_topk:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  y = experts_reference(x_BTD, ids, w, p["gate"], p["up"], p["down"], activation=activation)
  return y, {"logits": logits, "probs": probs, "weights": w, "ids": ids}
