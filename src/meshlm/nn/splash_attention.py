"""The TPU Pallas splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`): the `attention_impl=splash`
core. `splash_attention` takes and returns heads-first rows ([B, heads, T, h]), the kernel's own order and every
core's (nn/attention.core): the mixers project straight into them, so no transpose sits between a projection's dot
and the kernel. The `xla` core, nn/attention.gqa_attention, is the reference it is tested against.

The kernel is a Mosaic custom call, which XLA cannot partition: it runs inside a `jax.shard_map` over the current
mesh, each device calling it on its own rows, the batch split as the activations' "batch" axis is and the heads over
mesh.tensor when tensor divides the KV heads (else the heads stay whole on every tensor device, computed alike). The
sequence is never split: a mesh.context > 1 is refused (nn/attention.resolve_impl; flash runs there). Per batch row
the kernel is its multi-head form with fewer KV heads than query heads, which is GQA (MLA passes every head its own
key, G = 1).

What it does the way the other cores do:
  - the scale: q is scaled before the kernel (it computes q k^T unscaled);
  - causal (`CausalMask`) or a sliding window of `window` positions, the query's own included (`LocalMask` with
    (window - 1, 0) sides, which is causal too);
  - packed segments: `SegmentIds(q, kv)`, the same ids on both sides;
  - the logit soft-cap: the kernel's `attn_logits_soft_cap`, cap * tanh(s / cap) on the scaled scores;
  - query/key and value head dims that differ (MLA's 192 and 128): the kernel reads v's own width;
  - any length: the sequence is padded (nn/splash_rule.padded_length: to a multiple of a block that wastes at most an
    eighth of it, 128 at least, so a ragged length keeps large blocks). The pad sits after every real
    position, so causality hides it from the real queries, and the pad queries' outputs are cut off (their
    cotangent is zero, so they add nothing to dk and dv).

The blocks per phase (forward, dkv, dq) and the backward's kind come from nn/splash_rule.Rule: the largest that fit
the chip's scoped VMEM, or the sa_block_* keys. Off TPU the kernel runs in Pallas interpret mode (slow: tests and CPU toys); on TPU it compiles the Mosaic kernel.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as SA
from jax.sharding import PartitionSpec as P

from meshlm.nn.flash_attention import RESIDUALS
from meshlm.nn.splash_rule import Blocks, Rule
from meshlm.parallel.sharding import current_mesh, logical_spec, platform

def splash_attention(q_BNTH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array,
                     segment_ids_BT: jax.Array | None = None, *, scale: float, softcap: float | None = None,
                     window: int | None = None, blocks: Blocks | None = None, interpret: bool | None = None) -> jax.Array:
  """Causal softmax(q k^T * scale) v, as gqa_attention with attention_mask(segment_ids_BT, T, window), by the kernel,
  on heads-first rows (every core's, and the kernel's own order): q [B, N, T, H], k [B, K, T, H], v [B, K, T, Hv];
  returns [B, N, T, Hv] (query head n = k * G + g reads KV head k, as gqa_attention's grouping).
  blocks: the kernel's blocks per phase and the padded length (nn/splash_rule.Rule's; by default for this platform
  at the default scoped VMEM); interpret: Pallas interpret mode
  (default: off TPU). The kernel's output and row log-sum-exp carry the checkpoint name RESIDUALS (what a remat
  policy saves to keep the backward from rerunning the forward kernel).
  """
  T = q_BNTH.shape[2]
  assert k_BKSH.shape[2] == T == v_BKSH.shape[2], (q_BNTH.shape, k_BKSH.shape, v_BKSH.shape)
  on_tpu = platform() == "tpu"
  interpret = not on_tpu if interpret is None else interpret
  if blocks is None:
    blocks = Rule(T, on_tpu, q_BNTH.dtype.itemsize, segment_ids_BT is not None).blocks(
        q_BNTH.shape[-1], v_BKSH.shape[-1], softcap is not None)
  pad = blocks.length - T
  assert pad >= 0, (blocks, T)

  def padded(x):  # [B, heads, T, h] -> [B, heads, Tp, h]
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
  q = padded(q_BNTH * jnp.asarray(scale, q_BNTH.dtype))
  k, v = padded(k_BKSH), padded(v_BKSH)
  seg = None if segment_ids_BT is None else jnp.pad(segment_ids_BT.astype(jnp.int32), ((0, 0), (0, pad)))
  kernel_args = dict(window=window, softcap=softcap, blocks=blocks, interpret=interpret)
  with jax.named_scope("splash_attention"):
    out = _sharded(q, k, v, seg, kernel_args)  # [B, N, Tp, Hv]
  return out[:, :, :T]


def _mask(length: int, window: int | None):
  """One head's static mask over [length, length]: causal, or the window (which is causal too)."""
  if window is None:
    return SA.CausalMask((length, length))
  return SA.LocalMask((length, length), window_size=(window - 1, 0), offset=0)


def _kernel(heads: int, length: int, *, window, softcap, blocks: Blocks, interpret: bool):
  """The kernel for one batch row of `heads` query heads: fn(q [N, Tp, H], k [K, Tp, H], v [K, Tp, Hv], seg)."""
  mask = SA.MultiHeadMask([_mask(length, window)] * heads)
  sizes = SA.BlockSizes(block_q=blocks.q, block_kv=blocks.kv, block_kv_compute=blocks.kv_compute,
                        block_q_dkv=blocks.q_dkv, block_kv_dkv=blocks.kv_dkv, block_kv_dkv_compute=blocks.kv_dkv_compute,
                        block_q_dq=blocks.q_dq, block_kv_dq=blocks.kv_dq, use_fused_bwd_kernel=blocks.fused)
  return SA.make_splash_mha(mask, block_sizes=sizes, attn_logits_soft_cap=softcap, head_shards=1,
                            q_seq_shards=1, residual_checkpoint_name=RESIDUALS, interpret=interpret)


def _rows(q, k, v, seg, kernel_args: dict):
  """The kernel over this device's rows: q [b, n, Tp, H], k [b, k, Tp, H], v [b, k, Tp, Hv], seg [b, Tp] or None."""
  kernel = _kernel(q.shape[1], q.shape[2], **kernel_args)
  if seg is None:
    return jax.vmap(lambda q, k, v: kernel(q, k, v))(q, k, v)
  return jax.vmap(lambda q, k, v, s: kernel(q, k, v, SA.SegmentIds(s, s)))(q, k, v, seg)


def row_spec(mesh, B: int, K: int) -> P:
  """How the shard_map splits q, k, v and the output ([B, heads, Tp, h]): rows over the batch's mesh axes, heads over
  tensor when tensor divides the K KV heads (then the query heads too, K x G), else whole."""
  rows = logical_spec(("batch",), (B,), mesh)[0]
  heads = logical_spec(("kv_heads",), (K,), mesh)[0]
  return P(rows, heads, None, None)


def _sharded(q, k, v, seg, kernel_args: dict):
  """_rows in a shard_map over the current mesh (row_spec); with no mesh (or one device), _rows itself."""
  mesh = current_mesh()
  if mesh.empty or math.prod(mesh.axis_sizes) == 1:
    return _rows(q, k, v, seg, kernel_args)
  qkv = row_spec(mesh, q.shape[0], k.shape[1])
  specs = (qkv, qkv, qkv) + (() if seg is None else (P(qkv[0], None),))
  body = lambda *args: _rows(*args[:3], args[3] if len(args) > 3 else None, kernel_args)  # noqa: E731
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=qkv, check_vma=False)
  return fn(q, k, v, *(() if seg is None else (seg,)))
