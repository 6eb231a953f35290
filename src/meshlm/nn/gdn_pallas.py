"""The chunked gated delta rule as a Pallas TPU kernel, forward and backward: the `gdn_impl=pallas` rule.

The contract is nn/gdn.py's (gated_delta_rule_chunked is the reference it is tested against, with the recurrence,
gated_delta_rule_reference): q, k [B, T, K, H], v [B, T, N, J], g, beta [B, T, N], optional segment ids [B, T]
(packed documents: the state is zero entering every segment start) and initial state [B, N, H, J] (entering t = 0);
returns (o [B, T, N, J] in v's dtype, final state [B, N, H, J] float32). Any T (a ragged last chunk is padded with
no-op positions), value head n reads key head n // G.

The math, per value head and chunk of W positions, with S [H, J] the state entering the chunk (nn/gdn.py's
derivation; i, j positions in the chunk, "same" pairs in one segment, c_i: i still in the segment that S belongs to,
l_j: j in the chunk's last segment):

  gamma_i = sum of g_j over same j <= i                              the gate cumsum, restarted at segment starts
  D_ij    = exp(gamma_i - gamma_j) over same j <= i, else 0           [W, W]
  A       = strict_tril(beta_i (k_i . k_j) D_ij),  Tm = (I + A)^-1    [W, W]
  u = Tm (beta v),  w = Tm (beta c exp(gamma) k),  delta = u - w S   [W, J], [W, H], [W, J]
  o = (c exp(gamma) q) S + (q k^T * D) delta                         [W, J]
  S <- c_last exp(gamma_last) S + (l exp(gamma_last - gamma) k)^T delta

The inverse: Tm of the 2 x 2 diagonal blocks is I - A there (exactly: A's square vanishes on them); it is then
doubled, X_2b = X_b - X_b A_off X_b (A_off: A's blocks below the b-blocks' diagonal inside each 2b-block), until b
is the chunk: log2(W) - 1 steps of two products each, every one the exact block inverse (no power of A is formed, so
no growth; each step is a Newton step X (2I - (I + A_2b) X) whose residual is nilpotent). Float32 inputs: products
at HIGHEST. bf16 inputs, whose every use of Tm rounds it to bf16 (2^-9), by `inverse` (model.parts.gdn.inverse):
"refine" takes the doubling's products in one bf16 pass (about 1e-2 relative, the cancellation of
entries that alternate) and then one Newton step with the whole A, X + X (I - (I + A) X), whose residual (I + A) X
takes three bf16 passes (`_mm_split`) and whose correction one: the error squares, to at most 1.7e-4 measured at
chunk 128 (tests/test_gdn_pallas.py); "split" (the default) takes every product in three passes (about 2^-16).
Static cost per head and chunk of 64 (v5e, 8 heads a step, below): forward 818 bundles with refine, 1,200 with split,
364 without any inverse; with HIGHEST products the inverse was 80% of the forward. On the chip the hybrid's step was
not faster under refine (889.1 ms against split's 874.6, docs/tpu.md): the kernel waits on its chain of products,
not on issue slots, so split, the exact one, stays the default.

The backward (derived by hand, every product a matmul): with dO [W, J] and dS' [H, J] (the cotangent of the state
leaving the chunk), P = q k^T * D, kd = l exp(gamma_last - gamma) k, qe = c exp(gamma) q, kc = beta c exp(gamma) k:

  d_delta = P^T dO + kd dS'        dP = dO delta^T        d_kd = delta dS'^T        d_qe = dO S^T
  dw = -d_delta S^T,  dkc = Tm^T dw,  dbv = Tm^T d_delta,  dA = -strict_tril(dkc w^T + dbv u^T)
  dS = dec dS' + qe^T dO - w^T d_delta                                          (dec = c_last exp(gamma_last))
  dq = c exp(gamma) d_qe + (dP * D) k
  dk = l exp(gamma_last - gamma) d_kd + (dP * D)^T q + beta c exp(gamma) dkc + (dKK + dKK^T) k,  dKK = dA beta D
  dv = beta dbv,  dbeta = rowsum(dA * kk * D) + rowsum(v * dbv) + rowsum(c exp(gamma) k * dkc)
  dgamma = rowsum(qe * d_qe) + rowsum(kc * dkc) + rowsum(X) - colsum(X) - kd-terms,  X = (dP * qk + dA beta kk) * D
  dg_j = sum of dgamma_i over same i >= j

The kernels. Grid (B, K / hk, U): a step takes a tile of hk key heads and their hv = hk G value heads (`key_tile`:
at most HEADS_PER_STEP value heads), each head an unrolled copy of the chunk's math, so the scheduler interleaves
independent chains of small matmuls (per head and chunk of 64 at 8 heads a step, v5e, H = J = 128, inverse=split
before the inverse took one pass: 1,350 / 1,083 bundles forward / backward at 2 heads a step, 1,221 / 952 at 8,
1,195 / 922 at 16; benchmarks/gdn_bundles.py measures them). B and the tiles are
"parallel", the chunks "arbitrary" (sequential): the tile's states [hv, H, J] float32 live in a VMEM scratch across
the chunks. q and k are read in place as [B, T, K H] (blocks (1, W, hk H)), v and o as [B, T, N J] (blocks (1, W,
hv J)): no expanded or head-major copy. The per-position scalars (g, beta as [B, N, U, W]; the segment index and the
carry flag as [B, U, W]) are one block per (row, tile), whole in their last two dims (Mosaic's (8, 128)-or-full
rule), a chunk's row picked by a masked sum. The forward saves, per chunk, the state entering it [B, N, U, H, J] and
Tm [B, N, U, W, W] (float32) for the backward: 64 + 16 KiB per (row, head, chunk) of 64 positions, written once and
read once, against recomputing the state chain (a second sweep over the chunks) and the inverse (its ten dependent
products) in the backward. The backward runs the chunks in reverse with the states' cotangents [hv, H, J] in VMEM;
dq and dk of a key head sum its G value heads' within the step.

Precision: the products take the inputs' dtype (with v's: q and k are cast to it outside) with float32 accumulation:
bfloat16 on the MXU for bf16 inputs (the state and the float32 terms rounded to bf16 as they enter a product, as
flash-linear-attention's kernels do), float32 at Precision.HIGHEST for float32 inputs. The inverse, the gates and
the state are float32 throughout (the inverse's products as above).

Under a mesh the Mosaic call cannot be partitioned by XLA: it runs in a shard_map over the current mesh, the rows
split as the batch's logical axis and the heads and the sequence whole (each device runs its own rows).

On TPU the kernel needs a tile of at most MAX_HEADS_PER_STEP value heads whose q/k and v/o blocks are whole 128-lane
tiles (or every head) and a chunk of a multiple of 16 positions (`fits`); off TPU it runs in Pallas interpret mode
(slow: tests and toys).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from meshlm.nn.gdn import check_chunk_size, segment_starts
from meshlm.parallel.sharding import current_mesh, logical_spec, platform

LANES = 128
# The kernels' names in the compiled program (pallas_call's name; analysis/cost.py counts their FLOPs by them).
FWD_NAME = "gdn_chunk_fwd"
BWD_NAME = "gdn_chunk_bwd"
_HI = jax.lax.Precision.HIGHEST


# Value heads per grid step, at most (when the key heads allow it): each an unrolled copy of the chunk's math, so the
# scheduler interleaves independent chains of small matmuls and a step's fixed cost is shared. gated_delta_rule_pallas
# takes another (heads_per_step=).
HEADS_PER_STEP = 8
MAX_HEADS_PER_STEP = 16  # a tile no narrower than 128 lanes may need more; past this one the step's VMEM grows too far
# How a bf16 run computes the chunk's inverse (`_inverse`; model.parts.gdn.inverse): "refine", one-pass bf16
# doubling products and one Newton step with a three-pass residual; "split", three bf16 passes for every product.
INVERSES = ("split", "refine")


def key_tile(K: int, G: int, H: int, J: int, heads_per_step: int = HEADS_PER_STEP, lanes: bool = True) -> int | None:
  """The key heads hk of a grid step (its value heads hk G): the largest divisor of K with hk G <= heads_per_step
  whose blocks of the [B, T, K H] and [B, T, N J] views Mosaic takes (with `lanes`: hk H and hk G J multiples of 128,
  or the whole K), else the smallest such with hk G <= MAX_HEADS_PER_STEP; None when there is none."""
  legal = [d for d in range(1, K + 1) if K % d == 0
           and (not lanes or d == K or ((d * H) % LANES == 0 and (d * G * J) % LANES == 0))]
  under = [d for d in legal if d * G <= max(heads_per_step, G)]
  if under:
    return max(under)
  over = [d for d in legal if d * G <= MAX_HEADS_PER_STEP]
  return min(over) if over else None


def fits(K: int, N: int, H: int, J: int, chunk_size: int) -> bool:
  """Whether the Mosaic kernel takes these shapes on TPU: a tile of key heads whose blocks are multiples of 128 lanes
  (or span the heads) within MAX_HEADS_PER_STEP value heads (`key_tile`), and a chunk of a multiple of 16 positions
  (8 sublanes; bf16 packs two rows per sublane)."""
  return N % K == 0 and key_tile(K, N // K, H, J) is not None and chunk_size % 16 == 0


class _Static(NamedTuple):
  """What the kernels are built from (hashable: custom_vjp's static argument)."""
  W: int  # chunk
  G: int  # value heads per key head
  hk: int  # key heads per grid step
  inverse: str  # how bf16 inputs' inverse computes (INVERSES)
  interpret: bool


# ------------------------------------------------------------------------------------------------ in-kernel helpers


def _iota(W: int, axis: int) -> jax.Array:
  return jax.lax.broadcasted_iota(jnp.int32, (W, W), axis)


def _col(row_1W: jax.Array) -> jax.Array:
  """[1, W] -> [W, 1] (a masked lane sum: no transpose of a one-row array)."""
  W = row_1W.shape[1]
  return jnp.sum(jnp.where(_iota(W, 0) == _iota(W, 1), row_1W, 0.0), axis=1, keepdims=True)


def _row(col_W1: jax.Array) -> jax.Array:
  """[W, 1] -> [1, W]."""
  W = col_W1.shape[0]
  return jnp.sum(jnp.where(_iota(W, 0) == _iota(W, 1), col_W1, 0.0), axis=0, keepdims=True)


def _last(row_1W: jax.Array) -> jax.Array:
  """The last entry of a [1, W] row, as [1, 1]."""
  W = row_1W.shape[1]
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, W), 1)
  return jnp.sum(jnp.where(lane == W - 1, row_1W, 0.0), axis=1, keepdims=True)


def _pick(x_UW: jax.Array, u) -> jax.Array:
  """Row u (traced) of a [U, W] block, as [1, W] (a masked sublane sum)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, x_UW.shape, 0)
  return jnp.sum(jnp.where(rows == u, x_UW, 0.0), axis=0, keepdims=True)


def _put(x_UW: jax.Array, u, row_1W: jax.Array) -> jax.Array:
  """x with row u replaced by row_1W."""
  rows = jax.lax.broadcasted_iota(jnp.int32, x_UW.shape, 0)
  return jnp.where(rows == u, row_1W, x_UW)


def _dot(a, b, dims, cdt):
  """a . b contracting dims ((a's,), (b's,)), float32 out: both operands in cdt (bf16 on the MXU), or float32 at
  HIGHEST."""
  a, b = a.astype(cdt), b.astype(cdt)
  precision = _HI if cdt == jnp.float32 else None
  return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _mm(a, b, cdt):  # a [M, K] b [K, N]
  return _dot(a, b, ((1,), (0,)), cdt)


def _mm_nt(a, b, cdt):  # a [M, K] b [N, K] -> a b^T
  return _dot(a, b, ((1,), (1,)), cdt)


def _mm_tn(a, b, cdt):  # a [K, M] b [K, N] -> a^T b
  return _dot(a, b, ((0,), (0,)), cdt)


def _mm_split(a, b, cdt):
  """a [M, K] @ b [K, N] of float32 operands, float32 out: at HIGHEST when cdt is float32, else in three bf16 passes
  (each operand split into a bf16 head and a bf16 remainder; the remainders' product dropped: about 2^-16 relative,
  at half the MXU work of HIGHEST's six)."""
  if cdt == jnp.float32:
    return _mm(a, b, jnp.float32)
  bf16 = jnp.bfloat16
  a_hi, b_hi = a.astype(bf16), b.astype(bf16)
  a_lo, b_lo = (a - a_hi.astype(jnp.float32)).astype(bf16), (b - b_hi.astype(jnp.float32)).astype(bf16)
  return _mm(a_hi, b_hi, bf16) + (_mm(a_hi, b_lo, bf16) + _mm(a_lo, b_hi, bf16))


def _inverse(a_WW: jax.Array, cdt, method: str) -> jax.Array:
  """(I + A)^-1 for A [W, W] strictly lower triangular (W a power of two), float32: I - A on the 2 x 2 diagonal
  blocks, then X_2b = X_b - X_b A_off X_b until the block is the chunk (the module docstring). Its products: at
  HIGHEST for float32 cdt; for bf16 by `method` (INVERSES): "split", every product in three bf16 passes
  (_mm_split); "refine", every doubling product one bf16 pass, then one Newton step X + X (I - (I + A) X) with
  (I + A) X in three passes (the residual squares: the one-pass doubling's ~1e-2 becomes ~1e-4, under the 2^-9 of
  the bf16 rounding that every use of Tm applies)."""
  W = a_WW.shape[0]
  i, j = _iota(W, 0), _iota(W, 1)
  eye = (i == j).astype(jnp.float32)
  if W == 1:
    return eye
  one_pass = cdt != jnp.float32 and method == "refine"
  mm = (lambda a, b: _mm(a, b, cdt)) if one_pass else (lambda a, b: _mm_split(a, b, cdt))  # noqa: E731
  x = eye - jnp.where(i // 2 == j // 2, a_WW, 0.0)
  b = 2
  while b < W:
    off = jnp.where((i // (2 * b) == j // (2 * b)) & (i // b != j // b), a_WW, 0.0)
    x = x - mm(x, mm(off, x))
    b *= 2
  if one_pass:
    x = x + _mm(x, eye - x - _mm_split(a_WW, x, cdt), cdt)  # the residual strictly lower, as the correction
  return x


class _Chunk(NamedTuple):
  """What every head of a chunk shares: its segment structure (the module docstring's letters)."""
  incl: jax.Array  # [W, W] bool: same segment, j <= i
  strict: jax.Array  # [W, W] bool: same segment, j < i
  in_last: jax.Array  # [W, 1] bool: l, in the chunk's last segment
  carry: jax.Array  # [W, 1] c, still in the segment of the state entering the chunk
  carry_last: jax.Array  # [1, 1] c_last
  last: jax.Array  # [W, 1] bool: the last position


def _chunk(seg_row, carry_row) -> _Chunk:
  W = seg_row.shape[1]
  i, j = _iota(W, 0), _iota(W, 1)
  seg_col = _col(seg_row)
  same = seg_col == seg_row
  last = jax.lax.broadcasted_iota(jnp.int32, (W, 1), 0) == W - 1
  return _Chunk(same & (i >= j), same & (i > j), seg_col == _last(seg_row), _col(carry_row), _last(carry_row), last)


class _Gates(NamedTuple):
  """One value head's gate terms in a chunk."""
  dm: jax.Array  # [W, W] D
  beta: jax.Array  # [W, 1]
  ce: jax.Array  # [W, 1] c exp(gamma)
  f: jax.Array  # [W, 1] l exp(gamma_last - gamma)
  dec: jax.Array  # [1, 1] c_last exp(gamma_last)


def _gates(ch: _Chunk, g_row, beta_row) -> _Gates:
  incl = ch.incl
  gam_col = jnp.sum(jnp.where(incl, g_row, 0.0), axis=1, keepdims=True)  # [W, 1]: the cumsum restarted at starts
  gam_row = _row(gam_col)
  dm = jnp.where(incl, jnp.exp(jnp.where(incl, gam_col - gam_row, 0.0)), 0.0)
  gam_last = _last(gam_row)
  f = jnp.where(ch.in_last, jnp.exp(jnp.where(ch.in_last, gam_last - gam_col, 0.0)), 0.0)
  return _Gates(dm, _col(beta_row), ch.carry * jnp.exp(gam_col), f, ch.carry_last * jnp.exp(gam_last))


# ------------------------------------------------------------------------------------------------------ the forward


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, carry_ref, s0_ref, o_ref, sf_ref, *rest, U, G, H, J,
                residuals, cdt, inverse):
  """One (row, tile of key heads, chunk) step: the tile's hk key heads and their hv = hk G value heads, each an
  unrolled copy of the chunk's math (independent chains the scheduler interleaves). Refs: q, k (1, W, hk H); v, o
  (1, W, hv J); g, beta (1, hv, U, W); seg, carry (1, U, W); s0, sf (1, hv, H, J); with residuals st (1, hv, 1, H, J)
  (the states entering the chunk) and tm (1, hv, 1, W, W); scratch S [hv, H, J] float32."""
  if residuals:
    st_ref, tm_ref, S_scr = rest
  else:
    (S_scr,) = rest
  u = pl.program_id(2)
  hv = S_scr.shape[0]
  f32 = jnp.float32

  @pl.when(u == 0)
  def _():
    S_scr[...] = s0_ref[0]

  ch = _chunk(_pick(seg_ref[0], u), _pick(carry_ref[0], u))
  for kh in range(hv // G):
    q, k = q_ref[0, :, kh * H:(kh + 1) * H], k_ref[0, :, kh * H:(kh + 1) * H]  # [W, H]
    kf = k.astype(f32)
    kk = _mm_nt(k, k, cdt)  # [W, W], shared by the key head's G value heads
    qk = _mm_nt(q, k, cdt)
    for n in range(kh * G, (kh + 1) * G):
      v = v_ref[0, :, n * J:(n + 1) * J]  # [W, J]
      t = _gates(ch, _pick(g_ref[0, n], u), _pick(beta_ref[0, n], u))
      S = S_scr[n]  # [H, J]
      tm = _inverse(jnp.where(ch.strict, t.beta * kk * t.dm, 0.0), cdt, inverse)  # [W, W]
      u_ = _mm(tm, t.beta * v.astype(f32), cdt)  # [W, J]
      w = _mm(tm, (t.beta * t.ce) * kf, cdt)  # [W, H]
      delta = u_ - _mm(w, S, cdt)  # [W, J]
      o = _mm(t.ce * q.astype(f32), S, cdt) + _mm(qk * t.dm, delta, cdt)
      o_ref[0, :, n * J:(n + 1) * J] = o.astype(o_ref.dtype)
      S_new = t.dec * S + _mm_tn(t.f * kf, delta, cdt)
      S_scr[n] = S_new
      if residuals:
        st_ref[0, n, 0] = S
        tm_ref[0, n, 0] = tm

  @pl.when(u == U - 1)
  def _():
    sf_ref[0] = S_scr[...]


def _specs(st: "_Static", U: int, H: int, J: int, reverse: bool):
  """The BlockSpecs of the grid (B, K / hk, U) (chunks in reverse for the backward), by what they hold."""
  W, hk, hv = st.W, st.hk, st.hk * st.G
  c = (lambda u: U - 1 - u) if reverse else (lambda u: u)  # noqa: E731
  return dict(
      keys=pl.BlockSpec((1, W, hk * H), lambda b, t, u: (b, c(u), t)),  # q, k [B, Tp, K H]
      values=pl.BlockSpec((1, W, hv * J), lambda b, t, u: (b, c(u), t)),  # v, o [B, Tp, N J]
      gates=pl.BlockSpec((1, hv, U, W), lambda b, t, u: (b, t, 0, 0)),  # g, beta [B, N, U, W]
      segs=pl.BlockSpec((1, U, W), lambda b, t, u: (b, 0, 0)),  # seg, carry [B, U, W]
      state=pl.BlockSpec((1, hv, H, J), lambda b, t, u: (b, t, 0, 0)),  # [B, N, H, J]
      states=pl.BlockSpec((1, hv, 1, H, J), lambda b, t, u: (b, t, c(u), 0, 0)),  # [B, N, U, H, J]
      inverses=pl.BlockSpec((1, hv, 1, W, W), lambda b, t, u: (b, t, c(u), 0, 0)))  # [B, N, U, W, W]


def _params(interpret: bool):
  return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
              interpret=interpret)


def _fwd_call(st: _Static, q, k, v, g, beta, seg, carry, s0, *, residuals: bool):
  """The forward kernel on the kernel layouts (`_local`): (o [B, Tp, N J], final state [B, N, H, J]) and, with
  residuals, (entering states [B, N, U, H, J], Tm [B, N, U, W, W])."""
  B, Tp, KH = q.shape
  N, U, W = g.shape[1], g.shape[2], st.W
  K = N // st.G
  H, J = KH // K, v.shape[2] // N
  sp = _specs(st, U, H, J, reverse=False)
  in_specs = [sp["keys"], sp["keys"], sp["values"], sp["gates"], sp["gates"], sp["segs"], sp["segs"], sp["state"]]
  out_specs = [sp["values"], sp["state"]]
  out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, N, H, J), jnp.float32)]
  if residuals:
    out_specs += [sp["states"], sp["inverses"]]
    out_shape += [jax.ShapeDtypeStruct((B, N, U, H, J), jnp.float32),
                  jax.ShapeDtypeStruct((B, N, U, W, W), jnp.float32)]
  kernel = functools.partial(_fwd_kernel, U=U, G=st.G, H=H, J=J, residuals=residuals, cdt=v.dtype,
                             inverse=st.inverse)
  scratch = [pltpu.VMEM((st.hk * st.G, H, J), jnp.float32)]
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=(B, K // st.hk, U), in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      name=FWD_NAME, **_params(st.interpret))(q, k, v, g, beta, seg, carry, s0)


# ----------------------------------------------------------------------------------------------------- the backward


def _bwd_head(ch: _Chunk, t: _Gates, q, k, qk, kk, v, do, S, tm, dS, cdt):
  """One value head's chunk backward (the module docstring): (dq, dk, dv, dg [1, W], dbeta [1, W], dS entering)."""
  f32 = jnp.float32
  qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
  # The forward's terms, from the state entering the chunk and its saved inverse.
  u_ = _mm(tm, t.beta * vf, cdt)  # [W, J]
  kc = (t.beta * t.ce) * kf  # [W, H]
  w = _mm(tm, kc, cdt)  # [W, H]
  delta = u_ - _mm(w, S, cdt)  # [W, J]
  p = qk * t.dm
  kd = t.f * kf  # [W, H]
  qe = t.ce * qf  # [W, H]
  # Back through o = qe S + P delta and S' = dec S + kd^T delta.
  d_delta = _mm_tn(p, do, cdt) + _mm(kd, dS, cdt)  # [W, J]
  d_kd = _mm_nt(delta, dS, cdt)  # [W, H]
  dp = _mm_nt(do, delta, cdt)  # [W, W]
  d_qe = _mm_nt(do, S, cdt)  # [W, H]
  dS_in = t.dec * dS + _mm_tn(qe, do, cdt) - _mm_tn(w, d_delta, cdt)  # [H, J]
  # Back through delta = u - w S, u = Tm (beta v), w = Tm kc, Tm = (I + A)^-1.
  dw = -_mm_nt(d_delta, S, cdt)  # [W, H]
  dkc = _mm_tn(tm, dw, cdt)  # [W, H]
  dbv = _mm_tn(tm, d_delta, cdt)  # [W, J]
  da = jnp.where(ch.strict, -(_mm_nt(dkc, w, cdt) + _mm_nt(dbv, u_, cdt)), 0.0)  # [W, W]
  dqk = dp * t.dm
  dkk = da * t.beta * t.dm
  x = (dp * qk + da * t.beta * kk) * t.dm  # dD * D: D's gamma cotangent, rows minus columns
  dq = t.ce * d_qe + _mm(dqk, k, cdt)
  dk = t.f * d_kd + _mm_tn(dqk, q, cdt) + (t.beta * t.ce) * dkc + _mm(dkk, k, cdt) + _mm_tn(dkk, k, cdt)
  rowsum = lambda y: jnp.sum(y, axis=1, keepdims=True)  # noqa: E731
  dbeta = rowsum(da * kk * t.dm) + rowsum(vf * dbv) + rowsum(t.ce * kf * dkc)  # [W, 1]
  to_last = t.f * rowsum(kf * d_kd)  # [W, 1]: kd's gamma cotangent, -gamma_j's (and +gamma_last's summed)
  gamma_last = jnp.sum(to_last, axis=0, keepdims=True) + t.dec * jnp.sum(S * dS, keepdims=True)  # [1, 1]
  dgam = (rowsum(qe * d_qe) + rowsum(kc * dkc) + rowsum(x) - _col(jnp.sum(x, axis=0, keepdims=True)) - to_last
          + jnp.where(ch.last, gamma_last, 0.0))  # [W, 1]
  dg = jnp.sum(jnp.where(ch.incl, dgam, 0.0), axis=0, keepdims=True)  # [1, W]: gamma_i sums g_j over incl
  return dq, dk, t.beta * dbv, dg, _row(dbeta), dS_in


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, carry_ref, st_ref, tm_ref, do_ref, dsf_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, ds0_ref, dS_scr, *, U, G, H, J, cdt):
  """One step of the reverse sweep: chunk U - 1 - u of a tile's value heads. Refs as the forward's, plus do
  (1, W, hv J), dsf and ds0 (1, hv, H, J); dq, dk (1, W, hk H) (a key head's sums its G value heads'); dv
  (1, W, hv J); dg, dbeta (1, hv, U, W), a row per step; dS_scr [hv, H, J] the cotangents of the states leaving the
  chunk."""
  u = pl.program_id(2)
  c = U - 1 - u  # the chunk
  hv = dS_scr.shape[0]

  @pl.when(u == 0)
  def _():
    dS_scr[...] = dsf_ref[0]

  ch = _chunk(_pick(seg_ref[0], c), _pick(carry_ref[0], c))
  for kh in range(hv // G):
    q, k = q_ref[0, :, kh * H:(kh + 1) * H], k_ref[0, :, kh * H:(kh + 1) * H]  # [W, H]
    kk, qk = _mm_nt(k, k, cdt), _mm_nt(q, k, cdt)  # [W, W]
    dq_sum = dk_sum = 0.0
    for n in range(kh * G, (kh + 1) * G):
      t = _gates(ch, _pick(g_ref[0, n], c), _pick(beta_ref[0, n], c))
      dq, dk, dv, dg, dbeta, dS_in = _bwd_head(ch, t, q, k, qk, kk, v_ref[0, :, n * J:(n + 1) * J],
                                               do_ref[0, :, n * J:(n + 1) * J], st_ref[0, n, 0], tm_ref[0, n, 0],
                                               dS_scr[n], cdt)
      dq_sum, dk_sum = dq_sum + dq, dk_sum + dk
      dS_scr[n] = dS_in
      dv_ref[0, :, n * J:(n + 1) * J] = dv.astype(dv_ref.dtype)
      dg_ref[0, n] = _put(dg_ref[0, n], c, dg)
      dbeta_ref[0, n] = _put(dbeta_ref[0, n], c, dbeta)
    dq_ref[0, :, kh * H:(kh + 1) * H] = dq_sum.astype(dq_ref.dtype)
    dk_ref[0, :, kh * H:(kh + 1) * H] = dk_sum.astype(dk_ref.dtype)

  @pl.when(u == U - 1)
  def _():
    ds0_ref[0] = dS_scr[...]


def _bwd_call(st: _Static, q, k, v, g, beta, seg, carry, states, tm, do, dsf):
  """The backward kernel: (dq, dk [B, Tp, K H], dv [B, Tp, N J], dg, dbeta [B, N, U, W], d initial state
  [B, N, H, J])."""
  B, Tp, KH = q.shape
  N, U = g.shape[1], g.shape[2]
  K = N // st.G
  H, J = KH // K, v.shape[2] // N
  sp = _specs(st, U, H, J, reverse=True)
  in_specs = [sp["keys"], sp["keys"], sp["values"], sp["gates"], sp["gates"], sp["segs"], sp["segs"], sp["states"],
              sp["inverses"], sp["values"], sp["state"]]
  out_specs = [sp["keys"], sp["keys"], sp["values"], sp["gates"], sp["gates"], sp["state"]]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, jnp.float32),
               jax.ShapeDtypeStruct(beta.shape, jnp.float32), jax.ShapeDtypeStruct((B, N, H, J), jnp.float32)]
  kernel = functools.partial(_bwd_kernel, U=U, G=st.G, H=H, J=J, cdt=v.dtype)
  scratch = [pltpu.VMEM((st.hk * st.G, H, J), jnp.float32)]
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=(B, K // st.hk, U), in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      name=BWD_NAME, **_params(st.interpret))(q, k, v, g, beta, seg, carry, states, tm, do, dsf)


# ------------------------------------------------------------------------------------------- custom VJP, layouts


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rule(st: _Static, q, k, v, g, beta, s0, seg, carry):
  """The rule on the kernel layouts: (o [B, Tp, N J], final state [B, N, H, J])."""
  return _fwd_call(st, q, k, v, g, beta, seg, carry, s0, residuals=False)


def _rule_fwd(st, q, k, v, g, beta, s0, seg, carry):
  o, sf, states, tm = _fwd_call(st, q, k, v, g, beta, seg, carry, s0, residuals=True)
  return (o, sf), (q, k, v, g, beta, seg, carry, states, tm)


def _rule_bwd(st, res, cots):
  q, k, v, g, beta, seg, carry, states, tm = res
  do, dsf = cots
  dq, dk, dv, dg, dbeta, ds0 = _bwd_call(st, q, k, v, g, beta, seg, carry, states, tm, do.astype(v.dtype), dsf)
  return dq, dk, dv, dg, dbeta, ds0, jnp.zeros_like(seg), jnp.zeros_like(carry)


_rule.defvjp(_rule_fwd, _rule_bwd)


def _segment_rows(segment_ids_BT, B: int, T: int, U: int, W: int) -> tuple[jax.Array, jax.Array]:
  """(segment index, carry flag), float32 [B, U, W] each over the padded length U * W: the index counts the
  segment starts up to each position (so two runs of one id never match; the padded tail continues the last
  segment), the flag says a position is still in the segment that the state entering its chunk belongs to."""
  starts = segment_starts(segment_ids_BT, T)
  if starts is None:
    starts = jnp.zeros((B, T), bool)
  starts = jnp.pad(starts, ((0, 0), (0, U * W - T))).reshape(B, U, W)
  seg = jnp.cumsum(starts.reshape(B, U * W), axis=1, dtype=jnp.int32).reshape(B, U, W)
  incoming = seg[:, :, :1] - starts[:, :, :1].astype(jnp.int32)  # [B, U, 1]
  return seg.astype(jnp.float32), (seg == incoming).astype(jnp.float32)


def _local(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, seg_BT, s0_BNHJ, *, W: int, hk: int, inverse: str,
           interpret: bool):
  """One device's rows: the layouts in, the kernel, the layouts out."""
  B, T, K, H = q_BTKH.shape
  N, J = v_BTNJ.shape[2:]
  U = -(-T // W)
  Tp = U * W
  cdt = v_BTNJ.dtype

  def rows(x):  # [B, T, heads, d] -> [B, Tp, heads d] in cdt (a free reshape when T = Tp)
    x = x.astype(cdt).reshape(B, T, -1)
    return x if Tp == T else jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0)))

  def gates(x):  # [B, T, N] -> [B, N, U, W] float32, zeros past T (no-op positions)
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0)))
    return jnp.transpose(x, (0, 2, 1)).reshape(B, N, U, W)

  seg, carry = _segment_rows(seg_BT, B, T, U, W)
  s0 = jnp.zeros((B, N, H, J), jnp.float32) if s0_BNHJ is None else s0_BNHJ.astype(jnp.float32)
  st = _Static(W=W, G=N // K, hk=hk, inverse=inverse, interpret=interpret)
  o, sf = _rule(st, rows(q_BTKH), rows(k_BTKH), rows(v_BTNJ), gates(g_BTN), gates(beta_BTN), s0, seg, carry)
  return o.reshape(B, Tp, N, J)[:, :T].astype(v_BTNJ.dtype), sf


def gated_delta_rule_pallas(q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, *, segment_ids_BT=None,
                            initial_state_BNHJ=None, chunk_size=64, heads_per_step=HEADS_PER_STEP, inverse="split",
                            interpret=None):
  """The gated delta rule by the Pallas kernels: gated_delta_rule_chunked's contract and return (o [B, T, N, J] in
  v's dtype, final state [B, N, H, J] float32), differentiable in q, k, v, g, beta and the initial state. The
  products run in v's dtype (q and k are cast to it). heads_per_step: value heads per grid step, at most (`key_tile`);
  inverse: how a bf16 run computes the chunk's inverse (INVERSES: model.parts.gdn.inverse); interpret: Pallas
  interpret mode (default: off TPU)."""
  check_chunk_size(chunk_size)
  if inverse not in INVERSES:
    raise ValueError(f"gated_delta_rule_pallas: inverse={inverse!r}, expected one of {INVERSES}")
  on_tpu = platform() == "tpu"
  interpret = (not on_tpu) if interpret is None else interpret
  B, T, K, H = q_BTKH.shape
  N, J = v_BTNJ.shape[2:]
  if N % K:
    raise ValueError(f"gated_delta_rule_pallas: {N} value heads do not group over {K} key heads")
  hk = key_tile(K, N // K, H, J, heads_per_step, lanes=not interpret)
  if not interpret and not fits(K, N, H, J, chunk_size):
    raise ValueError(f"gated_delta_rule_pallas: the TPU kernel needs key/value head dims whose tiles are multiples "
                     f"of {LANES} lanes and a chunk that is a multiple of 16 (K={K} H={H}, N={N} J={J}, chunk "
                     f"{chunk_size})")
  body = functools.partial(_local, W=chunk_size, hk=hk, inverse=inverse, interpret=interpret)
  args = (q_BTKH, k_BTKH, v_BTNJ, g_BTN, beta_BTN, segment_ids_BT, initial_state_BNHJ)
  with jax.named_scope("gdn_pallas"):
    mesh = current_mesh()
    if mesh.empty or math.prod(mesh.axis_sizes) == 1:
      return body(*args)
    return _sharded(body, mesh, args)


def _sharded(body, mesh, args):
  """body in a shard_map over `mesh`: each device runs its own rows (split as the batch's logical axis), every
  head and position whole. None arguments (no segment ids, no initial state) stay out of it."""
  B = args[0].shape[0]
  rows = P(logical_spec(("batch",), (B,), mesh)[0])
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*xs):
    full = [None] * len(args)
    for i, x in zip(present, xs):
      full[i] = x
    return body(*full)

  fn = jax.shard_map(local, mesh=mesh, in_specs=(rows,) * len(present), out_specs=(rows, rows), check_vma=False)
  return fn(*[args[i] for i in present])
