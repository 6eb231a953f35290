"""For the MoE tests: the layer's arguments (the moe section and Options) from keywords, and jaxpr introspection (how
many equations of given primitives a program holds)."""
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


def split(**kw) -> tuple[dict, dict]:
  """Keywords as (the moe section's knobs, Options' fields)."""
  from meshlm.models.ffns.moe import MoEConfig
  knobs = {k: v for k, v in kw.items() if k in MoEConfig.model_fields}
  return knobs, {k: v for k, v in kw.items() if k not in knobs}


def settings(num_experts: int, num_experts_per_tok: int, *, mlp_dim: int = 1, kernel_fsdp="embed", **kw):
  """(knobs, opts): the moe section (MoEConfig; mlp_dim is moe_spec's, which the layer reads from the kernels, so any
  value does; kernel_fsdp "embed": the tests' kernels are moe_spec(kernel_fsdp="embed")'s) and Options, from
  keywords of either."""
  from meshlm.models.ffns.moe import MoEConfig
  from meshlm.nn.moe import Options
  knobs, opts = split(**kw)
  return (MoEConfig(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, mlp_dim=mlp_dim,
                    kernel_fsdp=kernel_fsdp, **knobs), Options(**opts))


def with_settings(moe_mlp, **changes):
  """moe_mlp with its knobs or options changed: a model's MoE layers run with other ones."""
  knob_changes, opt_changes = split(**changes)

  def call(p, x_BTD, ctx, knobs, opts, **kw):
    return moe_mlp(p, x_BTD, ctx, knobs.model_copy(update=knob_changes), dataclasses.replace(opts, **opt_changes), **kw)
  return call
