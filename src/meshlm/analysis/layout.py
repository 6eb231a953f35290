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
- `dispatch`: a part's own working buffers for one layer (its MeshRules.memory: LayerMemory.buffers, e.g. the
  routed rows of a sparse feed-forward);
- `gathered_kernels`: the kernels of one layer as its dots read them, in the compute dtype, KERNEL_COPIES of them
  (the layer computing and the next one's gather in flight): every kernel whole (FSDP gathers it) except where its
  part keeps it split (LayerMemory.split: a kernel stacked over routed sub-layers, split over their parallel group);
- `kernel_grads`: those kernels' float32 gradients as the backward computes them, before they are reduced to the
  parameter sharding: one layer's, and the split kernels' of every such layer of the scanned period where the part
  says they stay live (LayerMemory.grads_every_layer; docs/compile.md);
- `layer`: the recomputed layer's activations: tokens x the widths its dense kernels produce, a compute-dtype value
  and its float32 cotangent each (the mixers' own state, a recurrent mixer's chunk states, is not counted);
- `attention_scores`: where the attention core materializes its scores (xla: no flash or splash core applies),
  one layer's rows x heads x queries x keys per device, float32;
- `loss`: the head and its loss: the blockwise loss gathers the head once and accumulates its float32 gradient;
  the materialized one holds float32 logits and their gradient;
- `held_head_grad`: that float32 accumulator again, in a layer's phase, where XLA holds it over the layers' backward
  (loss_grad_reduce=overlap; 0 with the barrier: models/logprobs.grad_reduce).

The estimate is arguments + grads + saved + the larger of the loss's phase and a layer's (dispatch,
gathered_kernels, kernel_grads, layer, attention_scores, held_head_grad). It is not a bound: XLA's buffer assignment
adds temporaries it does not model. `floor` is one: the arguments, the looped layers' gradients and the saved layer
inputs are all live when the backward's layer loop starts (its stacked gradient buffers are allocated then, its
residuals not yet freed); `meshlm train` refuses a layout whose floor exceeds the device's memory.

`candidates(...)` lists the layouts to rank: the mesh splits (each axis a part declares its own, MeshRules.axes;
mesh.context; mesh.fsdp the rest) and the knobs the model's parts declare searchable (MeshRules.search), every key
the user did not set; `rank` orders them by the estimate. No part is named here: what varies and how it counts is the
parts' own.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

from meshlm.errors import ConfigError

GiB = 1 << 30
KERNEL_COPIES = 2  # gathered layers' kernels live at once: the one computing and the next one's gather


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
  from meshlm.models.logprobs import grad_reduce, loss_path
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

  # A layer's working set, the largest over the kinds. The parts' own terms (MeshRules.memory), once per part.
  own = {p.name: p.mesh.memory(cfg, sizes, mesh, tokens) for p in M.unique_parts if p.mesh.memory is not None}
  mems = {k: {p.key: own[p.name] for p in M.kinds[k].parts if p.name in own} for k in M.kinds}
  period = M.plan.kinds[M.plan.prefix:M.plan.prefix + M.plan.period]
  held = sum(1 for k in period if any(mem.grads_every_layer for mem in mems[k].values()))
  attention = attention_core(M.cfg, M.attention_shapes, t.seq_len, platform=platform, context=sizes["context"])
  layer_phase, phase_terms = 0, {}
  for kind in M.kinds:
    kernels = [(path, s) for path, s in params if path[:2] == ["layers", kind] and _is_kernel(s)]
    whole, split_elems, held_elems = [], 0, 0  # dense kernels; the parts' own (split) ones, elements per device
    for path, s in kernels:
      s, mem = _per_layer(s), mems[kind].get(path[2])
      n = None if mem is None else mem.split(s)
      if n is None:
        whole.append(s)
        continue
      split_elems += math.prod(s.shape) // n
      held_elems += math.prod(s.shape) // n if mem.grads_every_layer else 0
    gathered = sum(math.prod(s.shape) for s in whole) + split_elems
    in_flight = max(held, 1)
    k = {"dispatch": sum(mem.buffers for mem in mems[kind].values()),
         "gathered_kernels": KERNEL_COPIES * gathered * cb,
         "kernel_grads": 4 * (gathered + (in_flight - 1) * held_elems),
         "layer": tokens * sum(_out_width(s, D) for s in whole) * (cb + 4),
         "attention_scores": _scores(cfg, M, kind, sizes, attention, tokens)}
    if sum(k.values()) > layer_phase:
      layer_phase, phase_terms = sum(k.values()), k
  terms |= phase_terms
  V = m.vocab_size
  rows = t.per_device_batch_size * devices // t.micro_batches
  head = V * D // sizes["tensor"]
  blockwise = loss_path(cfg, rows, t.seq_len) == "blockwise"
  terms["loss"] = head * (cb + 4) if blockwise else tokens * V // sizes["tensor"] * 4 * 2
  terms["held_head_grad"] = head * 4 if blockwise and grad_reduce(cfg) == "overlap" else 0
  args = terms["params"] + terms["opt_state"] + terms["model_state"]
  peak = args + terms["grads"] + terms["saved"] + max(layer_phase + terms["held_head_grad"], terms["loss"])
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


# ------------------------------------------------------------------------------------------------ the search

@dataclasses.dataclass
class Candidate:
  """One layout: the overrides that set it (every mesh axis, and the parts' knobs searched), its estimate, and
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
  """Every layout of `devices` devices the search may try, with its estimate: each mesh axis only the model's parts
  shard over (MeshRules.axes: a divisor of the devices the config accepts), mesh.context (a divisor whose ring chunks
  split train.seq_len: 2 x context divides it), mesh.fsdp the devices left; and every combination of the knobs the
  model's parts let the search vary (MeshRules.search), a value the config holds already not written. A key given in
  `overrides` is kept, not searched (mesh.data and mesh.tensor are never searched). load(*overrides) -> Config (a
  ConfigError skips the layout); rl_rows(cfg) -> cfg with the RL step's rows, for --program rl."""
  from meshlm.models.family import section
  from meshlm.models.model import resolve
  from meshlm.parallel.mesh import AXES
  base = load(*overrides)
  parts = resolve(base).unique_parts
  fixed = {a: getattr(base.mesh, a) for a in AXES if _given(overrides, f"mesh.{a}")}
  data, tensor = fixed.get("data", base.mesh.data), fixed.get("tensor", base.mesh.tensor)
  data, tensor = (1 if v == -1 else v for v in (data, tensor))
  # The axes only some parts shard over (the others are the search's own: fsdp the rest, context; data and tensor kept)
  owned = [a for a in AXES if a not in ("data", "fsdp", "tensor", "context") and any(a in p.mesh.axes for p in parts)]
  splits = {a: [fixed[a]] if a in fixed else _divisors(devices) for a in owned}
  splits["context"] = ([fixed["context"]] if "context" in fixed else
                       [c for c in _divisors(devices) if base.train.seq_len % (2 * c) == 0 or c == 1])
  # (part, knob, the override's key, the base config's value) for each knob searched
  searched = [(p, knob, f"model.parts.{p.name}.{knob}", getattr(section(base.model, p), knob))
              for p in parts for knob in p.mesh.search if not _given(overrides, f"model.parts.{p.name}.{knob}")]
  out = []
  for split in itertools.product(*splits.values()):
    sizes = dict(zip(splits, split), data=data, tensor=tensor)
    used = math.prod(sizes.values())
    sizes["fsdp"] = fixed.get("fsdp", devices // used if devices % used == 0 else 0)
    if sizes["fsdp"] < 1 or used * sizes["fsdp"] != devices:
      continue
    context = sizes["context"]
    mesh = [f"mesh.{a}={sizes.get(a, 1)}" for a in ("data", "fsdp", "tensor", *owned, "context")]
    for values in itertools.product(*(p.mesh.search[knob] for p, knob, _, _ in searched)):
      extra = mesh + [f"{key}={'null' if v is None else str(v).lower()}"
                      for (_, _, key, held), v in zip(searched, values) if v != held]
      try:
        cfg = load(*overrides, *extra)
        est = estimate(rl_rows(cfg) if rl_rows else cfg, devices, platform)
      except ConfigError:
        continue
      # Values the search chose that change the model's numbers (a buffer that drops rows); the user's are theirs.
      chosen: dict = {}
      for (p, knob, _, _), v in zip(searched, values):
        chosen.setdefault(p.name, (p, {}))[1][knob] = v
      drops = any(p.mesh.drops(vals) for p, vals in chosen.values())
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
