"""A new mixer end to end, as docs/architecture.md's checklist says: this one file (the part with its own
config section), one registry line and one preset; no edit of config/schema.py (tests/test_part_config.py).

`causal_mean`: y_t = scale * (mean of x_0..x_t within the row) @ out [D, D]. Its knob `scale` lives in its
own section (model.parts.causal_mean.scale); its decode state is the running sum [B, D] ("replace").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pydantic

from meshlm import spec as S
from meshlm.models.family import Part, StateLeaf, section


class MeanConfig(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid")
  scale: float = pydantic.Field(default=1.0, gt=0, description="multiplies the running mean")


def spec(m) -> dict:
  return {"out": S.kernel((m.embed_dim, m.embed_dim), ("embed", None))}


def state_spec(m, batch: int, size: int) -> dict:
  return {"sum": StateLeaf((batch, m.embed_dim), ("batch", None), commit="replace")}


def apply(p: dict, x_BTD: jax.Array, ctx, state=None):
  here = ctx.here
  count_BT1 = (here.positions + 1).astype(x_BTD.dtype)[..., None]
  if ctx.mode == "decode":
    total = state["sum"][:, None] + x_BTD  # [B, 1, D]
    update = {"sum": total[:, 0]}
  else:
    total = jnp.cumsum(x_BTD, axis=1)
    update = None
    if ctx.mode == "prefill":  # the sum over each row's real tokens
      real = jnp.arange(x_BTD.shape[1])[None, :] < here.lengths[:, None]
      update = {"sum": jnp.sum(jnp.where(real[..., None], x_BTD, 0), axis=1)}
  mean = section(ctx.model, PART).scale * total / count_BT1
  return ctx.dense(mean, p["out"].astype(x_BTD.dtype), "btd,de->bte", ("batch", "length", "act_embed")), update, {}


PART = Part(name="causal_mean", key="attn", spec=spec, apply=apply, state_spec=state_spec, config=MeanConfig)


def causal_mean() -> Part:
  return PART
