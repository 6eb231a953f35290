"""The `glu` feed-forward: down(act(gate(x)) * up(x)), the activation from `model.hidden_activation`
(SwiGLU, gemma's tanh-GELU)."""
from __future__ import annotations

import jax

from meshlm.config import ModelConfig
from meshlm import spec as S
from meshlm.models.family import Part
from meshlm.nn.mlp import ACTIVATIONS, glu_mlp


def spec(m: ModelConfig) -> dict:
  D, F = m.embed_dim, m.mlp_dim
  return {
      "gate": S.kernel((D, F), ("embed", "mlp")),
      "up": S.kernel((D, F), ("embed", "mlp")),
      "down": S.kernel((F, D), ("mlp", "embed")),
  }


def apply(p: dict, x_BTD: jax.Array, ctx, state=None):
  return glu_mlp(p, x_BTD, dense=ctx.dense, activation=ACTIVATIONS[ctx.model.hidden_activation], cast=ctx.cast), None, {}


def glu() -> Part:
  return Part(name="glu", key="mlp", spec=spec, apply=apply, position_wise=True)
