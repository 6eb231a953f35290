"""What every block gets besides its parameters, input and state: the `Context`.

It is split in two. The model-wide part: the config, the mode (train | prefill | decode) and the
dense projection already bound to its kernel-order flags (`ctx.dense(x, kernel, eqn, out_axes)`).
The per-context part, `Inputs`, one per attention context the plan uses ("global", "local"):
positions, segment ids, RoPE tables, the attention mask's description (nn/attention.Mask; the [T, T] array
only for the xla core) and, when sampling, the KV-cache slots (decode reads their mask, O(C)).
A block reads its own with `ctx.here`. The per-layer part, `ctx.layer`, holds the inputs given to
this one layer (layers.run_layers' layer_inputs: what its parts declare as Replay.layer_inputs).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax

from meshlm.config import Config
from meshlm.nn import kv_cache
from meshlm.nn.attention import Mask, attention_mask, resolve_context, resolve_impl
from meshlm.nn.dense import dense
from meshlm.nn.kernel_cast import in_layer
from meshlm.nn.rope import fold_sign, freqs_at, inv_frequencies, rope_angles
from meshlm.parallel.sharding import auto_region, context_size, platform


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
  attention_impl: str = "xla"  # the core of train and prefill: xla | flash | splash | ring (both keys resolved)
  splash_backward: str = "auto"  # the splash core's backward: auto | fused | split (nn/splash_attention)
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
    return kernel.astype(dt) if self.mode == "decode" else in_layer(kernel, dt)


def bound_dense(cfg: Config) -> Callable[..., jax.Array]:
  return functools.partial(dense, kernel_order=cfg.dense_kernel_order, impl=cfg.weight_grad_impl)


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


def make_context(cfg: Config, contexts: tuple[str, ...], rotary_dims: tuple[int, ...], positions_BT: jax.Array,
                 segment_ids_BT=None, *, mode: str = "train", cache_len: int | None = None,
                 lengths_B: jax.Array | None = None) -> Context:
  """Inputs for each attention context in `contexts`, with RoPE tables at each width in rotary_dims.

  train: causal (and same-segment) masks over the T positions given.
  prefill: the same over a right-padded prompt block, plus the slots that move each row's first
    lengths_B[b] keys into a cache of cache_len (a window-sized ring for local layers).
  decode: one new position per row (positions_BT [B, 1]); masks and write slots over the cache.
  The masks of train and prefill are descriptions; their [T, T] arrays are built (once per step) only when the
  attention core is xla (attention_impl resolved for this length and platform).
  """
  m = cfg.model
  T = positions_BT.shape[1]
  impl = resolve_impl(cfg.attention_impl, T, platform(), context_size()) if mode != "decode" else "xla"
  impl = resolve_context(impl, cfg.context_attention, context_size(), T, mode)
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
      dense = train_mask(segment_ids_BT, T, window) if impl == "xla" else None
      mask = Mask(window, segment_ids_BT, dense)
    elif mode == "prefill":
      size = kv_cache.cache_size(cache_len, window)
      mask = Mask(window, None, attention_mask(None, T, window) if impl == "xla" else None)
      slots = kv_cache.prefill_slots(lengths_B, T, size)
    else:
      size = kv_cache.cache_size(cache_len, window)
      slots = kv_cache.decode_slots(positions_BT[:, 0], size)
    inputs[name] = Inputs(positions_BT, segment_ids_BT, ropes.get(name, ropes["global"]), mask, slots,
                          lengths_B if mode == "prefill" else None)
  return Context(model=m, dense=bound_dense(cfg), inputs=inputs, mode=mode, attention_impl=impl,
                 splash_backward=cfg.splash_backward)
