"""The MoE layer: its parameters (moe_spec), its options beyond the part's section (Options) and moe_mlp, which
takes the section itself (the moe part's MoEConfig: its knobs are read there, by their names, and defaulted there
alone), routes, then
runs the experts through the sorted dispatch (impl "dropless": dropless.py, and expert_parallel.py under expert
parallelism, whose compact form drops the rows past its buffers) or, for tests, every expert on every token
(impl "reference": nn/moe_reference.py).

Under a mesh, the dispatch runs inside `shard_map`, the same code under explicit and auto sharding.
Which mesh axes shard the kernels' experts dim is sharding data (the kernel_fsdp layout, the moe part's
knob model.parts.moe.kernel_fsdp, picks the logical axis names in moe_spec; parallel/sharding.py's RULES map them):
- no mesh axis shards the experts (mesh.expert = 1 with kernel_fsdp embed or mlp): per batch (and
  length) shard; tokens stay on their device, the expert kernels are gathered whole.
- the experts dim is sharded over ep devices, on mesh.expert, mesh.fsdp or both: expert parallelism
  (expert_parallel.py: ep_impl "gather" or "compact"); with kernel_fsdp embed or mlp FSDP still gathers the kernels'
  other dim.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from meshlm import spec as S
from meshlm.nn import gather_once
from meshlm.nn.dense import dense as dense_primitive
from meshlm.nn.moe.dropless import dispatch, expert_grad_barrier
from meshlm.nn.moe.expert_parallel import (EP_IMPLS, capacity, dispatch_compact, dispatch_gather, ep_mesh_axes,
                                           split_pays)
from meshlm.nn.moe.routing import (GROUP_MASKS, ROUTER_AXES, ROUTER_LOGITS, ROUTER_SCORINGS, aux_stats, expert_load,
                                   group_limited_topk, group_route, route, sigmoid_weights)
from meshlm.nn.router_replay import REPLAY_ROWS, check_forced_ids, replay_route
from meshlm.nn.stack_row import StackRow, array_of, is_row, materialize
from meshlm.parallel.sharding import auto_region, constrain, current_mesh, logical_spec

TOKENS = ("batch", "length", None)
# The logical names of a kernel's experts dim: "experts" (over mesh.expert) or, with kernel_fsdp
# experts or null, "experts_fsdp" (over mesh.expert and mesh.fsdp). The HF adapters' per-expert tensors declare
# these as the axes their {e} indexes (hf/maps.Tensor.inner_axes).
EXPERTS_AXES = ("experts", "experts_fsdp")
DROPPED = "moe_dropped"  # the side output: the fraction of the layer's routed slots the compact dispatch dropped
SCOPE = "moe"  # the layer's named scope, its shard_map included (the census counts its gathers and scatters)
KERNEL_FSDP = ("experts", "embed", "mlp")  # kernel_fsdp's values (null: "experts", falling back to embed)


def experts_axis(kernel_fsdp: str | None) -> str:
  """The logical name of the expert kernels' experts dim for the kernel_fsdp layout."""
  if kernel_fsdp is not None and kernel_fsdp not in KERNEL_FSDP:
    raise ValueError(f"kernel_fsdp={kernel_fsdp!r}: expected one of {KERNEL_FSDP} or None")
  return "experts_fsdp" if kernel_fsdp in (None, "experts") else "experts"


def moe_spec(embed_dim: int, num_experts: int, mlp_dim: int, kernel_fsdp: str | None = None) -> dict:
  """Parameters of one MoE layer: router [D, E], gate/up [E, D, F], down [E, F, D].

  kernel_fsdp picks what mesh.fsdp shards in the kernels, as logical axis names: "experts" (or null) the experts
  dim ("experts_fsdp"; where mesh.expert x mesh.fsdp does not divide E, fsdp drops off it and shards the embed
  dim, as "embed"), "embed" the embed dim, "mlp" gate/up's embed and down's mlp dim.
  """
  D, E, F = embed_dim, num_experts, mlp_dim
  e = experts_axis(kernel_fsdp)
  return {
      "router": S.kernel((D, E), ROUTER_AXES),
      "gate": S.kernel((E, D, F), (e, "embed", "mlp"), n_in=2),
      "up": S.kernel((E, D, F), (e, "embed", "mlp"), n_in=2),
      "down": S.kernel((E, F, D), (e, "mlp_fsdp" if kernel_fsdp == "mlp" else "mlp", "embed"), n_in=2),
  }


def astype(w: jax.Array, dt) -> jax.Array:
  """The kernels' cast when no Context gives one (tests, benchmarks): astype."""
  return w.astype(dt)


@dataclasses.dataclass(frozen=True)
class Options:
  """What one MoE layer reads besides its arrays and its section's knobs (the section itself, the moe part's
  MoEConfig, model.parts.moe.<knob>, is passed as it is, `knobs` below; its fields are documented there once):

  - activation: the experts' GLU activation (the model's hidden_activation).
  - cast: cast(kernel, dtype) -> the kernel in the rows' dtype, the same rule as every other kernel of the layer
    (the part passes Context.cast); astype when None.
  - kernel_axes: the logical axes of gate, up and down (moe_spec's), for kernels given as StackRow (an unrolled
    layer's row left in its stack, nn/stack_row.py): under a mesh a StackRow is read in place only where its stack is
    stored as the dispatch needs it (whole, or sharded on the experts dim alone under expert parallelism); elsewhere,
    or without kernel_axes, its row is sliced out first.
  - block_rows: gmm.py's blocks. fused_gate_up, unsort_impl, grad_barrier: dropless.py's plain variants (tests and
    benchmarks set them; the defaults are the fast paths).
  - replay_rows, replay_impl: router replay (nn/router_replay.py): top-k over at most replay_rows of the unforced
    rows ("compact") or over all rows ("full"), bit-identical either way.
  """
  activation: Callable = jax.nn.silu
  cast: Callable | None = None
  kernel_axes: tuple | None = None
  block_rows: int | None = None
  fused_gate_up: bool = True
  unsort_impl: str = "perm"
  grad_barrier: bool = True
  replay_rows: int = REPLAY_ROWS
  replay_impl: str = "compact"

  def cast_to(self, w, dt):
    """cast, or astype without one."""
    return (self.cast or astype)(w, dt)


def moe_mlp(p: dict, x_BTD: jax.Array, ctx, knobs, opts: Options = Options(), *,
            token_mask_BT: jax.Array | None = None, forced_ids_BTk: jax.Array | None = None,
            router_full: jax.Array | None = None, router_bias: jax.Array | None = None):
  """The MoE feed-forward layer: (y [B, T, D], side) with side = aux_stats(...) (float32) plus
  "moe_expert_ids", the routed ids [B, T, k] int32 (what router replay records and forces), "moe_dropped" (the
  fraction of the routed slots the compact expert-parallel dispatch dropped, float32; 0 elsewhere); with sigmoid
  scoring also "moe_expert_load" [E] (expert_load: routed pairs per expert, padding excluded), and the aux
  statistics' "prob" is then the mean sigmoid score.

  p: {"router": [D, E], "gate": [E, D, F], "up": [E, D, F], "down": [E, F, D]}; router_full: this
  layer's slice of the router stack gathered once before the layers (gather_router_once). ctx supplies the
  dense primitive (ctx.dense); None uses the plain nn.dense.dense. knobs: the moe part's section (MoEConfig, any
  object with its fields); opts: the rest (Options).
  token_mask_BT (1 = real token) weighs the aux statistics (and, under replay, spares padding top-k).
  forced_ids_BTk (int32 [B, T, k], -1 = not forced): router replay (nn/router_replay.py). Forced tokens
  use these ids with weights from the live router probabilities. router_bias [E]: sigmoid scoring's
  selection bias (zeros when None).
  """
  E, k = knobs.num_experts, knobs.num_experts_per_tok
  if not 1 <= k <= E:
    raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={E}")
  dense = dense_primitive if ctx is None else ctx.dense
  with jax.named_scope(SCOPE):
    with jax.named_scope("router"):
      logits, probs, w, ids = _route(p, x_BTD, dense, knobs, opts, token_mask_BT, forced_ids_BTk, router_full,
                                     router_bias)
    side = dict(aux_stats(logits, probs, ids, E, token_mask_BT), moe_expert_ids=ids)
    if knobs.router_scoring == "sigmoid":
      side["moe_expert_load"] = expert_load(ids, E, token_mask_BT)
    if knobs.impl == "reference":
      side[DROPPED] = jnp.zeros((), jnp.float32)
      return _experts_reference(p, x_BTD, ids, w, opts), side
    if knobs.impl != "dropless":
      raise ValueError(f"impl={knobs.impl!r}: expected dropless or reference")
    y, dropped = _experts_dropless(p, x_BTD, ids, w, knobs, opts, decode=getattr(ctx, "mode", None) == "decode")
    side[DROPPED] = jnp.sum(dropped).astype(jnp.float32) / ids.size
    return y, side


def reduce_barrier(p: dict, x_BTD: jax.Array, kernel_axes: tuple | None = None) -> tuple[dict, jax.Array]:
  """(p, x) unchanged in value, with x and the expert kernels gate, up, down passed through expert_grad_barrier,
  then the kernels pinned to their parameter layout (kernel_axes: their logical axes, moe_spec's; None: not
  pinned). In the backward that pin's transpose reduces each kernel's gradient to its parameter sharding (under
  kernel_fsdp embed or mlp: the reduce-scatter over fsdp of the gradient the layer computed whole, in float32), and
  the barrier hands x's gradient on only with those reduced gradients: the layer before cannot start its backward
  while this layer's whole-over-fsdp kernel gradients are in flight, so at most one layer's are live (XLA's
  scheduler otherwise leaves their reduce-scatters open over the following layers' backward). Bit-identical.
  Kernels left in their stacks (StackRow) are not barred (expert_rows: their cotangents are stack-shaped pads)."""
  names = ("gate", "up", "down")
  if any(is_row(p[n]) for n in names):
    return p, x_BTD
  x_BTD, kernels = expert_grad_barrier(x_BTD, tuple(p[n] for n in names))
  if kernel_axes is not None:
    kernels = tuple(constrain(a, ax) for a, ax in zip(kernels, kernel_axes))
  return dict(p, **dict(zip(names, kernels))), x_BTD


def _route(p, x_BTD, dense, knobs, opts: Options, token_mask_BT, forced_ids_BTk, router_full, router_bias):
  """(logits [B, T, E], probs [B, T, E], weights [B, T, k], ids [B, T, k]): the router's logits in
  knobs.router_dtype and knobs.router_scoring's top-k, or router replay's with forced ids."""
  E, k = knobs.num_experts, knobs.num_experts_per_tok
  rdt = jnp.dtype(knobs.router_dtype)
  router = p["router"] if router_full is None else gather_once.gathered(p["router"], router_full, ROUTER_AXES)
  logits = dense(x_BTD.astype(rdt), router.astype(rdt), "btd,de->bte", ROUTER_LOGITS)  # [B, T, E]
  if forced_ids_BTk is not None:
    check_forced_ids(forced_ids_BTk, (*x_BTD.shape[:2], k), E)
  replay = dict(rows=opts.replay_rows, impl=opts.replay_impl)
  norm = knobs.norm_topk_prob
  if knobs.router_scoring == "softmax":
    if forced_ids_BTk is None:
      return (logits, *route(logits, k, norm))
    return (logits, *replay_route(logits, forced_ids_BTk, k, norm, token_mask_BT, **replay))
  if knobs.router_scoring == "sigmoid":
    bias = jnp.zeros((E,), jnp.float32) if router_bias is None else router_bias.astype(jnp.float32)
    groups = dict(n_group=knobs.n_group, topk_group=knobs.topk_group, dropped=GROUP_MASKS[knobs.router_group_mask])
    if forced_ids_BTk is None:
      return (logits, *group_route(logits, bias, k, norm_topk=norm, scaling=knobs.routed_scaling_factor, **groups))
    select = functools.partial(group_limited_topk, **groups)
    weigh = functools.partial(sigmoid_weights, norm_topk=norm, scaling=knobs.routed_scaling_factor)
    return (logits, *replay_route(logits, forced_ids_BTk, k, norm, token_mask_BT, **replay,
                                  scoring="sigmoid", select=select, select_args=(bias,), weigh=weigh))
  raise ValueError(f"router scoring={knobs.router_scoring!r}: expected one of {ROUTER_SCORINGS}")


def _experts_reference(p, x_BTD, ids_BTk, w_BTk, opts: Options):
  """Every expert on every token, in an auto-axes region: under explicit sharding its einsums' operands
  (batch on fsdp, the kernels' embed on fsdp) have no one output sharding, and the reference must run
  on every mesh in both modes."""
  from meshlm.nn.moe_reference import experts_reference
  ref = auto_region(functools.partial(experts_reference, activation=opts.activation), ("batch", "length", "act_embed"),
                    x_BTD.shape)
  return ref(x_BTD, ids_BTk, w_BTk, *(materialize(p[n]) for n in ("gate", "up", "down")))


def _experts_dropless(p, x_BTD, ids, w, knobs, opts: Options, decode: bool = False):
  """(y, dropped): the sorted dispatch of the routed tokens: on local tokens without a mesh, else inside
  shard_map, per batch (and length) shard or expert-parallel (expert_parallel.py). dropped: the slots the dispatch
  dropped per token shard (int32 [batch shards, length shards]; only the compact one drops). decode: a sampler's
  step, where the compact dispatch may leave the kernels split on their embed dim (_split_axes)."""
  if knobs.ep_impl not in EP_IMPLS:
    raise ValueError(f"ep_impl={knobs.ep_impl!r}: expected one of {EP_IMPLS}")
  e_axis, kernel_axes = experts_axis(knobs.kernel_fsdp), opts.kernel_axes
  kernels = (p["gate"], p["up"], p["down"])
  mesh = current_mesh()
  if mesh.empty:
    return _dispatch_BT(x_BTD, ids, w, *kernels, knobs=knobs, opts=opts)
  spec = _batch_spec(x_BTD.shape)
  kspec = logical_spec((e_axis,), kernels[-1].shape[:1])
  ep_axes = ep_mesh_axes(kspec)
  split = _split_axes(knobs, kernels, x_BTD.shape, spec, ep_axes, mesh) if decode else ()
  if split:
    # The kernels as stored, split on the experts and embed dims; gate/up's mlp dim gathered over tensor, if split.
    want = [(e_axis, "embed", None), (e_axis, "embed", None), (e_axis, None, "embed")]
    kernels = tuple(constrain(materialize(a), wa) for a, wa in zip(kernels, want))
    kspecs = tuple(logical_spec(wa, a.shape) for a, wa in zip(kernels, want))
  else:
    # The kernels as the dispatch needs them: whole (gathered), or under expert parallelism sharded on the
    # experts dim alone (each device keeps its E / ep experts; their other dims gathered, if sharded).
    want = [(e_axis if ep_axes else None,) + (None,) * (a.ndim - 1) for a in kernels]
    kernels = tuple(_in_place(a, wa, None if kernel_axes is None else ax)
                    for a, wa, ax in zip(kernels, want, kernel_axes or (None,) * 3))
    kernels = tuple(a if is_row(a) else constrain(a, wa) for a, wa in zip(kernels, want))
    kspecs = tuple(jax.sharding.PartitionSpec(None, *kspec) if is_row(a) else kspec if ep_axes else
                   jax.sharding.PartitionSpec() for a in kernels)
  x_BTD, ids, w = (constrain(a, TOKENS) for a in (x_BTD, ids, w))
  rows = tuple(a.index if is_row(a) else None for a in kernels)
  if not ep_axes:
    # One dispatch per batch (and length) shard: tokens stay on their device.
    body = _dispatch_BT
  else:
    # Expert parallelism: each device computes its experts for the tokens of its expert group, gathered whole
    # ("gather") or only the rows routed to it, in a bounded buffer per peer ("compact": each token shard counts
    # the slots it dropped).
    gathered = tuple(a for a in ep_axes if a in _axes_of(spec[:1]))
    body = functools.partial(dispatch_compact if knobs.ep_impl == "compact" else dispatch_gather, ep_axes=ep_axes,
                             gathered=gathered, **({"split_axes": split} if split else {}))
  # Split kernels: the devices of a split axis the batch is not split on (mesh.context in decode) hold the same rows
  # and compute the same outputs from the same all-reduced sums, which the type check cannot see (check_vma off).
  return jax.shard_map(functools.partial(_with_rows, body, rows, knobs=knobs, opts=opts),
                       in_specs=(spec, spec, spec) + kspecs, out_specs=(spec, jax.sharding.PartitionSpec(*spec[:2])),
                       check_vma=not split)(x_BTD, ids, w, *(array_of(a) for a in kernels))


def _split_axes(knobs, kernels, shape_BTD, spec, ep_axes: tuple[str, ...], mesh) -> tuple[str, ...]:
  """The mesh axes the compact dispatch's kernels stay split over in a decode step (their embed dim's, under
  kernel_fsdp=embed; expert_parallel.expert_rows_split), or (): decode_kernels=split, or auto where split_pays for
  this step's rows (the receive buffer, ep x C) against gathering the kernels; gathered elsewhere (other layouts and
  dispatches)."""
  choice = getattr(knobs, "decode_kernels", "gathered")
  if choice == "gathered" or knobs.ep_impl != "compact" or not ep_axes or knobs.kernel_fsdp != "embed":
    return ()
  gate = array_of(kernels[0])
  # The embed dim's mesh axes as stored, in the PartitionSpec's order (a device's slice is their linear index).
  split = _axes_tuple(logical_spec((experts_axis(knobs.kernel_fsdp), "embed"), gate.shape[-3:-1])[1])
  if not split:
    return ()
  if choice == "split":
    return split
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  ep = math.prod(sizes[a] for a in ep_axes)
  shards = math.prod(sizes[a] for a in _axes_of(spec[:2]))
  shared = math.prod(sizes[a] for a in ep_axes if a not in _axes_of(spec[:1]))
  B, T, D = shape_BTD
  k, E, F = knobs.num_experts_per_tok, knobs.num_experts, gate.shape[-1]
  rows = ep * capacity(-(-(B * T // shards) // shared) * k, ep, knobs.ep_buffer_factor)
  return split if split_pays(rows, math.prod(sizes[a] for a in split), E // ep, D, F) else ()


def _axes_tuple(part) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axes."""
  return (part,) if isinstance(part, str) else tuple(part or ())


def _axes_of(spec) -> set[str]:
  """The mesh axes a PartitionSpec (or a slice of one) names."""
  out = set()
  for part in spec:
    out.update((part,) if isinstance(part, str) else (part or ()))
  return out


def _in_place(w, want: tuple, axes: tuple | None):
  """w, or a StackRow's row sliced out unless its stack is stored (logical axes ("layers",) + axes) as the
  dispatch wants the row (`want`), so reading it in place moves no data."""
  if not is_row(w):
    return w
  if axes is not None and logical_spec(("layers",) + tuple(axes), w.stack.shape) == logical_spec(
      (None,) + want, w.stack.shape):
    return w
  return w.get()


def _with_rows(fn, rows: tuple, x_BTD, ids_BTk, w_BTk, *kernels, **kw):
  """fn on the kernels, those with a row index given back as StackRow (shard_map passes their stacks); its dropped
  count as this shard's [1, 1]."""
  kernels = tuple(a if r is None else StackRow(a, r) for a, r in zip(kernels, rows))
  y, dropped = fn(x_BTD, ids_BTk, w_BTk, *kernels, **kw)
  return y, dropped.reshape(1, 1)


def _dispatch_BT(x_BTD, ids_BTk, w_BTk, gate, up, down, *, knobs, opts: Options):
  """dispatch on [B, T] tokens: (y [B, T, D], dropped int32 scalar, 0: the local dispatch drops nothing)."""
  B, T, D = x_BTD.shape
  k = ids_BTk.shape[-1]
  y, dropped = dispatch(x_BTD.reshape(B * T, D), ids_BTk.reshape(B * T, k), w_BTk.reshape(B * T, k), gate, up, down,
                        knobs, opts)
  return y.reshape(B, T, D), dropped


def _batch_spec(shape) -> jax.sharding.PartitionSpec:
  return logical_spec(TOKENS, shape)
