"""The `moe` feed-forward (mixtral, qwen3_moe, ...): a float32 router, top-k and the experts' sorted dispatch
(nn/moe/: dropless, except that ep_impl=compact with an ep_buffer_factor drops the rows past its buffers).

Side outputs: the router statistics (`moe_load_balance_loss`, `moe_z_loss`, the per-expert fractions
and probabilities) and the routed expert ids (`moe_expert_ids` [B, T, k]); the decoder stacks them over
the MoE layers, and the train step adds the part's router losses (`router_losses`, Part.losses) when their
coefficients are set.
Router replay: the per-layer input `forced_expert_ids` [B, T, k] (-1 = not forced) forces the routing
(nn/router_replay.py). The router kernel is gathered once before the layer scan (`prepare`), and the
sort permutation is saved under remat (`remat_save_names`), so the backward does not sort again.

Shared expert (`moe_ffn(shared=True)`: qwen3-next, qwen3.5-moe): a GLU of width shared_expert_mlp_dim (S)
beside the routed experts on every token, scaled by sigmoid(shared_expert_gate(x)):
  y = moe(x) + sigmoid(x @ shared_expert_gate) * down(silu(gate(x)) * up(x))
Its parameters sit beside the experts': shared_gate [D, S], shared_up [D, S], shared_down [S, D],
shared_expert_gate [D, 1] (Hugging Face mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate,
each weight transposed). `shared_gate=False` (deepseek_v3): no shared_expert_gate, the GLU is added as it is
(HF mlp.shared_experts, n_shared_experts * moe_intermediate_size wide = shared_expert_mlp_dim).

Group-limited sigmoid routing (`routing="group_sigmoid"`, deepseek_v3; nn/moe/routing.py group_route): s =
sigmoid(float32 logits); experts are picked from s + router_bias within the topk_group best of n_group groups;
the weights are the unbiased s at them (/ (sum + 1e-20) with norm_topk_prob) times routed_scaling_factor.
`router_bias` [E] float32 is model state (ModelState: not a parameter, not in the optimizer,
checkpointed; HF mlp.gate.e_score_correction_bias), zeros at init, and after each step (after_step) the
aux-loss-free rule moves it: bias += router_bias_update_rate * sign(mean load - load), from the side output
"moe_expert_load" [E] (routed pairs per expert, padding excluded) summed over the whole global batch and its
micro-batches. Rate 0 leaves it bit-unchanged.

Its own knobs, model.parts.moe.<knob> (`MoEConfig`; the old flat keys, model.num_experts, model.moe_mlp_dim,
model.moe_impl and the rest, still set them): num_experts and mlp_dim are required; impl, grouped_matmul and
kernel_fsdp say how the layer computes and lays out the same parameters (COMPUTE: a checkpoint resumes under
other values). kernel_fsdp null is decided for the run (`run_knobs`, by `layout_for`), and the part checks the
mesh: mesh.expert shards whole experts (`check_mesh`), and only a model with this part may set it above 1
(MeshRules.axes). Which layers are MoE is the family's plan (model.decoder_sparse_step, mlp_only_layers,
first_k_dense_replace), not a knob of the part. The layer (nn/moe moe_mlp) takes the section itself (`knobs`) and
reads the knobs it needs there, by their names, beside the few things it needs of the model and the context
(`options`: the activation, the kernels' axes, Context.cast); grad_reduce_barrier is applied here, in `apply`, alone.
Every kernel of the layer, the experts' and the shared expert's, reaches the compute dtype through Context.cast, the
rule every other part's kernels follow (models/context.py).
"""
from __future__ import annotations

import functools
import math
from typing import ClassVar, Literal, Optional

import jax
import jax.numpy as jnp
import pydantic
from pydantic import Field

from meshlm.config import Config, ModelConfig
from meshlm.errors import ConfigError
from meshlm import spec as S
from meshlm.models.family import (CensusCounter, Compute, Instrument, LayerInput, LayerMemory, MeshRules, ModelState,
                                  Part, PartConfig, Replay, section)
from meshlm.nn import moe
from meshlm.nn.mlp import ACTIVATIONS, glu_mlp
from meshlm.nn.router_replay import check_forced_ids

FORCED_IDS = "forced_expert_ids"  # the per-layer input (ctx.layer) and batch field holding [B, T, k] forced ids
ROUTED_IDS = "moe_expert_ids"  # the side output holding the routed ids [B, T, k]
SIDE_NAMES = ("moe_load_balance_loss", "moe_z_loss", "moe_expert_fraction", "moe_expert_prob", ROUTED_IDS,
              moe.DROPPED)
LOAD = "moe_expert_load"  # group_sigmoid's side output: routed pairs per expert [E], what after_step balances
ROUTER_BIAS = "router_bias"  # group_sigmoid's model-state leaf [E] float32
KERNELS = ("gate", "up", "down")  # read by the expert loop from their stacks in unrolled layers (MeshRules.stack_rows)
# The census fields stablehlo.moe.{gathers,scatters}.{forward,backward}: the dispatch's gathers and scatters.
CENSUS = (CensusCounter(field="stablehlo.moe", kind="scope_gathers_scatters", scope=moe.SCOPE),)


class MoEConfig(PartConfig):
  """The moe part's own knobs: model.parts.moe.<knob> (their old flat keys, ModelConfig.MOVED, still set them)."""
  # How the layer computes or lays out the same parameters (a checkpoint resumes under other values).
  COMPUTE: ClassVar[tuple[str, ...]] = ("impl", "grouped_matmul", "megablox_tiling", "kernel_fsdp", "ep_impl",
                                         "ep_buffer_factor", "grad_reduce_barrier", "decode_kernels")
  num_experts: int = Field(gt=0, description="experts per MoE layer (E)")
  num_experts_per_tok: int = Field(default=2, gt=0, description="experts each token is routed to (top-k); at most "
                                   "num_experts")
  mlp_dim: int = Field(gt=0, description="hidden width of each expert's GLU (HF moe_intermediate_size)")
  norm_topk_prob: bool = Field(default=True, description="renormalize the top-k routing weights to sum to 1 (mixtral "
                               "always does; qwen3_moe when set)")
  router_dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="dtype of the router logits, "
                                                       "softmax and top-k")
  router_aux_loss_coef: float = Field(default=0.0, ge=0, description="weight of the Switch load-balancing loss "
                                      "added to the training loss (0: off)")
  router_z_loss_coef: float = Field(default=0.0, ge=0, description="weight of the router z-loss (mean squared "
                                    "logsumexp of the router logits) added to the training loss (0: off)")
  # The sorted dispatch drops no routed (token, slot) row, except under ep_impl=compact with an ep_buffer_factor:
  # there the rows past a peer's buffer drop (counted in moe_dropped).
  impl: Literal["dropless", "reference"] = Field(
      default="dropless", description="dispatch: dropless (sorted, grouped matmuls; under ep_impl=compact with "
      "ep_buffer_factor set, the rows past its buffers drop) or reference (every expert on every token, masked)")
  grouped_matmul: Literal["auto", "loop", "blocks", "ragged", "megablox"] = Field(
      default="auto", description="the experts' grouped matmul (nn/moe/gmm.py): loop (a scan over the experts, rows "
      "straight from the sorted buffer), blocks (per-expert padded row blocks), ragged (jax.lax.ragged_dot), megablox "
      "(JAX's Pallas TPU grouped matmul; interpret mode off TPU, slow); auto: loop on CPU, megablox on TPU, ragged "
      "elsewhere")
  # megablox's tiles, [tm, tk, tn] (rows, contraction, output columns), for its forward and, clamped to each problem,
  # its two backward calls; null: gmm.megablox_tiling's rule (from the measured best, fitted to the chip's VMEM).
  megablox_tiling: Optional[tuple[int, int, int]] = Field(
      default=None, description="grouped_matmul=megablox's tiles [tm, tk, tn] (tm a multiple of 8, tk and tn of "
      "128), each clamped to the problem; too large for the chip's VMEM fails the compile; null: the auto rule (512, "
      "1024, 1024 halved until the tiles fit the chip's scoped VMEM)")
  # Which dim of the expert kernels gate/up [E, D, F] and down [E, F, D] mesh.fsdp shards (nn/moe/layer.py moe_spec):
  # "experts" moves tokens to the experts (expert-parallel dispatch over fsdp and expert; no kernel gathered),
  # "embed" and "mlp" gather the kernels whole in each layer. null: decided for the run by layout_for.
  kernel_fsdp: Optional[Literal["experts", "embed", "mlp"]] = Field(
      default=None, description="what mesh.fsdp shards in the expert kernels: experts (each device holds E / "
      "(expert x fsdp) whole experts and the tokens travel to them), embed (the embed dim; kernels gathered per "
      "layer) or mlp (as embed, but down on its mlp dim); null: experts where moving the tokens costs less than "
      "gathering the kernels, else embed (the run's mesh and batch decide)")
  # How expert parallelism (the experts dim sharded over mesh.expert and/or mesh.fsdp) moves the tokens
  # (nn/moe/expert_parallel.py): "gather" all-gathers the expert group's tokens onto every device of it; "compact"
  # sends each device only the rows routed to its experts, at most ceil(ep_buffer_factor x slots / ep) per peer.
  ep_impl: Literal["gather", "compact"] = Field(
      default="gather", description="how expert parallelism moves the tokens: gather (every device of an expert "
      "group all-gathers the group's tokens and reduce-scatters its outputs back) or compact (each device sends "
      "each peer only the (token, slot) rows routed to that peer's experts, with all-to-all, in a buffer of "
      "ep_buffer_factor rows per slot / ep; rows past it are dropped and counted in moe_dropped)")
  ep_buffer_factor: Optional[float] = Field(
      default=None, gt=0, description="ep_impl=compact: each device sends each peer of its expert group at most "
      "ceil(factor x its routed slots / ep) rows (1.0: a perfectly balanced routing; the RL seed uses 2.75); "
      "null: ep, the worst case, where nothing can drop (dropless)")
  # nn/moe/layer.py reduce_barrier: bit-identical; what XLA keeps live in the backward differs (docs/moe.md).
  grad_reduce_barrier: bool = Field(
      default=False, description="in the backward, hold each MoE layer's input gradient until its expert kernels' "
      "gradients are reduced to their parameter sharding (an optimization barrier): at most one layer's float32 "
      "kernel gradients whole over fsdp are live, at the cost of overlapping their reduce-scatters with the layer "
      "before; bit-identical")
  # A sampler's decode step under kernel_fsdp=embed and ep_impl=compact (nn/moe/expert_parallel.py expert_rows_split).
  decode_kernels: Literal["auto", "gathered", "split"] = Field(
      default="auto", description="decode under kernel_fsdp=embed, ep_impl=compact: gathered (the expert kernels "
      "gathered whole per layer, as in training) or split (they stay split on the embed dim; the routed rows' slices "
      "go to them and the partial gate|up products are summed); auto: split where that moves fewer elements than "
      "the gather (a decode step's few rows)")
  # Shared expert (qwen3_next, qwen3_5_moe): one GLU of this width beside the routed experts on every MoE layer,
  # scaled by sigmoid(shared_expert_gate(x)) (Hugging Face's shared_expert_intermediate_size).
  shared_expert_mlp_dim: Optional[int] = Field(
      default=None, gt=0, description="width of the shared expert beside the routed ones (qwen3_next, qwen3_5_moe, "
      "deepseek_v3; HF shared_expert_intermediate_size); null: none")
  # Group-limited sigmoid routing (deepseek_v3: moe_ffn(routing="group_sigmoid")).
  router_scoring: Literal["softmax", "sigmoid"] = Field(
      default="softmax", description="router scores: softmax (mixtral, qwen3_moe) or sigmoid (deepseek_v3, with "
      "group-limited selection)")
  n_group: int = Field(default=1, gt=0, description="sigmoid routing: expert groups (consecutive ids; must divide "
                       "num_experts), each scored by the sum of its top 2 biased scores (HF n_group)")
  topk_group: int = Field(default=1, gt=0, description="sigmoid routing: groups kept per token (at most n_group); "
                          "the top-k experts come from them (HF topk_group)")
  routed_scaling_factor: float = Field(default=1.0, gt=0, description="sigmoid routing: the routed experts' "
                                       "weights are multiplied by this (HF routed_scaling_factor)")
  router_bias_update_rate: float = Field(
      default=0.0, ge=0, description="sigmoid routing's aux-loss-free balancing: after each step router_bias += "
      "rate * sign(mean load - load) per expert, from the whole batch's routing counts; 0: frozen")
  router_group_mask: Literal["zero", "-inf"] = Field(
      default="zero", description="sigmoid routing: what the experts of dropped groups score in the final top-k: "
      "zero (DeepSeek's published modeling_deepseek.py) or -inf (transformers 5's DeepseekV3TopkRouter); they "
      "differ only where a kept expert's biased score is negative")

  # Knobs this section had and no longer reads, dropped where a saved config (a run's config.yaml) still holds them:
  # kernel_cast (convert | bits), bit-identical either way, now the one rule of every kernel (Context.cast).
  RETIRED: ClassVar[tuple[str, ...]] = ("kernel_cast",)

  @pydantic.field_validator("megablox_tiling")
  @classmethod
  def _whole_tiles(cls, tiling):
    if tiling is not None and (tiling[0] <= 0 or tiling[0] % 8 or any(t <= 0 or t % 128 for t in tiling[1:])):
      raise ValueError(f"{list(tiling)}: tm must be a positive multiple of 8 and tk, tn of 128 (the TPU's (8, 128) "
                       "tiles); or null for the auto rule")
    return tiling

  @pydantic.field_validator("ep_buffer_factor")
  @classmethod
  def _buffer_needs_compact(cls, factor: float | None, info) -> float | None:
    impl = info.data.get("ep_impl")  # validated before it (field order)
    if factor is not None and impl != "compact":
      raise ValueError(f"{factor}: only ep_impl=compact reads it (ep_impl={impl}); set model.parts.moe.ep_impl="
                       "compact or leave it null")
    return factor

  @pydantic.field_validator("num_experts_per_tok")
  @classmethod
  def _at_most_every_expert(cls, k: int, info) -> int:
    E = info.data.get("num_experts")  # validated before it (field order)
    if E is not None and k > E:
      raise ValueError(f"{k} is larger than num_experts={E}: each token can be routed to at most every expert")
    return k


def knobs(m: ModelConfig) -> MoEConfig:
  """model.parts.moe, its defaults filled in."""
  return section(m, _SECTION)


def layout_for(cfg: Config) -> str:
  """kernel_fsdp's null: "experts" where moving the tokens to the experts costs less than moving the experts to
  the tokens, else "embed" (docs/performance.md, "MoE at the speed of its FLOPs").

  Per layer and device, "embed" gathers the three kernels whole, 3 E D F elements (and reduce-scatters as many
  gradient elements); "experts" runs the dispatch (the row gather, the GLU, the unsort) over the routed rows of
  the whole expert group, ep x tokens x k x (D + 2F) elements, ep = mesh.expert x the fsdp size. Where the fsdp
  size is not known from the config (mesh.fsdp=-1 without cpu_devices: the real devices decide) or is 1, "embed".
  Where mesh.expert x fsdp does not divide E, "experts" falls back to embed in parallel/sharding.py anyway."""
  m, t, mesh, own = cfg.model, cfg.train, cfg.mesh, knobs(cfg.model)
  fsdp = mesh.fsdp
  if fsdp == -1:
    others = mesh.data * mesh.tensor * mesh.expert * mesh.context
    fsdp = cfg.cpu_devices // others if cfg.cpu_devices and cfg.cpu_devices % others == 0 else None
  if fsdp is None or fsdp == 1:
    return "embed"  # unknown, or no FSDP: nothing to choose (the experts dim then shards over mesh.expert alone)
  ep = mesh.expert * fsdp
  rows = t.per_device_batch_size * t.seq_len // t.micro_batches * own.num_experts_per_tok
  dispatch = ep * rows * (m.embed_dim + 2 * own.mlp_dim)
  return "experts" if dispatch <= 3 * own.num_experts * m.embed_dim * own.mlp_dim else "embed"


def run_knobs(cfg: Config) -> dict:
  """kernel_fsdp null, decided for the run by layout_for (MeshRules.run_knobs)."""
  return {"kernel_fsdp": layout_for(cfg)} if knobs(cfg.model).kernel_fsdp is None else {}


def check_mesh(m: ModelConfig, sizes: dict[str, int]) -> None:
  """Expert weights shard whole experts over mesh.expert, so it must divide num_experts; with kernel_fsdp=experts
  over mesh.expert x mesh.fsdp (null falls back to embed instead). sizes: the axes known so far (MeshRules.check)."""
  own = knobs(m)
  E, expert = own.num_experts, sizes.get("expert", 1)
  if E % expert:
    raise ConfigError(f"mesh.expert={expert} does not divide model.parts.moe.num_experts={E}; pick a mesh.expert "
                      f"that divides {E}")
  fsdp = sizes.get("fsdp")
  if fsdp is not None and own.kernel_fsdp == "experts" and E % (expert * fsdp):
    raise ConfigError(f"model.parts.moe.kernel_fsdp=experts: mesh.expert x mesh.fsdp = {expert} x {fsdp} does not "
                      f"divide model.parts.moe.num_experts={E}; use model.parts.moe.kernel_fsdp=embed (or null, which "
                      "falls back to it)")


# --- the layout search and estimate (MeshRules.search, drops, memory; analysis/layout.py) ------------------------

ROW_BUFFERS = 4  # the dispatch's [rows, embed] buffers live at once in a layer's backward: the recomputed forward's
# gathered rows, the returning rows (an all-to-all's operand and result under compact) and the backward's unsort
GLU_BUFFERS = 3  # the [rows, expert width] buffers: gate's and up's outputs and their product
SEED_BUFFER_FACTOR = 2.75  # the RL seed's ep_buffer_factor (docs/moe.md): the compact buffers the search tries
# What --fit=layout varies of the section where the user left a knob unset (ep_buffer_factor: None is dropless).
SEARCH = {"ep_impl": ("gather", "compact"), "kernel_fsdp": ("embed", "experts"),
          "ep_buffer_factor": (None, SEED_BUFFER_FACTOR), "grad_reduce_barrier": (False, True)}


def search_drops(values) -> bool:
  """A buffer factor the search chose: rows past its buffers drop (the model's numbers change)."""
  return values.get("ep_buffer_factor") is not None


def layer_memory(cfg: Config, sizes: dict, mesh, tokens: int) -> LayerMemory:
  """One MoE layer in the layout estimate: its expert kernels split over the expert-parallel group (ep: the mesh axes
  of their experts dim), the dispatch's routed-row buffers in the compute dtype (ROW_BUFFERS rows x embed and
  GLU_BUFFERS rows x the expert width; the rows: the device's own slots, tokens x top-k, without expert parallelism,
  the expert group's under ep_impl=gather (the ep devices that share the batch x tokens x top-k), ep x C under
  ep_impl=compact, C = expert_parallel.capacity), and, without grad_reduce_barrier, every MoE layer's kernel
  gradients of the scanned period live at once."""
  import numpy as np
  from meshlm.parallel.sharding import logical_spec
  m, own = cfg.model, knobs(cfg.model)
  E, k, F, D = own.num_experts, own.num_experts_per_tok, own.mlp_dim, m.embed_dim
  cb = np.dtype(cfg.train.compute_dtype).itemsize
  ep_axes = moe.ep_mesh_axes(logical_spec((moe.experts_axis(own.kernel_fsdp),), (E,), mesh))
  ep = math.prod(sizes[a] for a in ep_axes)
  rows_global = cfg.train.per_device_batch_size * math.prod(sizes.values()) // cfg.train.micro_batches
  bspec = logical_spec(moe.TOKENS, (rows_global, cfg.train.seq_len, k), mesh)
  batch_axes = set((bspec[0],) if isinstance(bspec[0], str) else tuple(bspec[0] or ()))
  gathered = math.prod(sizes[a] for a in ep_axes if a in batch_axes)
  shared = math.prod(sizes[a] for a in ep_axes if a not in batch_axes)
  if ep == 1:
    rows = tokens * k
  elif own.ep_impl == "gather":
    rows = tokens * gathered * k
  else:
    rows = ep * moe.capacity(-(-tokens // shared) * k, ep, own.ep_buffer_factor)
  return LayerMemory(buffers=rows * (ROW_BUFFERS * D + GLU_BUFFERS * F) * cb,
                     split=lambda s: ep if is_expert(s) else None,
                     grads_every_layer=not own.grad_reduce_barrier)


def prepare(p: dict, specs: dict, dtype) -> dict:
  del dtype  # the router computes in model.parts.moe.router_dtype, from the stored kernel's values
  return dict(p, router_full=moe.gather_router_once(p["router"], specs["router"].axes))


def check_forced(m: ModelConfig, forced, shape: tuple[int, ...], name: str = FORCED_IDS) -> None:
  """forced_expert_ids ([L_moe, B, T, k] to the decoder, [B, T, L_moe, k] in a batch): its shape, and its
  range when concrete."""
  check_forced_ids(forced, shape, knobs(m).num_experts, name)


# Router replay's per-layer input; RL reports how often the trainer's routing leaves the sampler's (router flips).
FORCED = LayerInput(trailing=lambda m: (knobs(m).num_experts_per_tok,), check=check_forced, flips="router_flips")


def is_expert(s: S.ParamSpec) -> bool:
  """A routed expert's parameter: an experts axis among its logical axes (moe_spec's EXPERTS_AXES)."""
  return any(a in moe.EXPERTS_AXES for a in s.axes)


def routed_fraction(m: ModelConfig, s: S.ParamSpec) -> float:
  """The share of a parameter one token's matmuls meet (Instrument.active_fraction): k / E of a kernel with an experts
  axis (a token runs k of the E experts), all of every other."""
  if is_expert(s):
    own = knobs(m)
    return own.num_experts_per_tok / own.num_experts
  return 1.0


def router_losses(m: ModelConfig) -> dict:
  """The router's loss terms whose coefficient is set: the load-balancing loss (transformers'
  load_balancing_loss_func over all MoE layers, nn/moe.py) and the z-loss (the mean over the layers of
  each layer's mean squared logsumexp), as {metric: (coef, fn(side))} (Part.losses)."""
  out, own = {}, knobs(m)
  if own.router_aux_loss_coef > 0:
    out["moe_aux_loss"] = (own.router_aux_loss_coef, moe.load_balancing_loss)
  if own.router_z_loss_coef > 0:
    out["moe_z_loss"] = (own.router_z_loss_coef, lambda side: jnp.mean(side["moe_z_loss"]))
  return out


def drop_metrics(m: ModelConfig) -> dict:
  """ep_impl=compact's logged statistics (Part.metrics): the fraction of the routed (token, slot) pairs its
  bounded buffers dropped, the mean over the MoE layers ("moe_dropped") and the largest layer's
  ("moe_dropped_max"), from the side output moe_dropped [L_moe]; 0 when dropless. {} under ep_impl=gather."""
  if knobs(m).ep_impl != "compact":
    return {}
  return {"moe_dropped": lambda side: jnp.mean(side[moe.DROPPED]),
          "moe_dropped_max": lambda side: jnp.max(side[moe.DROPPED])}


def moe_spec(m: ModelConfig) -> dict:
  """The routed experts' parameters (nn/moe/layer.py moe_spec) at the section's sizes and kernel layout."""
  own = knobs(m)
  return moe.moe_spec(m.embed_dim, own.num_experts, own.mlp_dim, own.kernel_fsdp)


def options(m: ModelConfig, ctx=None) -> moe.Options:
  """What the MoE layer needs besides its section: the model's activation, the kernels' logical axes (moe_spec's) and
  the context's kernel cast (astype without a context). (A family that always renormalizes, mixtral and qwen3_5_moe,
  refuses norm_topk_prob=false in its checks.)"""
  return moe.Options(activation=ACTIVATIONS[m.hidden_activation], cast=None if ctx is None else ctx.cast,
                     kernel_axes=tuple(moe_spec(m)[n].axes for n in KERNELS))


def apply(p: dict, x_BTD: jax.Array, ctx, state=None, *, shared: bool = False, shared_gate: bool = True,
          routing: str = "softmax"):
  """shared: add the shared expert (sigmoid-gated when shared_gate). routing: "softmax" or "group_sigmoid" (the
  router bias and the padding mask; the scoring itself is the knob router_scoring, which the family's checks
  hold to its routing)."""
  kw = {}
  if routing == "group_sigmoid":
    seg = ctx.here.segment_ids
    # Padding (segment 0) is not counted.
    kw = dict(router_bias=p[ROUTER_BIAS], token_mask_BT=None if seg is None else (seg > 0))
  own, opts = knobs(ctx.model), options(ctx.model, ctx)
  if own.grad_reduce_barrier:
    # The one place it is applied: over every use of x (the shared expert's too), so that x's gradient sums its
    # parts in the same order as without the barrier (inside moe_mlp, with the shared expert's part added after
    # it, x's gradient was 1 ulp off).
    p, x_BTD = moe.reduce_barrier(p, x_BTD, opts.kernel_axes)
  y, side = moe.moe_mlp(p, x_BTD, ctx, own, opts,
                        forced_ids_BTk=ctx.layer.get(FORCED_IDS), router_full=p["router_full"], **kw)
  if shared:
    y = y + shared_expert(p, x_BTD, ctx, gated=shared_gate)
  return y, None, side


def shared_spec(m: ModelConfig, gated: bool = True) -> dict:
  D, F = m.embed_dim, knobs(m).shared_expert_mlp_dim
  out = {
      "shared_gate": S.kernel((D, F), ("embed", "mlp")),
      "shared_up": S.kernel((D, F), ("embed", "mlp")),
      "shared_down": S.kernel((F, D), ("mlp", "embed")),
  }
  if gated:
    out["shared_expert_gate"] = S.kernel((D, 1), ("embed", None))
  return out


def shared_expert(p: dict, x_BTD: jax.Array, ctx, gated: bool = True) -> jax.Array:
  """sigmoid(x @ shared_expert_gate) * glu(x) [B, T, D]; glu(x) alone when not gated. Its kernels cast through
  ctx.cast, as every other part's."""
  dt = x_BTD.dtype
  with jax.named_scope("shared_expert"):
    h = glu_mlp({"gate": p["shared_gate"], "up": p["shared_up"], "down": p["shared_down"]}, x_BTD, dense=ctx.dense,
                activation=ACTIVATIONS[ctx.model.hidden_activation], cast=ctx.cast)
    if not gated:
      return h
    with jax.named_scope("shared_expert_gate"):
      s = ctx.dense(x_BTD, ctx.cast(p["shared_expert_gate"], dt), "btd,do->bto", ("batch", "length", None))  # [B, T, 1]
    return jax.nn.sigmoid(s) * h


def spec_with_shared(m: ModelConfig, gated: bool = True) -> dict:
  return {**moe_spec(m), **shared_spec(m, gated)}


def router_bias_state(m: ModelConfig) -> dict:
  """The model state of a group_sigmoid layer: router_bias [E], zeros, replicated (it is tiny)."""
  return {ROUTER_BIAS: S.ParamSpec((knobs(m).num_experts,), (None,), "zeros", decay=False)}


def update_router_bias(leaves: dict, side: dict, m: ModelConfig) -> dict:
  """after_step: the aux-loss-free rule on router_bias [L, E] from the batch's load [L, E]."""
  return {ROUTER_BIAS: moe.bias_update(leaves[ROUTER_BIAS], side[LOAD], knobs(m).router_bias_update_rate)}


def validate_group_routing(m: ModelConfig, *, shared: bool = False) -> None:
  """The knobs group-limited sigmoid routing needs (and with shared, the shared experts' width); one ConfigError
  line naming the key otherwise."""
  own, fam, key = knobs(m), m.family, "model.parts.moe."
  E, k, G = own.num_experts, own.num_experts_per_tok, own.n_group
  if shared and own.shared_expert_mlp_dim is None:
    raise ConfigError(f"{key}shared_expert_mlp_dim: required by model.family={fam} (its shared experts, HF "
                      "n_shared_experts x moe_intermediate_size)")
  if own.router_scoring != "sigmoid":
    raise ConfigError(f"{key}router_scoring={own.router_scoring}: model.family={fam} routes with group-limited "
                      f"sigmoid scores; set {key}router_scoring=sigmoid")
  if E % G:
    raise ConfigError(f"{key}n_group={G} does not divide {key}num_experts={E}: the groups are equal runs of experts")
  if G > 1 and E // G < 2:
    raise ConfigError(f"{key}n_group={G}: each group scores the sum of its top 2 experts, so it needs at least 2 "
                      f"(num_experts={E} gives {E // G}); use n_group <= {E // 2}")
  if own.topk_group > G:
    raise ConfigError(f"{key}topk_group={own.topk_group} is larger than {key}n_group={G}: a token keeps at most "
                      "every group")
  if k > own.topk_group * (E // G):
    raise ConfigError(f"{key}num_experts_per_tok={k} is larger than topk_group x experts per group = "
                      f"{own.topk_group} x {E // G}: the kept groups hold too few experts; raise {key}topk_group")
  if own.router_dtype != "float32":
    raise ConfigError(f"{key}router_dtype={own.router_dtype}: group-limited sigmoid routing computes its router "
                      "logits in float32; leave it at float32")
  if own.router_aux_loss_coef > 0:
    raise ConfigError(f"{key}router_aux_loss_coef={own.router_aux_loss_coef}: the Switch load-balancing loss reads "
                      "softmax probabilities; group-limited sigmoid routing balances through its routing bias "
                      f"({key}router_bias_update_rate); leave it at 0")


def validate_softmax_routing(m: ModelConfig) -> None:
  """A softmax-routed family refuses the group-routing knobs it would ignore (one ConfigError line)."""
  own = knobs(m)
  if own.router_scoring != "softmax":
    raise ConfigError(f"model.parts.moe.router_scoring={own.router_scoring}: model.family={m.family} routes with "
                      "softmax")
  for knob, default in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0),
                        ("router_bias_update_rate", 0.0)):
    if getattr(own, knob) != default:
      raise ConfigError(f"model.parts.moe.{knob}={getattr(own, knob)}: only group-limited sigmoid routing reads it "
                        f"(model.family={m.family} routes with softmax); leave it at {default}")


ROUTINGS = ("softmax", "group_sigmoid")


def moe_ffn(*, shared: bool = False, shared_gate: bool = True, routing: str = "softmax") -> Part:
  """shared: a shared expert beside the routed ones (shared_expert_mlp_dim wide), scaled by
  sigmoid(shared_expert_gate(x)) when shared_gate. routing: "softmax" (top-k of the softmax) or
  "group_sigmoid" (DeepSeek-V3's group-limited sigmoid routing, the router_bias model state and its
  aux-loss-free after_step; the family calls validate_group_routing)."""
  if routing not in ROUTINGS:
    raise ValueError(f"moe_ffn(routing={routing!r}): expected one of {ROUTINGS}")
  spec = functools.partial(spec_with_shared, gated=shared_gate) if shared else moe_spec
  group = routing == "group_sigmoid"
  state = ModelState(spec=router_bias_state, after_step=update_router_bias, side={LOAD: "sum"}) if group else None
  return Part(name="moe", key="moe", spec=spec, position_wise=True,
              apply=functools.partial(apply, shared=shared, shared_gate=shared_gate, routing=routing),
              config=MoEConfig, side_names=SIDE_NAMES + ((LOAD,) if group else ()), losses=router_losses,
              metrics=drop_metrics,
              compute=Compute(prepare=prepare, remat_save_names=moe.REMAT_SAVE_NAMES),
              replay=Replay(layer_inputs={FORCED_IDS: FORCED}, replays={ROUTED_IDS: FORCED_IDS}),
              model_state=state,
              mesh=MeshRules(axes=("expert",), check=check_mesh, run_knobs=run_knobs, stack_rows=KERNELS, search=SEARCH,
                             drops=search_drops, memory=layer_memory),
              instrument=Instrument(census=CENSUS, active_fraction=routed_fraction))


_SECTION = moe_ffn()  # what `section` reads of the part (its name and config) is the same however it is built
