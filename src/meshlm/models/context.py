"""What every block gets besides its parameters, input and state: the `Context`.

It is split in two. The model-wide part: the config, the mode (train | prefill | decode) and the
dense projection already bound to its kernel-order flags (`ctx.dense(x, kernel, eqn, out_axes)`).
The attention core of train and prefill, `ctx.core` (nn/attention.Core), resolved here once (`attention_core`) and
called through `ctx.attend`. The per-context part, `Inputs`, one per attention context the plan uses ("global",
"local"): positions, segment ids, RoPE tables, the attention mask's description (nn/attention.Mask; the [T, T]
array only for a core that reads it) and, when sampling, the KV-cache slots (decode reads their mask, O(C)).
A block reads its own with `ctx.here`. The per-layer part, `ctx.layer`, holds the inputs given to
this one layer (layers.run_layers' layer_inputs: what its parts declare as Replay.layer_inputs).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from meshlm.config import Config
from meshlm.nn import kv_cache
from meshlm.nn import attention as A
from meshlm.nn.attention import Mask, attention_mask, resolve_context, resolve_impl
from meshlm.nn.decode_attention import Decode, resolve as resolve_decode
from meshlm.nn.dense import dense
from meshlm.nn.kernel_cast import in_layer
from meshlm.nn.rope import apply_rope, fold_sign, freqs_at, inv_frequencies, resolve_swap, rope_angles
from meshlm.parallel.sharding import auto_region, context_size, current_mesh, device_kind, logical_spec, platform


@dataclasses.dataclass(frozen=True)
class Inputs:
  """The inputs shared by every layer of one attention context."""
  positions: jax.Array  # [B, T]
  segment_ids: jax.Array | None  # [B, T]; state-carrying mixers reset at document boundaries
  # rotary width -> (cos, sin with its first half negated) [B, T, width]: nn/rope.apply_rope's factors
  rope: Mapping[int, tuple[jax.Array, jax.Array]]
  mask: Mask | None  # train, prefill: causal, window, segments (decode: None; it reads cache.read_mask)
  cache: kv_cache.Slots | None = None  # where this context's layers read and write their cache
  lengths: jax.Array | None = None  # prefill: [B] real tokens per right-padded prompt row


@dataclasses.dataclass(frozen=True)
class Context:
  model: Any  # ModelConfig
  dense: Callable[..., jax.Array]  # dense(x, kernel, eqn, out_axes), bound to the dense flags
  inputs: Mapping[str, Inputs]
  mode: str = "train"  # train | prefill | decode
  core: A.Core = A.Core("xla", dense_mask=True)  # the attention core of train and prefill (attention_core)
  decode: Decode = Decode()  # decode's attention against the cache (nn/decode_attention; decode_attention_impl)
  rope_by_matmul: bool | None = None  # how RoPE swaps halves (rope_swap resolved for the platform)
  layer_cast: str = "bits"  # how a layer casts its float32 kernels (layer_cast: bits | astype)
  config: Any = None  # the run's Config, whose top-level program keys a part may read (None: their defaults)
  context_name: str = "global"
  # This layer's own inputs, {name: array} (the decoder's per-layer channel, Replay.layer_inputs); empty
  # when none are given.
  layer: Mapping[str, jax.Array] = dataclasses.field(default_factory=dict)

  @property
  def here(self) -> Inputs:
    return self.inputs[self.context_name]

  def as_context(self, context_name: str) -> "Context":
    return self if context_name == self.context_name else dataclasses.replace(self, context_name=context_name)

  def with_layer(self, inputs: Mapping[str, jax.Array]) -> "Context":
    return self if not inputs and not self.layer else dataclasses.replace(self, layer=dict(inputs))

  def cast(self, kernel: jax.Array, dt) -> jax.Array:
    """A (float32) kernel of this layer in the compute dtype dt. Training and prefill cast each layer's slice here
    (nn/kernel_cast.in_layer: bit-identical to astype, and no whole-stack bf16 copy hoisted out of the layer scan);
    decode takes astype, which XLA converts once outside the token loop, so each token reads bf16 weights."""
    return kernel.astype(dt) if self.mode == "decode" else in_layer(kernel, dt, self.layer_cast == "bits")

  def rope(self, x_BNTH: jax.Array, dim: int) -> jax.Array:
    """x [B, N, T, dim] rotated by this context's RoPE at width dim (nn/rope.apply_rope, rope_swap's form)."""
    cos, sin_signed = self.here.rope[dim]
    return apply_rope(x_BNTH, cos, sin_signed, self.rope_by_matmul)

  def attend(self, q, k, v, w_o: jax.Array, *, scale: float, softcap: float | None = None,
             gate: jax.Array | None = None, rows=None) -> jax.Array:
    """Training and prefill: y [B, T, D], the core (`self.core`) against this context's mask and the output
    projection w_o [N, Hv, D] (compute dtype), in one auto-axes region (nn/attention.attend_and_project). q [B, N, T,
    H], k/v [B, Kv, T, H] heads-first after RoPE; gate [B, N, T, Hv]: the core's output times sigmoid(gate) before
    the projection. rows: fn(q, k, v) -> (q, k, v) run inside the region before the core, q, k and v being then
    whatever pytrees it reads (a part whose rows are built from pieces joins them there)."""
    core, mask = self.core, self.here.mask
    flat, tree = jax.tree.flatten((q, k, v), is_leaf=lambda x: x is None)

    def fn(*args):
      q, k, v = jax.tree.unflatten(tree, args[:-1])
      if rows is not None:
        q, k, v = rows(q, k, v)
      return core.attend(q, k, v, args[-1], scale=scale, softcap=softcap, window=mask.window)
    B, T = flat[0].shape[0], flat[0].shape[2]
    return A.attend_and_project(fn, (*flat, core.operand(mask)), w_o, self.dense, rows=(B, T), gate=gate)


def bound_dense(cfg: Config) -> Callable[..., jax.Array]:
  return functools.partial(dense, kernel_order=cfg.dense_kernel_order, impl=cfg.weight_grad_impl,
                           scatter=cfg.scatter_leading)


def windows(m) -> dict[str, int | None]:
  """Each attention context's sliding window (None: full attention)."""
  return {"global": None, "local": m.sliding_window}


def train_mask(segment_ids_BT, T: int, window: int | None) -> jax.Array:
  """attention_mask for training. With the sequence sharded over mesh.context its [B, T, T] segment
  comparison pairs a query shard with every key position, which explicit sharding refuses (T sharded on both
  of its last axes): built in an auto-axes region, sharded over the query positions only."""
  if segment_ids_BT is None or context_size() == 1:
    return attention_mask(segment_ids_BT, T, window)
  B = segment_ids_BT.shape[0]
  return auto_region(lambda s: attention_mask(s, T, window), ("batch", None, None, "length", None),
                     (B, 1, 1, T, T))(segment_ids_BT)


def local_rows(B: int) -> int:
  """The batch rows of B each device holds (the batch's mesh axes over the current mesh; B with none)."""
  mesh = current_mesh()
  if mesh.empty:
    return B
  entry = logical_spec(("batch",), (B,), mesh)[0]
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return B // math.prod(sizes[a] for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry))


def attention_core(cfg: Config, shapes: tuple, T: int, *, platform: str, context: int, mode: str = "train",
                   segments: bool = True, device_kind: str | None = None, rows: int = 1) -> A.Core:
  """The attention core a program runs (train or prefill at length T, on platform, over `context` shards of the
  sequence): attention_impl resolved (nn/attention.resolve_impl), then context_attention (resolve_context), with
  what the core reads: flash's block (flash_block), the splash kernel's blocks for each of the model's attention
  shapes (`shapes`, nn/attention.Shape: the parts' Instrument.attention_shape) by nn/splash_rule.Rule over the
  compute dtype, `segments` (segment ids passed), the scoped VMEM of `device_kind`, the batch `rows` per device and
  the sa_block_* keys. The one
  resolution: make_context and the reports (analysis/census.attention_record, meshlm compile, the layout estimate)
  call it."""
  name = resolve_context(resolve_impl(cfg.attention_impl, T, platform, context), cfg.context_attention, context, T,
                         mode)
  core = A.Core(name, dense_mask=A.DENSE_MASK[name])
  if name in ("flash", "ring"):
    core = dataclasses.replace(core, block=cfg.flash_block)
  if name == "splash":
    from meshlm.nn import splash_rule
    keys = tuple((k, getattr(cfg, k)) for k in splash_rule.KEYS if getattr(cfg, k) != "auto")
    rule = splash_rule.Rule(T, platform == "tpu", jnp.dtype(cfg.train.compute_dtype).itemsize, segments,
                            splash_rule.scoped_vmem(device_kind), rows, cfg.splash_backward, keys)
    dims = sorted({s.dims for s in shapes})
    core = dataclasses.replace(core, rule=rule, splash=tuple((d, rule.blocks(*d)) for d in dims),
                               interpret=platform != "tpu")
  return core


def make_context(cfg: Config, contexts: tuple[str, ...], rotary_dims: tuple[int, ...], positions_BT: jax.Array,
                 segment_ids_BT=None, *, mode: str = "train", cache_len: int | None = None,
                 lengths_B: jax.Array | None = None, attention_shapes: tuple = ()) -> Context:
  """Inputs for each attention context in `contexts`, with RoPE tables at each width in rotary_dims.

  train: causal (and same-segment) masks over the T positions given.
  prefill: the same over a right-padded prompt block, plus the slots that move each row's first
    lengths_B[b] keys into a cache of cache_len (a window-sized ring for local layers).
  decode: one new position per row (positions_BT [B, 1]); masks and write slots over the cache.
  The attention core (attention_core) is resolved for this length and platform over the model's attention_shapes
  (decode keeps the default record: it attends against the cache). The masks of train and prefill are descriptions;
  their [T, T] arrays are built (once per step) only for a core that reads them (Core.dense_mask).
  """
  m = cfg.model
  B, T = positions_BT.shape
  core = (attention_core(cfg, attention_shapes, T, platform=platform(), context=context_size(), mode=mode,
                         segments=segment_ids_BT is not None, device_kind=device_kind(), rows=local_rows(B))
          if mode != "decode" else Context.core)
  # sin's sign folded here, once per step, so that each layer's RoPE is one full-width pass (nn/rope.apply_rope).
  signed = lambda cos, sin: (cos, fold_sign(sin))
  ropes = {"global": {d: signed(*freqs_at(positions_BT, d, m.rope_theta, m.rope_scaling)) for d in rotary_dims}}
  if "local" in contexts and m.rope_local_theta is not None:
    ropes["local"] = {d: signed(*rope_angles(positions_BT, inv_frequencies(d, m.rope_local_theta)))
                      for d in rotary_dims}
  inputs = {}
  for name in ("global",) + tuple(c for c in ("local",) if c in contexts):
    window = windows(m)[name]
    mask, slots = None, None
    if mode == "train":
      dense = train_mask(segment_ids_BT, T, window) if core.dense_mask else None
      mask = Mask(window, segment_ids_BT, dense)
    elif mode == "prefill":
      size = kv_cache.cache_size(cache_len, window)
      mask = Mask(window, None, attention_mask(None, T, window) if core.dense_mask else None)
      slots = kv_cache.prefill_slots(lengths_B, T, size)
    else:
      size = kv_cache.cache_size(cache_len, window)
      slots = kv_cache.decode_slots(positions_BT[:, 0], size)
    inputs[name] = Inputs(positions_BT, segment_ids_BT, ropes.get(name, ropes["global"]), mask, slots,
                          lengths_B if mode == "prefill" else None)
  decode = Context.decode
  if mode == "decode":
    on = platform()
    decode = Decode(resolve_decode(cfg.decode_attention_impl, on),
                    cfg.decode_attention_block, interpret=on != "tpu")
  swap = resolve_swap(cfg.rope_swap, platform()) == "matmul"
  return Context(model=m, dense=bound_dense(cfg), inputs=inputs, mode=mode, core=core, rope_by_matmul=swap,
                 layer_cast=cfg.layer_cast, decode=decode, config=cfg)
