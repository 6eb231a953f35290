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
  - any length: the sequence is padded to a multiple of the kernel's 128-wide lanes. The pad sits after every real
    position, so causality hides it from the real queries, and the pad queries' outputs are cut off (their
    cotangent is zero, so they add nothing to dk and dv).

Off TPU the kernel runs in Pallas interpret mode (slow: tests and CPU toys); on TPU it compiles the Mosaic kernel.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as SA
from jax.sharding import PartitionSpec as P

from meshlm.nn.flash_attention import RESIDUALS
from meshlm.parallel.sharding import current_mesh, logical_spec, platform

LANES = 128  # the kernel's block lengths are multiples of the TPU's 128 lanes
# Every block length (forward and backward) on TPU. Measured on a TPU v5e (docs/tpu.md, qwen3-0.6b at seq 2048,
# batch 8, remat=full): 512 and two backward kernels 975.8 ms a step; 1024 933.8; 1024 fused 891.3; 256 1,299; 2048
# does not fit the kernel's VMEM.
BLOCK = 1024
INTERPRET_BLOCK = LANES  # the smallest block the kernel takes: the least work per tile in interpret mode
# splash_backward=auto: the fused backward (one kernel, dq with dk and dv) where the sequence is at most this many
# kernel blocks, the two-kernel backward (a dq and a dkv kernel) beyond. The fused kernel writes one partial dq per
# key block ([blocks, heads, T, h] per row, summed after it), so its memory grows with T / block: 2 blocks (seq 2048
# at block 1024) ran 4.6% faster fused on the v5e; at 8 (llama3-8b, seq 8192, batch 12 on v5p-8) fused peaks 5.18 GiB
# higher (78.51 against 73.33 GiB, docs/compile.md), its time there unmeasured.
FUSED_MAX_BLOCKS = 2
BACKWARDS = ("fused", "split")


def block_for(length: int, block: int) -> int:
  """The kernel's block over a length padded to LANES: `block` if it divides the length, else the largest multiple
  of LANES that divides both (a length of one block or less is one block)."""
  return length if length <= block else math.gcd(length, block)


def padded_length(length: int) -> int:
  """The sequence length the kernel runs: `length` padded to a multiple of LANES."""
  return length + (-length % LANES)


def kernel_block(length: int, on_tpu: bool, block: int | None = None) -> int:
  """The kernel's block over a sequence of `length` (padded): block_for of `block`, by default BLOCK on TPU and
  INTERPRET_BLOCK elsewhere."""
  return block_for(padded_length(length), block or (BLOCK if on_tpu else INTERPRET_BLOCK))


def resolve_backward(backward: str, length: int, block: int) -> str:
  """fused or split: `backward` unless it is auto, which is fused where the padded sequence is at most
  FUSED_MAX_BLOCKS kernel blocks of `block`."""
  if backward != "auto":
    if backward not in BACKWARDS:
      raise ValueError(f"splash_backward={backward!r}: expected auto, fused or split")
    return backward
  return "fused" if -(-padded_length(length) // block) <= FUSED_MAX_BLOCKS else "split"


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The kernel's block lengths per phase (the kernel's BlockSizes): the forward's q / kv / kv-compute, the dkv
  kernel's q / kv / kv-compute, and the dq kernel's q / kv, which the fused backward (dq computed in the dkv
  kernel) has none of: q_dq and kv_dq None."""
  q: int
  kv: int
  kv_compute: int
  q_dkv: int
  kv_dkv: int
  kv_dkv_compute: int
  q_dq: int | None = None
  kv_dq: int | None = None

  @property
  def fused(self) -> bool:
    return self.q_dq is None

  @property
  def backward(self) -> str:
    return "fused" if self.fused else "split"

  def sizes(self) -> "SA.BlockSizes":
    return SA.BlockSizes(block_q=self.q, block_kv=self.kv, block_kv_compute=self.kv_compute, block_q_dkv=self.q_dkv,
                         block_kv_dkv=self.kv_dkv, block_kv_dkv_compute=self.kv_dkv_compute, block_q_dq=self.q_dq,
                         block_kv_dq=self.kv_dq, use_fused_bwd_kernel=self.fused)

  def as_dict(self) -> dict:
    """{"fwd": [q, kv, kv_compute], "dkv": [...], "dq": [q, kv] or None, "backward": fused | split}: the reports'."""
    return {"fwd": [self.q, self.kv, self.kv_compute], "dkv": [self.q_dkv, self.kv_dkv, self.kv_dkv_compute],
            "dq": None if self.fused else [self.q_dq, self.kv_dq], "backward": self.backward}

  def describe(self) -> str:
    """"fwd 1024/1024/512 dkv 1024/1024/512 fused" (or "... dq 1024/1024"): one line of a report."""
    slash = lambda bs: "/".join(str(b) for b in bs)  # noqa: E731
    d = self.as_dict()
    return f"fwd {slash(d['fwd'])} dkv {slash(d['dkv'])} " + ("fused" if self.fused else f"dq {slash(d['dq'])}")


@dataclasses.dataclass(frozen=True)
class Rule:
  """The inputs of the kernel's block choice for one program: the sequence `length` (as the model gives it), on
  TPU or in interpret mode, and the splash_backward key."""
  length: int
  on_tpu: bool
  backward: str = "auto"

  def blocks(self, qk_dim: int, v_dim: int, softcap: bool) -> Blocks:
    """The blocks of every phase for one attention shape."""
    del qk_dim, v_dim, softcap
    b = kernel_block(self.length, self.on_tpu)
    fused = resolve_backward(self.backward, self.length, b) == "fused"
    dq = None if fused else b
    return Blocks(b, b, b, b, b, b, dq, dq)


def splash_attention(q_BNTH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array,
                     segment_ids_BT: jax.Array | None = None, *, scale: float, softcap: float | None = None,
                     window: int | None = None, blocks: Blocks | None = None, interpret: bool | None = None) -> jax.Array:
  """Causal softmax(q k^T * scale) v, as gqa_attention with attention_mask(segment_ids_BT, T, window), by the kernel,
  on heads-first rows (every core's, and the kernel's own order): q [B, N, T, H], k [B, K, T, H], v [B, K, T, Hv];
  returns [B, N, T, Hv] (query head n = k * G + g reads KV head k, as gqa_attention's grouping).
  blocks: the kernel's blocks per phase (default: Rule's on this platform); interpret: Pallas interpret mode
  (default: off TPU). The kernel's output and row log-sum-exp carry the checkpoint name RESIDUALS (what a remat
  policy saves to keep the backward from rerunning the forward kernel).
  """
  T = q_BNTH.shape[2]
  assert k_BKSH.shape[2] == T == v_BKSH.shape[2], (q_BNTH.shape, k_BKSH.shape, v_BKSH.shape)
  on_tpu = platform() == "tpu"
  interpret = not on_tpu if interpret is None else interpret
  if blocks is None:
    blocks = Rule(T, on_tpu).blocks(q_BNTH.shape[-1], v_BKSH.shape[-1], softcap is not None)
  pad = padded_length(T) - T

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
  return SA.make_splash_mha(mask, block_sizes=blocks.sizes(), attn_logits_soft_cap=softcap, head_shards=1,
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
