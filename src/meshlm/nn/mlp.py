"""Gated MLPs (SwiGLU, and gemma's tanh-GELU GLU)."""
from __future__ import annotations

import functools

import jax

from meshlm.nn.dense import dense

from meshlm.parallel.sharding import ACT
HIDDEN = ("batch", "length", "mlp")

# ModelConfig.hidden_activation -> the gate's activation. gelu_tanh is HF's gelu_pytorch_tanh.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


def glu_mlp(p: dict, x_BTD: jax.Array, *, dense=dense, activation=jax.nn.silu, cast=None) -> jax.Array:
  """down(act(gate(x)) * up(x)). p: gate [D, F], up [D, F], down [F, D]; dense is the projection
  (a Context's, bound to the kernel-order flags), cast(kernel, dtype) the kernels' cast to x's dtype (a Context's,
  which keeps it in the layer loop; astype by default)."""
  cast = cast or (lambda w, dt: w.astype(dt))
  with jax.named_scope("mlp"):
    dt = x_BTD.dtype
    with jax.named_scope("gate"):
      g = dense(x_BTD, cast(p["gate"], dt), "btd,df->btf", HIDDEN)
    with jax.named_scope("up"):
      u = dense(x_BTD, cast(p["up"], dt), "btd,df->btf", HIDDEN)
    h = activation(g) * u
    with jax.named_scope("down"):
      return dense(h, cast(p["down"], dt), "btf,fd->btd", ACT)
