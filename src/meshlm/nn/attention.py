"""Causal grouped-query attention with segment masking (packed documents never see each other), and its
one-position decode form against a KV cache. Plain math with no sharding annotations of its own.

Also the attention mixers' shared vocabulary (models/mixers/gqa.py, gated_gqa.py, mla.py): the logical axes
of their kernels and activations, the q/K/V/o parameter specs, the decode masks, the attention core's record
(`Core`: which core, what it reads, its blocks; resolved once by models/context.attention_core) and the one
attend-and-project region every mixer's core and output projection run in (`attend_and_project`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from meshlm import spec as S
from meshlm.config.kernel_keys import splash_refusal
from meshlm.errors import ConfigError
from meshlm.nn.flash_attention import flash_attention
from meshlm.nn.ring_attention import ring_attention
from meshlm.parallel.sharding import ACT, auto_region, axes

# Parameter axes: the query kernel [D, N, H] (gather_once reads them), K/V [D, Kv, H], o [N, H, D].
Q_AXES = axes("embed", "heads", "head_dim")
KV_AXES = axes("embed", "kv_heads", "head_dim")
O_AXES = axes("heads", "head_dim", "embed")
# Activation axes: per-head rows heads-first, [B, N, T, H] (queries) and [B, Kv, T, H] (GQA's K/V), the order every
# core reads (and the decode cache's, [B, Kv, C, H]); the output [B, T, D].
HEADS = axes("batch", "heads", "length", "head_dim")
KV = axes("batch", "kv_heads", "length", "head_dim")
OUT = ACT


def q_spec(D: int, N: int, H: int) -> S.ParamSpec:
  return S.kernel((D, N, H), Q_AXES)


def kv_specs(D: int, Kv: int, H: int) -> dict[str, S.ParamSpec]:
  """{"k", "v"} [D, Kv, H]."""
  return {"k": S.kernel((D, Kv, H), KV_AXES), "v": S.kernel((D, Kv, H), KV_AXES)}


def o_spec(N: int, H: int, D: int) -> S.ParamSpec:
  """The output projection [N, H, D]: both head dims are contracted."""
  return S.kernel((N, H, D), O_AXES, n_in=2)


def decode_mask(mask_B111C: jax.Array, write_BC: jax.Array) -> jax.Array:
  """The cache slots a new position reads, [B, 1, 1, 1, C]: the slot being written holds a position the new
  one no longer sees (out of the window) or none, so it is masked out (the new K/V come in separately)."""
  return mask_B111C & ~write_BC[:, None, None, None, :]


def with_new_slot(mask_B111C: jax.Array) -> jax.Array:
  """[B, 1, C + 1]: the cache's read mask, and the new position (always seen) after it."""
  m = mask_B111C[:, 0, 0]  # [B, 1, C]
  return jnp.concatenate([m, jnp.ones(m.shape[:-1] + (1,), bool)], axis=-1)


# On CPU, `attention_impl=auto` runs flash from this length up and xla below it: the crossover that
# benchmarks/attention_crossover.py measured (docs/performance.md, "Attention: flash vs xla on CPU").
CPU_FLASH_FROM = 1024
IMPLS = ("xla", "flash", "splash")


def resolve_impl(impl: str, T: int, platform: str, context: int = 1) -> str:
  """The attention core a program of length T runs on platform ("cpu", "gpu", "tpu") over a mesh.context of
  `context` shards: impl unless it is auto. auto: splash on TPU (flash with the sequence split: the splash wrapper
  keeps each device's sequence whole), flash on GPU, and on CPU flash from CPU_FLASH_FROM up, xla below."""
  if impl != "auto":
    if impl not in IMPLS:
      raise ValueError(f"attention_impl={impl!r}: expected auto, xla, flash or splash")
    refusal = splash_refusal(impl, context)
    if refusal:
      raise ConfigError(refusal)
    return impl
  if platform == "tpu":
    return "splash" if context == 1 else "flash"
  return "flash" if platform != "cpu" or T >= CPU_FLASH_FROM else "xla"


def resolve_context(impl: str, context_attention: str, shards: int, T: int, mode: str = "train") -> str:
  """The core a program of length T runs once the sequence's sharding is known: "ring" (nn/ring_attention.py,
  flash's blocks passed around mesh.context) when training with the flash core on shards > 1, context_attention=ring
  and T in 2 x shards whole chunks (the train step's T always is: registry.check_shards; a meshlm.forward call of
  another length gathers); impl otherwise (gather: XLA's partitioner all-gathers over the context axis). Prefill
  and decode keep impl."""
  ring = mode == "train" and impl == "flash" and shards > 1 and context_attention == "ring" and T % (2 * shards) == 0
  return "ring" if ring else impl


@dataclasses.dataclass(frozen=True)
class Shape:
  """An attending part's attention shape (Instrument.attention_shape): query and KV heads, the q/k and v head dims
  (MLA's 192 and 128; G = 1, each query head its own key) and the logit soft-cap. What the splash kernel's blocks
  are chosen over (nn/splash_attention.choose_blocks) and what the registry's TPU compile check compiles."""
  heads: int
  kv_heads: int
  qk_dim: int
  v_dim: int
  softcap: float | None = None

  @property
  def dims(self) -> tuple[int, int, bool]:
    """What the kernel's VMEM depends on: (qk head dim, v head dim, soft-capped)."""
    return self.qk_dim, self.v_dim, self.softcap is not None


@dataclasses.dataclass(frozen=True)
class Mask:
  """What a query of a training or prefill context sees, as a description: every key at or before it (causal),
  inside `window` positions when one is given, and of its own document when segment ids are given. `dense` is
  the materialized [B or 1, 1, 1, T, T] array, which only a core with `dense_mask` reads (models/context builds it
  once per step for that core alone); the others read the description. Decode reads its cache slots' mask instead."""
  window: int | None = None
  segment_ids: jax.Array | None = None  # [B, T]
  dense: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Core:
  """The attention core of one program (train or prefill at one length, on one platform), resolved once where the
  context is made (models/context.attention_core) and read by everything after: the mixers (Context.attend) and the
  reports (the census, meshlm compile, the layout estimate), which never resolve a key again.

  - name: xla | flash | splash | ring (what the reports print; nothing keys on it).
  - dense_mask: the core reads the materialized [T, T] mask (xla, the reference), which is then built once per
    step; the others read the mask's description (the segment ids).
  - block: flash's and ring's block length (flash_block), None for the others.
  - splash: the splash kernel's blocks per attention shape the model's parts declare, ((qk, v, soft-capped),
    nn/splash_attention.Blocks) pairs; a shape not listed is chosen by the same rule when called (`rule`).
  - rule: the splash rule's inputs (nn/splash_attention.Rule), None for the other cores.
  - interpret: the splash kernel in Pallas interpret mode (off TPU).
  """
  name: str
  dense_mask: bool = False
  block: int | None = None
  splash: tuple = ()
  rule: Any = None
  interpret: bool = False

  def operand(self, mask: Mask) -> jax.Array | None:
    """The one array the core reads from the mask, passed into the caller's auto-axes region as an argument: the
    materialized mask (dense_mask) or the segment ids (or None)."""
    if self.dense_mask:
      assert mask.dense is not None, "this core reads the materialized mask (models/context.make_context builds it)"
      return mask.dense
    return mask.segment_ids

  def splash_blocks(self, qk_dim: int, v_dim: int, softcap: float | None):
    """The splash kernel's blocks for one attention shape: the record's, else the rule's."""
    key = (qk_dim, v_dim, softcap is not None)
    for dims, blocks in self.splash:
      if dims == key:
        return blocks
    return self.rule.blocks(*key)

  def summary(self) -> dict:
    """What the reports print (the census's config, meshlm compile): {"attention_impl": name, "flash_block": block
    or None, "splash_backward": fused | split ("/"-joined where the shapes differ) or None, "splash_blocks":
    {"qk/v[/softcap]": blocks} or None}."""
    blocks = {"/".join(map(str, (qk, v))) + ("/softcap" if capped else ""): b.as_dict()
              for (qk, v, capped), b in self.splash}
    backward = "/".join(sorted({b["backward"] for b in blocks.values()}))
    return {"attention_impl": self.name, "flash_block": self.block, "splash_backward": backward or None,
            "splash_blocks": blocks or None}

  def attend(self, q, k, v, operand, *, scale: float, softcap: float | None = None, window: int | None = None):
    """The core on heads-first rows, q [B, N, T, H] and k/v [B, Kv, T, H] (v's head dim may differ): [B, N, T, Hv].
    operand: what `operand(mask)` gave. Every core reads and returns heads-first rows, so a caller projects
    straight into them and contracts the output as it is: no transpose sits between a projection's dot and the
    core (nor, in the backward, between the output projection's gradient dot and the core's)."""
    return _CORES[self.name](self, q, k, v, operand, scale=scale, softcap=softcap, window=window)


def _xla(core, q, k, v, dense, *, scale, softcap, window):
  del window  # in the materialized mask
  return gqa_attention(q, k, v, dense, scale=scale, softcap=softcap)


def _flash(core, q, k, v, seg, *, scale, softcap, window):
  return flash_attention(q, k, v, seg, scale=scale, softcap=softcap, window=window, block=core.block)


def _ring(core, q, k, v, seg, *, scale, softcap, window):
  return ring_attention(q, k, v, seg, scale=scale, softcap=softcap, window=window, block=core.block)


def _splash(core, q, k, v, seg, *, scale, softcap, window):
  # Imported here: Pallas and Mosaic add about 0.5 s to every meshlm import that never runs splash.
  from meshlm.nn.splash_attention import splash_attention
  blocks = core.splash_blocks(q.shape[-1], v.shape[-1], softcap)
  return splash_attention(q, k, v, seg, scale=scale, softcap=softcap, window=window, blocks=blocks,
                          interpret=core.interpret)


_CORES = {"xla": _xla, "flash": _flash, "ring": _ring, "splash": _splash}
# What a core reads of the mask: only the reference materializes it.
DENSE_MASK = {"xla": True, "flash": False, "ring": False, "splash": False}


def attend_and_project(fn, args: tuple, w_o: jax.Array, dense, *, rows: tuple[int, int],
                       gate: jax.Array | None = None) -> jax.Array:
  """y [B, T, D]: the core's heads-first rows fn(*args) [B, N, T, Hv] (times sigmoid(gate) [B, N, T, Hv], gated_gqa)
  contracted as they are by the output projection w_o [N, Hv, D] through `dense`, in one auto-axes region; rows =
  (B, T). Every attention mixer's core (training, prefill, decode) and output projection run here. Under explicit
  sharding every einsum output would otherwise carry a sharding annotation between its dot and the transpose after
  it (the core's own einsums, and the incoming gradient of the output projection in the backward pass), which XLA
  cannot fold; inside the region XLA folds them as under auto, and the projection still goes through dense."""
  n = len(args)

  def body(*xs):
    o = fn(*xs[:n])  # [B, N, T, Hv]
    w_o, *gate = xs[n:]
    if gate:
      o = o * jax.nn.sigmoid(gate[0])
    with jax.named_scope("o"):
      return dense(o, w_o, "bnth,nhd->btd", OUT)
  region = auto_region(body, OUT, tuple(rows) + w_o.shape[-1:])
  return region(*args, w_o, *(() if gate is None else (gate,)))


def attention_mask(segment_ids_BT: jax.Array | None, T: int, sliding_window: int | None = None) -> jax.Array:
  """[B or 1, 1, 1, T, T] boolean: causal, same segment, and inside the window if one is given."""
  q = jnp.arange(T)[:, None]
  k = jnp.arange(T)[None, :]
  mask = k <= q
  if sliding_window is not None:
    mask &= q - k < sliding_window
  mask = mask[None, None, None]
  if segment_ids_BT is not None:
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]  # [B, T, T]
    mask = mask & same[:, None, None]
  return mask


def gqa_attention(q_BNTH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, mask: jax.Array, *,
                  scale: float, softcap: float | None = None) -> jax.Array:
  """softmax(q k^T * scale) v with K kv heads shared by groups of G = N // K query heads, on heads-first rows:
  q [B, N, T, H], k/v [B, K, S, H] (v's head dim may differ), mask [B or 1, 1, 1, T, S]; returns [B, N, T, Hv]
  (query head n = k * G + g reads kv head k). Plain math with no sharding annotations of its own (it runs inside
  an auto-axes region)."""
  with jax.named_scope("attention"):
    B, N, T, H = q_BNTH.shape
    K = k_BKSH.shape[1]
    q = jnp.reshape(q_BNTH, (B, K, N // K, T, H))
    s = jnp.einsum("bkgth,bksh->bkgts", q, k_BKSH).astype(jnp.float32) * scale
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v_BKSH.dtype)
    o = jnp.einsum("bkgts,bksh->bkgth", p, v_BKSH)
    return jnp.reshape(o, (B, N, T, o.shape[-1]))


def gqa_attention_decode(q_BN1H: jax.Array, k_BK1H: jax.Array, v_BK1H: jax.Array, k_BKCH: jax.Array,
                         v_BKCH: jax.Array, mask: jax.Array, *, scale: float, softcap: float | None = None) -> jax.Array:
  """One new position attends to the cache's slots (mask [B, 1, 1, 1, C]) and to its own key and value,
  which are not in the cache yet: one softmax over C + 1 scores, so the cache is only read here and the
  decoder writes the new row into it once, in place, after the layers. Heads-first rows as gqa_attention's
  (T = 1); returns [B, N, 1, Hv].

  The cache is [B, K, C, H]: its batch dims (b, k) lead, so both dots read it as stored (a [B, C, K, H]
  cache would be transposed first, a cache-sized temporary per layer).
  """
  with jax.named_scope("attention"):
    B, N, _, H = q_BN1H.shape
    K = k_BKCH.shape[1]
    q = jnp.reshape(q_BN1H, (B, K, N // K, H))  # T = 1
    f32 = jnp.float32
    s_cache = jnp.einsum("bkgh,bkch->bkgc", q, k_BKCH).astype(f32) * scale  # [B, K, G, C]
    s_new = jnp.einsum("bkgh,bkh->bkg", q, k_BK1H[:, :, 0]).astype(f32)[..., None] * scale  # [B, K, G, 1]
    s = jnp.concatenate([s_cache, s_new], axis=-1)
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(with_new_slot(mask)[:, :, None], s, jnp.finfo(f32).min)  # mask [B, 1, 1, C + 1]
    p = jax.nn.softmax(s, axis=-1).astype(v_BKCH.dtype)
    C = k_BKCH.shape[2]
    o = jnp.einsum("bkgc,bkch->bkgh", p[..., :C], v_BKCH) + p[..., C:] * v_BK1H[:, :, 0, None, :]
    return jnp.reshape(o, (B, N, 1, o.shape[-1]))
