"""The `moe` feed-forward (mixtral, qwen3_moe): a float32 router, top-k and dropless experts (nn/moe/).

Side outputs: the router statistics (`moe_load_balance_loss`, `moe_z_loss`, the per-expert fractions
and probabilities) and the routed expert ids (`moe_expert_ids` [B, T, k]); the decoder stacks them over
the MoE layers, and the train step adds the part's router losses (`router_losses`, Part.losses) when their
coefficients are set.
Router replay: the per-layer input `forced_expert_ids` [B, T, k] (-1 = not forced) forces the routing
(nn/router_replay.py). The router kernel is gathered once before the layer scan (`prepare`), and the
sort permutation is saved under remat (`remat_save_names`), so the backward does not sort again.

Shared expert (`moe_ffn(shared=True)`: qwen3-next, qwen3.5-moe): a GLU of width model.shared_expert_mlp_dim (S)
beside the routed experts on every token, scaled by sigmoid(shared_expert_gate(x)):
  y = moe(x) + sigmoid(x @ shared_expert_gate) * down(silu(gate(x)) * up(x))
Its parameters sit beside the experts': shared_gate [D, S], shared_up [D, S], shared_down [S, D],
shared_expert_gate [D, 1] (Hugging Face mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate,
each weight transposed). `shared_gate=False` (deepseek_v3): no shared_expert_gate, the GLU is added as it is
(HF mlp.shared_experts, n_shared_experts * moe_intermediate_size wide = model.shared_expert_mlp_dim).

Group-limited sigmoid routing (`routing="group_sigmoid"`, deepseek_v3; nn/moe/routing.py group_route): s =
sigmoid(float32 logits); experts are picked from s + router_bias within the model.topk_group best of
model.n_group groups; the weights are the unbiased s at them (/ (sum + 1e-20) with norm_topk_prob) times
model.routed_scaling_factor. `router_bias` [E] float32 is model state (Part.model_state: not a parameter,
not in the optimizer, checkpointed; HF mlp.gate.e_score_correction_bias), zeros at init, and after each
step (after_step) the aux-loss-free rule moves it: bias += model.router_bias_update_rate *
sign(mean load - load), from the side output "moe_expert_load" [E] (routed pairs per expert, padding
excluded) summed over the whole global batch and its micro-batches. Rate 0 leaves it bit-unchanged.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm import spec as S
from meshlm.models.family import CensusCounter, LayerInput, Part
from meshlm.nn import moe
from meshlm.nn.mlp import ACTIVATIONS, glu_mlp
from meshlm.nn.router_replay import check_forced_ids

FORCED_IDS = "forced_expert_ids"  # the per-layer input (ctx.layer) and batch field holding [B, T, k] forced ids
ROUTED_IDS = "moe_expert_ids"  # the side output holding the routed ids [B, T, k]
SIDE_NAMES = ("moe_load_balance_loss", "moe_z_loss", "moe_expert_fraction", "moe_expert_prob", ROUTED_IDS)
LOAD = "moe_expert_load"  # group_sigmoid's side output: routed pairs per expert [E], what after_step balances
ROUTER_BIAS = "router_bias"  # group_sigmoid's model-state leaf [E] float32
KERNELS = ("gate", "up", "down")  # read by the expert loop from their stacks in unrolled layers (Part.stack_rows)
# The census fields stablehlo.moe.{gathers,scatters}.{forward,backward}: the dispatch's gathers and scatters.
CENSUS = (CensusCounter(field="stablehlo.moe", kind="scope_gathers_scatters", scope=moe.SCOPE),)


def prepare(p: dict, specs: dict) -> dict:
  return dict(p, router_full=moe.gather_router_once(p["router"], specs["router"].axes))


def check_forced(m: ModelConfig, forced, shape: tuple[int, ...], name: str = FORCED_IDS) -> None:
  """forced_expert_ids ([L_moe, B, T, k] to the decoder, [B, T, L_moe, k] in a batch): its shape, and its
  range when concrete."""
  check_forced_ids(forced, shape, m.num_experts, name)


# Router replay's per-layer input; RL reports how often the trainer's routing leaves the sampler's (router flips).
FORCED = LayerInput(trailing=lambda m: (m.num_experts_per_tok,), check=check_forced, flips="router_flips")


def routed_fraction(m: ModelConfig, s: S.ParamSpec) -> float:
  """The share of a parameter one token's matmuls meet (Part.active_fraction): k / E of a kernel with an experts
  axis (a token runs k of the E experts), all of every other."""
  if m.num_experts and any(a and str(a).startswith("experts") for a in s.axes):
    return m.num_experts_per_tok / m.num_experts
  return 1.0


def router_losses(m: ModelConfig) -> dict:
  """The router's loss terms whose coefficient is set: the load-balancing loss (transformers'
  load_balancing_loss_func over all MoE layers, nn/moe.py) and the z-loss (the mean over the layers of
  each layer's mean squared logsumexp), as {metric: (coef, fn(side))} (Part.losses)."""
  out = {}
  if m.num_experts and m.router_aux_loss_coef > 0:
    out["moe_aux_loss"] = (m.router_aux_loss_coef, moe.load_balancing_loss)
  if m.num_experts and m.router_z_loss_coef > 0:
    out["moe_z_loss"] = (m.router_z_loss_coef, lambda side: jnp.mean(side["moe_z_loss"]))
  return out


def settings(m: ModelConfig, *, norm_topk: bool | None = None, routing: str = "softmax") -> moe.MoESettings:
  """The MoE layer's knobs from the model config. norm_topk: None reads model.norm_topk_prob. routing
  "group_sigmoid": DeepSeek-V3's group-limited sigmoid scoring with the model's groups."""
  group = {}
  if routing == "group_sigmoid":
    group = dict(scoring="sigmoid", n_group=m.n_group, topk_group=m.topk_group,
                 routed_scaling=m.routed_scaling_factor, dropped_score=moe.GROUP_MASKS[m.router_group_mask])
  return moe.MoESettings(num_experts=m.num_experts, k=m.num_experts_per_tok,
                         norm_topk=m.norm_topk_prob if norm_topk is None else norm_topk,
                         activation=ACTIVATIONS[m.hidden_activation], router_dtype=jnp.dtype(m.router_dtype),
                         impl=m.moe_impl, grouped_matmul=m.moe_grouped_matmul, experts_axis=moe.experts_axis(m),
                         kernel_axes=tuple(moe.moe_spec(m)[n].axes for n in KERNELS), **group)


def apply(p: dict, x_BTD: jax.Array, ctx, state=None, *, norm_topk: bool | None = None, shared: bool = False,
          shared_gate: bool = True, routing: str = "softmax"):
  """norm_topk: renormalize the top-k weights (mixtral: always); None reads model.norm_topk_prob.
  shared: add the shared expert (sigmoid-gated when shared_gate). routing: "softmax" or "group_sigmoid"."""
  kw = {}
  if routing == "group_sigmoid":
    seg = ctx.here.segment_ids
    # Padding (segment 0) is not counted.
    kw = dict(router_bias=p[ROUTER_BIAS], token_mask_BT=None if seg is None else (seg > 0))
  y, side = moe.moe_mlp(p, x_BTD, ctx, settings(ctx.model, norm_topk=norm_topk, routing=routing),
                        forced_ids_BTk=ctx.layer.get(FORCED_IDS), router_full=p["router_full"], **kw)
  if shared:
    y = y + shared_expert(p, x_BTD, ctx, gated=shared_gate)
  return y, None, side


def shared_spec(m: ModelConfig, gated: bool = True) -> dict:
  D, F = m.embed_dim, m.shared_expert_mlp_dim
  out = {
      "shared_gate": S.kernel((D, F), ("embed", "mlp")),
      "shared_up": S.kernel((D, F), ("embed", "mlp")),
      "shared_down": S.kernel((F, D), ("mlp", "embed")),
  }
  if gated:
    out["shared_expert_gate"] = S.kernel((D, 1), ("embed", None))
  return out


def shared_expert(p: dict, x_BTD: jax.Array, ctx, gated: bool = True) -> jax.Array:
  """sigmoid(x @ shared_expert_gate) * glu(x) [B, T, D]; glu(x) alone when not gated."""
  dt = x_BTD.dtype
  with jax.named_scope("shared_expert"):
    h = glu_mlp({"gate": p["shared_gate"], "up": p["shared_up"], "down": p["shared_down"]}, x_BTD, dense=ctx.dense,
                activation=ACTIVATIONS[ctx.model.hidden_activation])
    if not gated:
      return h
    with jax.named_scope("shared_expert_gate"):
      s = ctx.dense(x_BTD, p["shared_expert_gate"].astype(dt), "btd,do->bto", ("batch", "length", None))  # [B, T, 1]
    return jax.nn.sigmoid(s) * h


def spec_with_shared(m: ModelConfig, gated: bool = True) -> dict:
  return {**moe.moe_spec(m), **shared_spec(m, gated)}


def router_bias_state(m: ModelConfig) -> dict:
  """The model state of a group_sigmoid layer: router_bias [E], zeros, replicated (it is tiny)."""
  return {ROUTER_BIAS: S.ParamSpec((m.num_experts,), (None,), "zeros", decay=False)}


def update_router_bias(leaves: dict, side: dict, m: ModelConfig) -> dict:
  """after_step: the aux-loss-free rule on router_bias [L, E] from the batch's load [L, E]."""
  return {ROUTER_BIAS: moe.bias_update(leaves[ROUTER_BIAS], side[LOAD], m.router_bias_update_rate)}


def validate_group_routing(m: ModelConfig, *, shared: bool = False) -> None:
  """The fields group-limited sigmoid routing needs (and with shared, the shared experts' width); one
  ConfigError line naming the key otherwise."""
  E, k, G = m.num_experts, m.num_experts_per_tok, m.n_group
  fam = m.family
  if not E:
    raise ConfigError(f"model.num_experts: model.family={fam} routes to experts; set model.num_experts and "
                      "model.moe_mlp_dim")
  if shared and m.shared_expert_mlp_dim is None:
    raise ConfigError(f"model.shared_expert_mlp_dim: required by model.family={fam} (its shared experts, HF "
                      "n_shared_experts x moe_intermediate_size)")
  if m.router_scoring != "sigmoid":
    raise ConfigError(f"model.router_scoring={m.router_scoring}: model.family={fam} routes with group-limited "
                      "sigmoid scores; set model.router_scoring=sigmoid")
  if E % G:
    raise ConfigError(f"model.n_group={G} does not divide model.num_experts={E}: the groups are equal runs of "
                      "experts")
  if G > 1 and E // G < 2:
    raise ConfigError(f"model.n_group={G}: each group scores the sum of its top 2 experts, so it needs at least 2 "
                      f"(num_experts={E} gives {E // G}); use n_group <= {E // 2}")
  if m.topk_group > G:
    raise ConfigError(f"model.topk_group={m.topk_group} is larger than model.n_group={G}: a token keeps at most "
                      "every group")
  if k > m.topk_group * (E // G):
    raise ConfigError(f"model.num_experts_per_tok={k} is larger than model.topk_group x experts per group = "
                      f"{m.topk_group} x {E // G}: the kept groups hold too few experts; raise model.topk_group")
  if m.router_dtype != "float32":
    raise ConfigError(f"model.router_dtype={m.router_dtype}: group-limited sigmoid routing computes its router "
                      "logits in float32; leave it at float32")
  if m.router_aux_loss_coef > 0:
    raise ConfigError(f"model.router_aux_loss_coef={m.router_aux_loss_coef}: the Switch load-balancing loss reads "
                      "softmax probabilities; group-limited sigmoid routing balances through its routing bias "
                      "(model.router_bias_update_rate); leave it at 0")


def validate_softmax_routing(m: ModelConfig) -> None:
  """A softmax-routed family refuses the group-routing keys it would ignore (one ConfigError line)."""
  if m.router_scoring != "softmax":
    raise ConfigError(f"model.router_scoring={m.router_scoring}: model.family={m.family} routes with softmax")
  for key, default in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0),
                       ("router_bias_update_rate", 0.0)):
    if getattr(m, key) != default:
      raise ConfigError(f"model.{key}={getattr(m, key)}: only group-limited sigmoid routing reads it "
                        f"(model.family={m.family} routes with softmax); leave it at {default}")


ROUTINGS = ("softmax", "group_sigmoid")


def moe_ffn(*, norm_topk: bool | None = None, shared: bool = False, shared_gate: bool = True,
            routing: str = "softmax") -> Part:
  """shared: a shared expert beside the routed ones (model.shared_expert_mlp_dim wide), scaled by
  sigmoid(shared_expert_gate(x)) when shared_gate. routing: "softmax" (top-k of the softmax) or
  "group_sigmoid" (DeepSeek-V3's group-limited sigmoid routing, the router_bias model state and its
  aux-loss-free after_step; the family calls validate_group_routing)."""
  if routing not in ROUTINGS:
    raise ValueError(f"moe_ffn(routing={routing!r}): expected one of {ROUTINGS}")
  spec = functools.partial(spec_with_shared, gated=shared_gate) if shared else moe.moe_spec
  group = routing == "group_sigmoid"
  return Part(name="moe", key="moe", spec=spec, position_wise=True,
              apply=functools.partial(apply, norm_topk=norm_topk, shared=shared, shared_gate=shared_gate,
                                      routing=routing),
              prepare=prepare, remat_save_names=moe.REMAT_SAVE_NAMES, layer_inputs={FORCED_IDS: FORCED},
              stack_rows=KERNELS,
              side_names=SIDE_NAMES + ((LOAD,) if group else ()), replays={ROUTED_IDS: FORCED_IDS},
              model_state=router_bias_state if group else None, after_step=update_router_bias if group else None,
              after_step_side={LOAD: "sum"} if group else {}, losses=router_losses, census=CENSUS,
              active_fraction=routed_fraction)
