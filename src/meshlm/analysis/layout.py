"""The memory a layout needs per device, estimated from abstract shapes, and the layouts worth compiling
(`meshlm compile --fit=layout`, and `meshlm train`'s refusal of a layout that cannot fit).

`estimate(cfg, devices)` reads the config's parameter specs and the sharding rules (parallel/sharding.py
logical_spec on the mesh the config names) and adds named terms, bytes per device:

- `params`, `opt_state`, `model_state`: each leaf's shard, exactly as the compiled step's arguments hold them
  (AdamW's mu and nu in the parameters' dtype, for the trainable leaves);
- `grads`: the parameters' gradients, sharded as the parameters and in their dtype (the step's output before the
  update);
- `saved`: what the layer scan saves for the backward: each layer's input ([tokens, embed] in the compute dtype)
  under every remat policy (remat=dots and none save more: not counted, so the estimate is low there);
- `dispatch`: one MoE layer's routed-row buffers (nn/moe/): ROW_BUFFERS rows x embed and GLU_BUFFERS rows x the
  expert width, in the compute dtype, the rows being the device's own slots (tokens x top-k) without expert
  parallelism, the expert group's under ep_impl=gather (the ep devices that share the batch x tokens x top-k),
  ep x C under ep_impl=compact (C = expert_parallel.capacity: ep_buffer_factor x slots / ep per peer);
- `gathered_kernels`: the kernels of one layer as its dots read them, in the compute dtype, KERNEL_COPIES of them
  (the layer computing and the next one's gather in flight): every dense kernel whole (FSDP gathers it), an expert
  kernel E / ep experts wide (its experts dim stays sharded, its other dims are gathered);
- `kernel_grads`: those kernels' float32 gradients as the backward computes them, before they are reduced to the
  parameter sharding: one layer's, and the expert kernels' of every MoE layer of the scanned period without
  model.parts.moe.grad_reduce_barrier (XLA's scheduler leaves their reduce-scatters in flight; docs/compile.md);
- `layer`: the recomputed layer's activations: tokens x the widths its dense kernels produce, a compute-dtype value
  and its float32 cotangent each (the mixers' own state, GDN's chunk states, is not counted);
- `attention_scores`: where the attention core materializes its scores (xla: no flash or splash core applies),
  one layer's rows x heads x queries x keys per device, float32;
- `loss`: the head and its loss: the blockwise loss gathers the head once and accumulates its float32 gradient;
  the materialized one holds float32 logits and their gradient.

The estimate is arguments + grads + saved + the larger of the loss's phase and a layer's (dispatch,
gathered_kernels, kernel_grads, layer, attention_scores). It is not a bound: XLA's buffer assignment adds
temporaries it does not model. `floor` is one: the arguments, the looped layers' gradients and the saved layer
inputs are all live when the backward's layer loop starts (its stacked gradient buffers are allocated then, its
residuals not yet freed); `meshlm train` refuses a layout whose floor exceeds the device's memory.

`candidates(...)` lists the layouts to rank: the mesh splits (mesh.expert, mesh.context, mesh.fsdp the rest) and the
MoE knobs, every key the user did not set; `rank` orders them by the estimate.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

from meshlm.errors import ConfigError

GiB = 1 << 30
ROW_BUFFERS = 4  # the dispatch's [rows, embed] buffers live at once in a layer's backward: the recomputed forward's
# gathered rows, the returning rows (an all-to-all's operand and result under compact) and the backward's unsort
GLU_BUFFERS = 3  # the [rows, expert width] buffers: gate's and up's outputs and their product
KERNEL_COPIES = 2  # gathered layers' kernels live at once: the one computing and the next one's gather
SEED_BUFFER_FACTOR = 2.75  # the RL seed's ep_buffer_factor (docs/moe.md): the compact buffers the search tries
SEARCH_FACTORS = (None, SEED_BUFFER_FACTOR)  # ep_buffer_factor's values searched (None: dropless, nothing drops)
MOE = "model.parts.moe."


@dataclasses.dataclass
class Estimate:
  """Bytes per device: the named terms, the estimate (`peak`) and the lower bound (`floor`)."""
  terms: dict[str, int]
  peak: int
  floor: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _abstract_mesh(sizes: dict[str, int]):
  import jax
  from meshlm.parallel.mesh import AXES
  return jax.sharding.AbstractMesh(tuple(sizes[a] for a in AXES), AXES)


def _mesh_sizes(spec, mesh) -> list[int]:
  """Per dim, how many devices share it out (the product of the mesh axes the PartitionSpec names)."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  out = []
  for part in spec:
    names = (part,) if isinstance(part, str) else tuple(part or ())
    out.append(math.prod(sizes[a] for a in names))
  return out


def _shard_elems(s, mesh) -> int:
  """Elements of a ParamSpec's shard on one device, by the sharding rules (parallel/sharding.logical_spec)."""
  from meshlm.parallel.sharding import logical_spec
  spec = logical_spec(s.axes, s.shape, mesh)
  split = _mesh_sizes(tuple(spec) + (None,) * (len(s.shape) - len(spec)), mesh)
  return math.prod(d // k for d, k in zip(s.shape, split))


def _leaves(tree) -> list[tuple[list[str], object]]:
  import jax
  from meshlm import spec as S
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=S.is_spec)[0]
  return [([str(getattr(k, "key", k)) for k in path], s) for path, s in flat]


def _is_expert(s) -> bool:
  return any(a is not None and str(a).startswith("experts") for a in s.axes)


def _is_kernel(s) -> bool:
  return len([a for a in s.axes if a != "layers"]) >= 2


def tokens_per_device(cfg, sizes: dict[str, int]) -> int:
  """Tokens one device computes per micro-batch: the step's global tokens over the devices that split them
  (mesh.tensor's devices share theirs)."""
  t = cfg.train
  return t.per_device_batch_size * sizes.get("tensor", 1) * t.seq_len // t.micro_batches


def estimate(cfg, devices: int, platform: str = "tpu") -> Estimate:
  """The named terms for cfg on `devices` devices of `platform` (module docstring). cfg's mesh may hold -1."""
  import jax
  import numpy as np
  from meshlm.models.model import resolve
  from meshlm.models.logprobs import loss_path
  from meshlm.models.context import attention_core
  from meshlm.parallel.mesh import resolve_mesh_shape
  from meshlm.train.step import trainable_mask
  sizes = resolve_mesh_shape(cfg, devices, devices_key="the topology's devices")
  M = resolve(cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update=sizes)}))
  cfg, m, t = M.cfg, M.m, M.cfg.train
  mesh = _abstract_mesh(sizes)
  pb = np.dtype(t.param_dtype).itemsize
  cb = np.dtype(t.compute_dtype).itemsize
  D = m.embed_dim
  tokens = tokens_per_device(cfg, sizes)
  terms: dict[str, int] = {}

  # The arguments: each leaf's shard.
  params = _leaves(M.param_specs)
  mask = trainable_mask(cfg)
  trainable = [True] * len(params) if mask is None else [bool(x) for x in jax.tree.leaves(mask)]
  shard = [_shard_elems(s, mesh) * pb for _, s in params]
  terms["params"] = sum(shard)
  terms["opt_state"] = 2 * sum(b for b, keep in zip(shard, trainable) if keep)
  terms["model_state"] = sum(_shard_elems(s, mesh) * 4 for _, s in _leaves(M.model_state_specs))
  terms["grads"] = sum(b for b, keep in zip(shard, trainable) if keep)
  # The gradients the backward's layer loop allocates before it starts: its share of each stacked leaf (a scan of
  # one trip is inlined, and unrolled layers' gradients come as their backward runs).
  plan = M.plan
  looped = plan.kinds[plan.prefix:plan.prefix + plan.groups * plan.period] if plan.groups > 1 and cfg.scan_layers else ()
  share = {k: looped.count(k) / plan.kinds.count(k) for k in M.kinds}
  layer_grads = sum(int(b * share[path[1]]) for (path, _), b, keep in zip(params, shard, trainable)
                    if keep and path[0] == "layers")
  L = M.plan.num_layers
  terms["saved"] = L * tokens * D * cb

  # A layer's working set, the largest over the kinds.
  moe = _moe_layout(cfg, sizes, mesh, tokens)
  period_moe = sum(1 for k in M.plan.kinds[M.plan.prefix:M.plan.prefix + M.plan.period]
                   if any(p.name == "moe" for p in M.kinds[k].parts))
  attention = attention_core(M.cfg, M.attention_shapes, t.seq_len, platform=platform, context=sizes["context"])
  layer_phase, phase_terms = 0, {}
  for kind in M.kinds:
    kernels = [s for path, s in params if path[:2] == ["layers", kind] and _is_kernel(s)]
    dense = [_per_layer(s) for s in kernels if not _is_expert(s)]
    experts = [_per_layer(s) for s in kernels if _is_expert(s)]
    gathered = sum(math.prod(s.shape) for s in dense) + sum(math.prod(s.shape) // moe["ep"] for s in experts)
    expert_elems = sum(math.prod(s.shape) // moe["ep"] for s in experts)
    in_flight = 1 if moe["barrier"] else max(period_moe, 1)
    k = {"dispatch": moe["dispatch_bytes"] if experts else 0,
         "gathered_kernels": KERNEL_COPIES * gathered * cb,
         "kernel_grads": 4 * (gathered + (in_flight - 1) * expert_elems),
         "layer": tokens * sum(_out_width(s, D) for s in dense) * (cb + 4),
         "attention_scores": _scores(cfg, M, kind, sizes, attention, tokens)}
    if sum(k.values()) > layer_phase:
      layer_phase, phase_terms = sum(k.values()), k
  terms |= phase_terms
  V = m.vocab_size
  rows = t.per_device_batch_size * devices // t.micro_batches
  head = V * D // sizes["tensor"]
  terms["loss"] = (head * (cb + 4) if loss_path(cfg, rows, t.seq_len) == "blockwise"
                   else tokens * V // sizes["tensor"] * 4 * 2)
  args = terms["params"] + terms["opt_state"] + terms["model_state"]
  peak = args + terms["grads"] + terms["saved"] + max(layer_phase, terms["loss"])
  floor = args + layer_grads + terms["saved"]
  return Estimate(terms, peak, floor)


def _per_layer(s):
  """A stacked spec's one-layer shape (its "layers" dim dropped)."""
  from meshlm import spec as S
  keep = [i for i, a in enumerate(s.axes) if a != "layers"]
  return S.ParamSpec(tuple(s.shape[i] for i in keep), tuple(s.axes[i] for i in keep))


def _out_width(s, D: int) -> int:
  """The width a dense kernel produces per token: its elements over its input dim (embed, when it reads the
  residual stream), else the embed width it writes."""
  n = math.prod(s.shape)
  return n // D if s.shape[0] == D else D


def _scores(cfg, M, kind: str, sizes: dict, core, tokens: int) -> int:
  """A materialized attention layer's float32 scores per device: rows x heads x queries x keys (a core that reads
  the dense mask, xla)."""
  if not core.dense_mask or not any(p.instrument.attention_width is not None for p in M.kinds[kind].parts):
    return 0
  T = cfg.train.seq_len
  heads = max(cfg.model.num_heads // sizes["tensor"], 1)
  return tokens * heads * T * 4  # tokens per device = rows x queries per device; every key


def _moe_layout(cfg, sizes: dict, mesh, tokens: int) -> dict:
  """ep (how many devices split the experts), the dispatch's buffer bytes for one layer, the barrier knob."""
  import numpy as np
  from meshlm.models.ffns import moe as moe_part
  from meshlm.nn.moe.expert_parallel import capacity, ep_mesh_axes
  from meshlm.nn.moe.layer import TOKENS, experts_axis
  from meshlm.parallel.sharding import logical_spec
  m = cfg.model
  if not _has_moe(cfg):
    return {"ep": 1, "dispatch_bytes": 0, "barrier": True}
  own = moe_part.knobs(m)
  E, k, F, D = own.num_experts, own.num_experts_per_tok, own.mlp_dim, m.embed_dim
  cb = np.dtype(cfg.train.compute_dtype).itemsize
  ep_axes = ep_mesh_axes(logical_spec((experts_axis(own.kernel_fsdp),), (E,), mesh))
  ax = dict(zip(mesh.axis_names, mesh.axis_sizes))
  ep = math.prod(ax[a] for a in ep_axes)
  rows_global = cfg.train.per_device_batch_size * math.prod(ax.values()) // cfg.train.micro_batches
  bspec = logical_spec(TOKENS, (rows_global, cfg.train.seq_len, k), mesh)
  batch_axes = set((bspec[0],) if isinstance(bspec[0], str) else tuple(bspec[0] or ()))
  gathered = math.prod(ax[a] for a in ep_axes if a in batch_axes)
  shared = math.prod(ax[a] for a in ep_axes if a not in batch_axes)
  if ep == 1:
    rows = tokens * k
  elif own.ep_impl == "gather":
    rows = tokens * gathered * k
  else:
    rows = ep * capacity(-(-tokens // shared) * k, ep, own.ep_buffer_factor)
  return {"ep": ep, "dispatch_bytes": rows * (ROW_BUFFERS * D + GLU_BUFFERS * F) * cb,
          "barrier": own.grad_reduce_barrier}


def _has_moe(cfg) -> bool:
  from meshlm.models.model import resolve
  return any(p.name == "moe" for _, p in resolve(cfg).parts)


# ------------------------------------------------------------------------------------------------ the search

@dataclasses.dataclass
class Candidate:
  """One layout: the overrides that set it (every mesh axis, and the MoE knobs searched), its estimate, and
  whether it changes the model's numbers (a compact buffer factor the search chose: rows past it drop)."""
  overrides: list[str]
  estimate: Estimate
  drops: bool
  context: int

  def as_dict(self) -> dict:
    return {"overrides": self.overrides, "estimate": self.estimate.as_dict(), "drops": self.drops}


def _given(overrides: Sequence[str], key: str) -> bool:
  return any(o.partition("=")[0] == key for o in overrides)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def candidates(overrides: Sequence[str], devices: int, platform: str, load, rl_rows=None) -> list[Candidate]:
  """Every layout of `devices` devices the search may try, with its estimate: mesh.expert (a divisor of the
  experts), mesh.context (a divisor whose ring chunks split train.seq_len: 2 x context divides it), mesh.fsdp the
  devices left; with a MoE, model.parts.moe.ep_impl (gather, compact), kernel_fsdp (embed, experts),
  ep_buffer_factor (SEARCH_FACTORS, compact only) and grad_reduce_barrier. A key given in `overrides` is kept, not
  searched (mesh.data and mesh.tensor are never searched). load(*overrides) -> Config (a ConfigError skips the
  layout); rl_rows(cfg) -> cfg with the RL step's rows, for --program rl."""
  from meshlm.parallel.mesh import AXES
  base = load(*overrides)
  moe = _has_moe(base)
  E = None
  if moe:
    from meshlm.models.ffns import moe as moe_part
    E = moe_part.knobs(base.model).num_experts
  fixed = {a: getattr(base.mesh, a) for a in AXES if _given(overrides, f"mesh.{a}")}
  data, tensor = fixed.get("data", base.mesh.data), fixed.get("tensor", base.mesh.tensor)
  data, tensor = (1 if v == -1 else v for v in (data, tensor))
  experts = ([fixed["expert"]] if "expert" in fixed else
             [d for d in _divisors(devices) if moe and E % d == 0] or [1])
  contexts = ([fixed["context"]] if "context" in fixed else
              [c for c in _divisors(devices) if base.train.seq_len % (2 * c) == 0 or c == 1])
  knob_values = {"ep_impl": ("gather", "compact"), "kernel_fsdp": ("embed", "experts"),
                 "ep_buffer_factor": SEARCH_FACTORS, "grad_reduce_barrier": (False, True)} if moe else {}
  knob_values = {k: v for k, v in knob_values.items() if not _given(overrides, MOE + k)}
  base_impl = moe_part.knobs(base.model).ep_impl if moe else None
  out = []
  for expert, context in itertools.product(experts, contexts):
    rest = devices // (data * tensor * expert * context) if devices % (data * tensor * expert * context) == 0 else 0
    fsdp = fixed.get("fsdp", rest)
    if fsdp < 1 or data * tensor * expert * context * fsdp != devices:
      continue
    mesh = [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", f"mesh.expert={expert}",
            f"mesh.context={context}"]
    for values in itertools.product(*knob_values.values()):
      knobs = dict(zip(knob_values, values))
      if knobs.get("ep_impl", base_impl) != "compact" and "ep_buffer_factor" in knobs:
        if knobs["ep_buffer_factor"] is not None:
          continue  # only compact reads a buffer factor
        del knobs["ep_buffer_factor"]
      extra = mesh + [f"{MOE}{k}={'null' if v is None else str(v).lower()}" for k, v in knobs.items()]
      try:
        cfg = load(*overrides, *extra)
        est = estimate(rl_rows(cfg) if rl_rows else cfg, devices, platform)
      except ConfigError:
        continue
      # The search's factor drops rows past its buffers; one the user gave is theirs.
      drops = knobs.get("ep_buffer_factor") is not None
      out.append(Candidate(extra, est, drops, context))
  # Layouts the estimate cannot tell apart (a knob that changes nothing here, or only the context split where no
  # term depends on it) are one candidate: the one with the least context parallelism, then the fewest knobs set.
  best: dict = {}
  for c in sorted(out, key=lambda c: (c.context, sum(o.endswith("=true") for o in c.overrides))):
    best.setdefault((tuple(sorted(c.estimate.terms.items())), c.drops), c)
  return list(best.values())


def rank(cands: list[Candidate], hbm: int | None, offset: int = 0, temp_room: int | None = None) -> list[Candidate]:
  """The order to compile in: the layouts the estimate (plus `offset`, what earlier compiles showed it misses) says
  fit first, by the estimate (the most likely to fit first); at the same estimate one that keeps the model's numbers
  before one the search gave a buffer factor, then the least context parallelism. temp_room: with a limit on the
  temporaries, the most the estimate less the arguments may come to (the limit less what compiles showed the
  estimate misses of the temporaries)."""
  def key(c: Candidate):
    e = c.estimate
    over = hbm is not None and e.peak + offset > hbm
    args = e.terms["params"] + e.terms["opt_state"] + e.terms["model_state"]
    over = over or (temp_room is not None and e.peak - args > temp_room)
    return (over, e.peak, c.drops, c.context)
  return sorted(cands, key=key)
