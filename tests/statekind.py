"""A test family whose feed-forward keeps model state: a non-trainable leaf with an after-step rule.

    y = glu(x) * (1 + ema)          ema: [1] per layer, not a gradient-trained parameter
    side "mean_sq" = mean(x^2)      each layer's input power
    after a step: ema <- RATE * ema + (1 - RATE) * mean_sq

Registered by tests that need it (registry.FAMILIES["statekind"] = "statekind"). RULE lets a test
swap the rule (the identity, for the control that the leaf moves only through it).
"""
import jax.numpy as jnp

from meshlm import spec as S
from meshlm.models.family import Family, Kind, ModelState, Part
from meshlm.models.ffns import glu
from meshlm.models.mixers.gqa import gqa

RATE = 0.5


def apply(p, x_BTD, ctx, state=None):
  y, _, _ = glu.apply(p, x_BTD, ctx)
  mean_sq = jnp.mean(jnp.square(x_BTD.astype(jnp.float32)))
  return y * (1 + p["ema"][0]).astype(y.dtype), None, {"mean_sq": mean_sq}


def ema_rule(leaves, side, m):
  return {"ema": RATE * leaves["ema"] + (1 - RATE) * side["mean_sq"][:, None]}


RULE = {"fn": ema_rule}

PART = Part(name="ema_glu", key="mlp", spec=glu.spec, apply=apply, side_names=("mean_sq",),
            model_state=ModelState(spec=lambda m: {"ema": S.ParamSpec((1,), (None,), "zeros")},
                                   after_step=lambda leaves, side, m: RULE["fn"](leaves, side, m)))

FAMILY = Family("statekind", kinds={"dense": Kind(gqa(), PART)})
