"""Jaxpr introspection for the MoE tests: how many equations of given primitives a program holds."""
from __future__ import annotations

import dataclasses

import jax
import jax.extend


def count_primitives(jaxpr, names: tuple[str, ...]) -> int:
  """How many equations of the given primitives a (closed) jaxpr holds, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += count_primitives(sub, names)
  return n


def count_sorts(fn, *args) -> int:
  """Sort ops in the jaxpr of fn(*args) (pass a jax.grad'ed function to count forward + backward)."""
  return count_primitives(jax.make_jaxpr(fn)(*args), ("sort",))


def with_settings(moe_mlp, **changes):
  """moe_mlp with its settings changed (dataclasses.replace): a model's MoE layers run with other knobs."""
  def call(p, x_BTD, ctx, settings, **kw):
    return moe_mlp(p, x_BTD, ctx, dataclasses.replace(settings, **changes), **kw)
  return call
