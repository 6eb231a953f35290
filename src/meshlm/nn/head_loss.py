"""The targets' log-probs from the LM head: materialized from [B, T, V] logits (the reference), or blockwise, the
head and the log-softmax computed together over blocks of the sequence (no [B, T, V] logits).

    logp_BT, entropy_BT = materialized_logprobs(logits_BTV, targets_BT, temperature=..., keep_fn=..., entropy=...)
    logp_BT, entropy_BT = blockwise_logprobs(x_BTD, kernel, targets_BT, tied=..., cap=..., block=..., barrier=...)

models/logprobs.py decides which one a loss runs (loss_impl); every loss reads it there.

x_BTD is the final-normed hidden state; kernel the untied head [D, V] (tied=False) or the embedding table [V, D]
(tied=True). Per block of Tb positions the logits [B, Tb, V] are formed in float32, soft-capped
(cap * tanh(z / cap)), divided by the temperature, restricted to the kept set (keep_fn, e.g. top-k/top-p, plus
the target itself), and reduced to log p(target) = z_target - logsumexp(z) and, when asked, the entropy
H = -sum_v p_v log p_v. A custom VJP recomputes each block's logits in the backward, forms
dz = g_logp (onehot - p) - g_H p (log p + H) (times 1 / temperature and the soft-cap's slope 1 - tanh^2),
and accumulates the head's weight gradient in the kernel's stored order (`btd,btv->dv`, tied `btv,btd->vd`:
dot_general emits it so, nothing to transpose) while producing dx per block. Memory is O(B x Tb x V);
the residuals are x, the kernel, the targets and two floats per token. `block` bounds the positions per block;
T is split into the fewest such blocks, evened out.

The kernel moves once per call (per micro-batch), not per block: it is gathered whole along its embed dim before
each block loop (forward, backward), and the backward keeps each device's partial weight gradient over its own
rows apart from the others' ([row shards, D, V], float32, each device holding its own) until one reduction after
the loop, in the kernel's dtype, to the kernel's sharding. The price is one whole [D, V / tensor] float32
accumulator per device in the backward's loop. Left to itself, XLA:TPU schedules that reduction late (its result is
read only by the optimizer), inside the layers' backward, and holds the accumulator until then: at the peak
(DeepSeek-V3 on v5p-512: f32[1,1,7168,129280], 3.45 GiB; docs/compile.md). With barrier=True an optimization
barrier ties the head's reduced gradient to dx, which the layers' backward reads: the exchange completes before they
start, the accumulator is freed, and the exchange no longer overlaps them. The numbers are the same either way.

Blocks are strided, as train/step._split_micro splits micro-batches: block j holds positions j, nb + j, 2 nb + j,
..., so a sequence sharded over mesh.context stays on its devices. T is padded up to nb x Tb with positions
whose cotangent is zero. The reference is the materialized path: models/decoder.head, then
materialized_logprobs; tests/test_blockwise_loss.py holds the two equal.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P, reshard

from meshlm.parallel.sharding import LOGITS, axes, constrain, current_mesh, einsum, is_explicit, logical_spec

TOKENS_V = axes("batch", "length", None)  # the vocab whole: a keep_fn's sort and top-k are then local


def materialized_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array, *, temperature: float = 1.0,
                          keep_fn: Callable | None = None,
                          entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """(log q(target) [B, T], entropy of q [B, T] or None), float32, from the logits [B, T, V]: q is the softmax of the
  logits over the temperature, restricted to the kept set (keep_fn(z) -> bool [B, T, V], z without gradient, plus the
  target itself, so a kept boundary token is never -inf). The reference of blockwise_logprobs."""
  with jax.named_scope("loss"):
    z = logits_BTV.astype(jnp.float32)
    V = z.shape[-1]
    if keep_fn is None:
      if temperature != 1.0:
        z = z / temperature
      logq = jax.nn.log_softmax(z, axis=-1)
      # A one-hot contraction instead of take_along_axis: the gather is ambiguous on a vocab-sharded
      # operand under explicit sharding, while the product keeps the logits' sharding.
      onehot = constrain(jax.nn.one_hot(targets_BT, V, dtype=jnp.float32), LOGITS)
      logp = jnp.sum(logq * onehot, axis=-1)
      return logp, (-jnp.sum(jnp.exp(logq) * logq, axis=-1) if entropy else None)
    z = constrain(z, TOKENS_V) / temperature
    onehot = constrain(jax.nn.one_hot(targets_BT, V, dtype=jnp.bool_), TOKENS_V)
    keep = keep_fn(jax.lax.stop_gradient(z)) | onehot
    logq = jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)
    logp = jnp.sum(jnp.where(onehot, logq, 0.0), axis=-1)
    if not entropy:
      return logp, None
    # The inner where keeps -inf (off the kept set) out of the product, whose gradient would be NaN there.
    return logp, -jnp.sum(jnp.where(keep, jnp.exp(logq) * jnp.where(keep, logq, 0.0), 0.0), axis=-1)


def blockwise_logprobs(x_BTD: jax.Array, kernel: jax.Array, targets_BT: jax.Array, *, tied: bool,
                       cap: float | None = None, temperature: float = 1.0, keep_fn: Callable | None = None,
                       entropy: bool = False, block: int = 256,
                       barrier: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """(log p(target) [B, T], entropy [B, T] or None), float32, never holding [B, T, V].

  kernel: [D, V] (tied=False) or [V, D] (tied=True), in x's dtype. keep_fn(z [B, Tb, V]) -> bool [B, Tb, V]: the
  tokens the distribution keeps (z: the capped logits over the temperature, without gradient); the target is
  always kept. block: at most this many positions per block. barrier: the backward returns dx only once the head's
  weight gradient is reduced (module docstring)."""
  T = x_BTD.shape[1]
  nb = math.ceil(T / max(1, block))
  tb = math.ceil(T / nb)  # the fewest blocks of at most `block`, evened out: at most nb - 1 padded positions
  opts = _Opts(tied, cap, float(temperature), keep_fn, bool(entropy), nb, tb, bool(barrier))
  logp, ent = _logprobs(opts, x_BTD, kernel, targets_BT)
  return logp, (ent if entropy else None)


class _Opts(NamedTuple):
  """The static choices of one call (hashable: the custom VJP's nondiff argument)."""
  tied: bool
  cap: float | None
  temperature: float
  keep_fn: Callable | None
  entropy: bool
  nb: int  # blocks
  tb: int  # positions per block
  barrier: bool  # dx waits for the head gradient's reduction


def _blocks(a: jax.Array, nb: int, tb: int) -> jax.Array:
  """[B, T, ...] -> [nb, B, tb, ...], zero-padded to nb x tb positions; block j holds positions j, nb + j, ..."""
  B, T = a.shape[:2]
  pad = nb * tb - T
  if pad:
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
  a = jnp.reshape(a, (B, tb, nb) + a.shape[2:])  # position i * nb + j -> [:, i, j]
  a = constrain(a, ("batch", "length", None) + (None,) * (a.ndim - 3))
  return jnp.moveaxis(a, 2, 0)


def _unblocks(a: jax.Array, T: int) -> jax.Array:
  """[nb, B, tb, ...] -> [B, T, ...], the inverse of _blocks (padding dropped)."""
  nb, B, tb = a.shape[:3]
  a = jnp.moveaxis(a, 0, 2)  # [B, tb, nb, ...]
  a = jnp.reshape(a, (B, tb * nb) + a.shape[3:])
  return a[:, :T]


def _cap_slope(t: jax.Array) -> jax.Array:
  """d(cap * tanh(u / cap)) / du, from t = tanh(u / cap)."""
  return 1.0 - t * t


def _entropy_slope(p: jax.Array, logq: jax.Array, ent: jax.Array) -> jax.Array:
  """-dH/dz [B, tb, V] = p (log p + H), on the kept set (p is 0 off it)."""
  return p * (logq + ent[..., None])


def _logits(opts: _Opts, x_BtD: jax.Array, kernel: jax.Array) -> tuple[jax.Array, jax.Array | None]:
  """(z [B, tb, V] float32: capped, over the temperature; t = tanh(u / cap) or None), the head of one block."""
  eqn = "btd,vd->btv" if opts.tied else "btd,dv->btv"
  u = einsum(eqn, x_BtD, kernel, LOGITS).astype(jnp.float32)
  t = None
  if opts.cap is not None:
    t = jnp.tanh(u / opts.cap)
    u = opts.cap * t
  if opts.temperature != 1.0:
    u = u / opts.temperature
  if opts.keep_fn is not None:
    u = constrain(u, TOKENS_V)
  return u, t


def _kept(opts: _Opts, z: jax.Array, onehot: jax.Array) -> jax.Array | None:
  """The kept set [B, tb, V] (bool), or None when every token is kept."""
  if opts.keep_fn is None:
    return None
  return opts.keep_fn(jax.lax.stop_gradient(z)) | (onehot > 0)


def _onehot(opts: _Opts, targets_Bt: jax.Array, V: int) -> jax.Array:
  # A one-hot contraction, as materialized_logprobs: a gather on vocab-sharded logits is ambiguous under explicit.
  return constrain(jax.nn.one_hot(targets_Bt, V, dtype=jnp.float32), TOKENS_V if opts.keep_fn else LOGITS)


def _block_forward(opts: _Opts, x_BtD, kernel, targets_Bt):
  """(logp [B, tb], lse [B, tb], entropy [B, tb] or zeros) of one block."""
  z, _ = _logits(opts, x_BtD, kernel)
  onehot = _onehot(opts, targets_Bt, z.shape[-1])
  keep = _kept(opts, z, onehot)
  zk = z if keep is None else jnp.where(keep, z, -jnp.inf)
  m = jnp.max(zk, axis=-1, keepdims=True)
  # log p = (z - max) - log sum exp(z - max), as jax.nn.log_softmax forms it (z - lse would lose the small
  # differences a peaked distribution's entropy is made of).
  shifted = z - m
  log_sum = jnp.log(jnp.sum(jnp.exp(shifted if keep is None else jnp.where(keep, shifted, -jnp.inf)), axis=-1,
                            keepdims=True))
  logq = shifted - log_sum  # [B, tb, V]
  logp = jnp.sum(logq * onehot, axis=-1)
  lse = (m + log_sum)[..., 0]
  ent = jnp.zeros_like(lse)
  if opts.entropy:
    p = jnp.exp(logq) if keep is None else jnp.where(keep, jnp.exp(logq), 0.0)
    ent = -jnp.sum(p * logq, axis=-1)
  return logp, lse, ent


def _gathered(opts: _Opts, kernel: jax.Array) -> jax.Array:
  """The kernel whole along its embed dim (its vocab dim sharded as the logits' vocab): gathered once, before the
  block loop. Left to the loop's dot, XLA gathers it per block: twice per block with the backward's, 1 GB each for
  llama3-8b's bf16[4096, 128256] (docs/compile.md)."""
  return constrain(kernel, ("vocab", None) if opts.tied else (None, "vocab"))


def _scan_forward(opts: _Opts, x_BTD, kernel, targets_BT):
  T = x_BTD.shape[1]
  kernel = _gathered(opts, kernel)
  xs = (_blocks(x_BTD, opts.nb, opts.tb), _blocks(targets_BT, opts.nb, opts.tb))
  _, (logp, lse, ent) = jax.lax.scan(lambda c, a: (c, _block_forward(opts, a[0], kernel, a[1])), None, xs)
  return _unblocks(logp, T), _unblocks(lse, T), _unblocks(ent, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _logprobs(opts: _Opts, x_BTD, kernel, targets_BT):
  logp, _, ent = _scan_forward(opts, x_BTD, kernel, targets_BT)
  return logp, ent


def _logprobs_fwd(opts: _Opts, x_BTD, kernel, targets_BT):
  logp, lse, ent = _scan_forward(opts, x_BTD, kernel, targets_BT)
  return (logp, ent), (x_BTD, kernel, targets_BT, lse, ent)


def _block_dz(opts: _Opts, x_BtD, kernel, targets_Bt, lse, ent, g_logp, g_ent):
  """d(sum g_logp logp + g_ent H) / du [B, tb, V] float32 for one block, u the head's raw logits."""
  z, t = _logits(opts, x_BtD, kernel)
  onehot = _onehot(opts, targets_Bt, z.shape[-1])
  keep = _kept(opts, z, onehot)
  logq = z - lse[..., None]
  p = jnp.exp(logq) if keep is None else jnp.where(keep, jnp.exp(logq), 0.0)
  dz = g_logp[..., None] * (onehot - p)
  if opts.entropy:
    dz = dz - g_ent[..., None] * _entropy_slope(p, logq, ent)
  if opts.temperature != 1.0:
    dz = dz / opts.temperature
  if t is not None:
    dz = dz * _cap_slope(t)
  return constrain(dz, LOGITS)


def _sharded_like(a: jax.Array):
  """The out_sharding that keeps a result sharded as a (explicit), else None."""
  return jax.typeof(a).sharding.spec if is_explicit() else None


def _pin(a: jax.Array, spec: P) -> jax.Array:
  """a sharded as the mesh-axis spec (reshard under explicit, a constraint under auto; as it is with no mesh)."""
  if current_mesh().empty:
    return a
  return reshard(a, spec) if is_explicit() else jax.lax.with_sharding_constraint(a, spec)


def _partials(opts: _Opts, x_BtD: jax.Array, kernel: jax.Array) -> tuple[int, int, P, P]:
  """(nB, nT, rows, acc): how many shards the block's batch and length dims are split into on this mesh (as
  _blocks constrains them), the spec `rows` of [nB, B / nB, nT, tb / nT] that keeps each shard on its devices,
  and the spec `acc` of the per-shard partial weight gradients [nB, nT, D, V] (tied [nB, nT, V, D]): the shard dims
  as the rows', the vocab dim as the logits'."""
  B, tb = x_BtD.shape[:2]
  mesh = current_mesh()
  sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
  count = lambda e: 1 if e is None else math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e))  # noqa: E731
  V = kernel.shape[0 if opts.tied else 1]
  sb, st, sv = (tuple(logical_spec(LOGITS, (B, tb, V))) + (None,) * 3)[:3]
  acc = P(sb, st, *((sv, None) if opts.tied else (None, sv)))
  return count(sb), count(st), P(sb, None, st, None), acc


def _split_rows(a: jax.Array, nB: int, nT: int, spec: P, last) -> jax.Array:
  """[B, tb, F] -> [nB, B / nB, nT, tb / nT, F], the shard dims sharded as the rows were (spec), F as `last`."""
  B, tb, F = a.shape
  shape, out = (nB, B // nB, nT, tb // nT, F), P(*spec, last)
  if is_explicit():
    return jnp.reshape(a, shape, out_sharding=out)
  return _pin(jnp.reshape(a, shape), out)


def _weight_grad(opts: _Opts, x5: jax.Array, dz5: jax.Array, acc_spec: P) -> jax.Array:
  """One block's head weight gradient per row shard, [nB, nT, D, V] ([nB, nT, V, D] tied): each device's partial
  sum over its own rows, apart from the others' (the contraction is over the rows within a shard, so it needs no
  collective). The loop accumulates these and reduces them once after it; a [D, V] result per block would be
  reduced per block. In the kernel's stored order: dot_general emits (batch, lhs free, rhs free) dims, so x first
  for [D, V] and dz first for the tied [V, D]; there is no transpose after the dot. In the compute dtype, as the
  materialized head's is."""
  sh = acc_spec if is_explicit() else None
  if opts.tied:
    g = jnp.einsum("abctv,abctd->acvd", dz5, x5, out_sharding=sh)
  else:
    g = jnp.einsum("abctd,abctv->acdv", x5, dz5, out_sharding=sh)
  return g if sh is not None else _pin(g, acc_spec)


def _logprobs_bwd(opts: _Opts, res, cts):
  x_BTD, kernel, targets_BT, lse_BT, ent_BT = res
  g_logp, g_ent = cts
  T, nb, tb = x_BTD.shape[1], opts.nb, opts.tb
  blocked = [_blocks(a, nb, tb) for a in (x_BTD, targets_BT, lse_BT, ent_BT, g_logp, g_ent)]
  dx_eqn = "btv,vd->btd" if opts.tied else "btv,dv->btd"
  k_sh = _sharded_like(kernel)
  whole = _gathered(opts, kernel)  # once per call; the loop's dots read it as it is
  nB, nT, rows, acc_spec = _partials(opts, blocked[0][0], kernel)
  vocab = acc_spec[2 if opts.tied else 3]

  def body(acc, a):
    x, tg, lse, ent, gl, ge = a
    dz = _block_dz(opts, x, whole, tg, lse, ent, gl, ge).astype(x.dtype)
    dx = jnp.einsum(dx_eqn, dz, whole, out_sharding=_sharded_like(x))
    g = _weight_grad(opts, _split_rows(x, nB, nT, rows, None), _split_rows(dz, nB, nT, rows, vocab), acc_spec)
    return acc + g.astype(jnp.float32), dx  # the sum over blocks in float32

  acc_shape = (nB, nT) + kernel.shape
  acc0 = jnp.zeros(acc_shape, jnp.float32, out_sharding=acc_spec) if is_explicit() else \
      _pin(jnp.zeros(acc_shape, jnp.float32), acc_spec)
  acc, dx = jax.lax.scan(body, acc0, tuple(blocked))
  # The one reduction of the step's head gradient (per call: per micro-batch), over every row shard, in the
  # kernel's dtype (as the materialized head's), to the kernel's own sharding: the partials are first exchanged so
  # that each device holds every row shard's partial of its own slice of the kernel (an all-to-all: a
  # reduce-scatter's bytes), then summed where they are. Summed first (over the sharded row-shard dims), the whole
  # [D, V] would be all-reduced and sliced: XLA:TPU then computes the gradient norm's sum of squares on the whole
  # all-reduced array, which leaves it an all-reduce (llama3-8b, v5p-8: 1.05 GB per step; docs/compile.md).
  # Under auto the kernel's sharding is its logical one; a tied table's is left as it was: its gradient adds the
  # lookup's, and pinning this part moves where XLA adds them (llama2-tiny, float32: 3.7e-9 apart).
  # lax.reduce, not jnp.sum: jnp.sum accumulates a bfloat16 sum in float32 (twice the bytes on the wire).
  parts = acc.astype(kernel.dtype)
  if k_sh is not None or not (current_mesh().empty or opts.tied):
    k_spec = k_sh if k_sh is not None else logical_spec(_KERNEL_AXES[opts.tied], kernel.shape)
    parts = _pin(parts, P(None, None, *k_spec))
  dk = jax.lax.reduce(parts, jnp.zeros((), kernel.dtype), jax.lax.add, (0, 1))
  if k_sh is not None:
    dk = reshard(dk, k_sh)
  dx_BTD = _unblocks(dx, T)
  if opts.barrier:
    # What reads dx (the layers' backward) now waits for dk, hence for the exchange and the accumulator it frees.
    dx_BTD, dk = jax.lax.optimization_barrier((dx_BTD, dk))
  return dx_BTD, dk, None


_KERNEL_AXES = {False: axes("embed", "vocab"), True: axes("vocab", "embed")}  # the head [D, V], the tied table [V, D]


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)
