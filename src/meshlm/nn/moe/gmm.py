"""The grouped matmul: ys[j] = xs[j] @ w[e_j] over rows sorted by expert, in three implementations.

- "loop" (`_gmm_loop`): a scan over the experts; each reads its kernels once and runs its rows straight
  from the sorted buffer in blocks of `big` rows, then one block for the remainder, the smallest power-of-two
  multiple of `small` that holds it (loop_block_rows, a lax.switch), which writes only its expert's rows. The
  backward runs dx and dW in two independent scans over the same blocks. In unrolled layers the kernels come
  as StackRow (nn/stack_row.py) and each expert's is read straight from the layer stack.
- "blocks": the sorted rows are laid out per expert in row blocks of `block_rows` (each block holds
  one expert's rows, padded with zeros), and a scan runs one [b, D] x [D, F] matmul per used block.
- "ragged": `jax.lax.ragged_dot` (XLA's grouped kernel on GPU and TPU; on XLA:CPU a dense masked matmul per group).
- "megablox": JAX's megablox grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`, MaxText's TPU default), a
  Pallas TPU kernel in (tm, tk, tn) tiles (megablox_tiling: the section's knob, or the auto rule over the shapes and the
  chip's scoped VMEM), its backward the same kernel on the transposed kernel and its `tgmm`; Pallas interpret mode off
  TPU (slow: tests only).
"auto" picks "loop" on CPU, "megablox" on TPU (measured faster than ragged there: benchmarks/gmm_tpu.py, docs/moe.md)
and "ragged" elsewhere, by the platform the program is for (parallel/sharding.platform). Measured with
benchmarks/moe_vs_dense.py (docs/performance.md and docs/performance-log.md, issues 11 and 19).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import math

import jax
import jax.numpy as jnp

from meshlm.nn.stack_row import StackRow, array_of, is_row, materialize
from meshlm.parallel.sharding import current_mesh, platform

GROUPED_MATMULS = ("auto", "blocks", "loop", "megablox", "ragged")


def default_grouped_matmul() -> str:
  """The platform the program is traced for decides (its mesh's devices: a TPU topology's under meshlm compile on a
  CPU host builds megablox, as the TPU run does), not the host's default backend."""
  return {"cpu": "loop", "tpu": "megablox"}.get(platform(), "ragged")


def default_block_rows(rows: int, num_experts: int) -> int:
  """Rows per block: the power of two at or below rows / E (the mean group), in [16, 256]. Padding
  is at most E * (b - 1) rows, about rows / 2 on average; measured best of 32..256 at 4096 rows with
  8 and 64 groups (docs/performance-log.md, 2026-11-30)."""
  target = max(rows // num_experts, 1)
  return int(min(256, max(16, 2 ** int(math.floor(math.log2(target))))))


def grouped_matmul(xs_AD: jax.Array, w_EDF, sizes_E: jax.Array, *, impl: str = "auto",
                   block_rows: int | None = None, tiling: tuple[int, int, int] | None = None,
                   rest: bool = False) -> jax.Array:
  """ys[j] = xs[j] @ w[e_j] where rows are sorted by expert and sizes_E counts each expert's rows; rows past the
  groups come out zero.

  w_EDF may be a tuple of kernels [E, D, F_i]: one grouped matmul against their concatenation along
  F (the fused gate|up), [A, sum F_i]. "ragged" and "megablox" concatenate them; "blocks" runs each block's rows
  against each kernel in the same pass and concatenates the [b, F_i] outputs, with no kernel copy.
  tiling: megablox's (tm, tk, tn), None for its auto rule (megablox_tiling). rest: rows past the groups may exist
  (expert parallelism's rows of other experts): megablox, which leaves those rows unwritten, zeroes them (a pass over
  its output and its input gradient that the other implementations do not need).
  """
  ws = tuple(w_EDF) if isinstance(w_EDF, (tuple, list)) else (w_EDF,)
  impl = default_grouped_matmul() if impl == "auto" else impl
  if impl != "loop":
    ws = tuple(materialize(w) for w in ws)
  if impl == "ragged":
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=-1)
    return jax.lax.ragged_dot(xs_AD, w, sizes_E.astype(jnp.int32))
  if impl == "megablox":
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=-1)
    return _gmm_megablox(xs_AD, vary_like(w, xs_AD), sizes_E, tiling, rest)
  if impl == "blocks":
    b = block_rows or default_block_rows(xs_AD.shape[0], ws[0].shape[0])
    return _gmm_blocks(xs_AD, ws, sizes_E, b)
  if impl == "loop":
    big, small = loop_block_rows(xs_AD.shape[0], ws[0].shape[0])
    if block_rows:
      big, small = block_rows, max(1, block_rows // 4)
    x = vary_like(xs_AD, array_of(ws[0]))
    return _loop_matmul(x, tuple(_vary_row(w, x) for w in ws), sizes_E, big, small)
  raise ValueError(f"grouped_matmul={impl!r}: expected one of {GROUPED_MATMULS}")


# --- "megablox": JAX's Pallas TPU grouped matmul -------------------------------------------------------------------

# (tm, tk, tn) the auto rule starts from: the fastest measured on a v5e at moe12's gate|up (32,768 rows, 1024 -> 3072,
# 8 experts, fwd+bwd 4.49 ms against ragged_dot's 5.56; docs/moe.md, benchmarks/gmm_tpu.py), then clamped to the
# problem and halved until the tiles fit the chip's scoped VMEM.
MEGABLOX_TILING = (512, 1024, 1024)
# Mosaic's default scoped VMEM limit per chip generation (device_kind prefix), which megablox's kernels run under; the
# rule fills VMEM_SHARE of it (the kernels' own temporaries take the rest: (1024, 1024, 1024) ran out on a v5e).
SCOPED_VMEM = {"TPU v6": 32 << 20, "TPU7": 32 << 20}
SCOPED_VMEM_DEFAULT = 16 << 20  # v4, v5e ("TPU v5 lite"), v5p
VMEM_SHARE = 0.75


def _megablox():
  # The kernels' module (the package's `gmm` attribute is the custom-VJP function that shadows it).
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


class _TypedShapes:
  """The jax module as megablox's kernels see it while one call is traced inside shard_map: the same, except that the
  output shapes they build (jax.ShapeDtypeStruct) carry the rows' varying mesh axes. Pallas refuses an output type
  without them under shard_map's check_vma (megablox predates it; MaxText turns the check off), and the check is
  what keeps the dispatch's gradients right (the kernels' cross-shard sum, the tokens shared over an expert group)."""

  def __init__(self, real, manual_axis_type):
    self._real, self._mat = real, manual_axis_type

  def __getattr__(self, name):
    return getattr(self._real, name)

  def ShapeDtypeStruct(self, *args, **kwargs):  # noqa: N802 (jax's name)
    return self._real.ShapeDtypeStruct(*args, manual_axis_type=self._mat, **kwargs)


@contextlib.contextmanager
def _kernels_typed_like(like):
  """megablox's module, its outputs typed as `like` varies (_TypedShapes; varying over no axis where the shard_map's
  axes are all of size 1), while the call is traced."""
  mb = _megablox()
  mat = getattr(jax.typeof(like), "manual_axis_type", None)
  if mat is None:
    yield mb
    return
  real = mb.jax
  mb.jax = _TypedShapes(real, mat)
  try:
    yield mb
  finally:
    mb.jax = real


def scoped_vmem(device_kind: str | None = None) -> int:
  """The scoped VMEM (bytes) a Pallas kernel runs under on the program's chip (its mesh's devices, or device_kind)."""
  if device_kind is None:
    device = getattr(current_mesh(), "abstract_device", None)
    device_kind = getattr(device, "device_kind", None) or jax.devices()[0].device_kind
  return next((v for k, v in SCOPED_VMEM.items() if device_kind.startswith(k)), SCOPED_VMEM_DEFAULT)


def megablox_vmem(t: tuple[int, int, int], in_bytes: int, out_bytes: int) -> int:
  """VMEM bytes of one megablox call at tiles t = (tm, tk, tn): its double-buffered input and output blocks and its
  float32 accumulator, the larger of gmm's ([tm, tk] x [tk, tn] -> [tm, tn]) and tgmm's ([tm, tk]^T x [tm, tn] ->
  [tk, tn]). With VMEM_SHARE of a v5e's 16 MiB it admits the tilings that compiled there, (512, 1024, 1024) and
  (1024, 512, 1024), and refuses (1024, 1024, 1024), which ran out of VMEM (tests/test_megablox.py compiles both)."""
  tm, tk, tn = t
  gmm = 2 * (tm * tk + tk * tn) * in_bytes + 2 * tm * tn * out_bytes + 4 * tm * tn
  tgmm = 2 * (tm * tk + tm * tn) * in_bytes + 2 * tk * tn * out_bytes + 4 * tk * tn
  return max(gmm, tgmm)


def _fit_dim(pref: int, dim: int) -> int:
  """A tile for a dim: the whole dim when it is at most pref, else as few tiles as pref allows, each the least
  multiple of 128 that covers the dim in that many (1536 in two 768s, not a 1024 and a half-empty one; 2816 in three
  of 1024, not eleven of 256)."""
  if dim <= pref:
    return dim
  per_tile = -(-dim // -(-dim // pref))  # dim over the fewest tiles of at most pref
  return min(pref, -(-per_tile // 128) * 128)


def megablox_tiling(m: int, k: int, n: int, in_bytes: int = 2, out_bytes: int = 2, budget: int | None = None,
                    start: tuple[int, int, int] = MEGABLOX_TILING) -> tuple[int, int, int]:
  """(tm, tk, tn) for an [m, k] x [E, k, n] grouped matmul: `start` clamped to the problem (tm at most m rounded up
  to 8 sublanes, tk and tn the whole dim or a divisor of it), then the largest of tn, tk, tm halved (tk, tn not
  below 128, tm not below 8) until megablox_vmem fits the budget (VMEM_SHARE of the chip's scoped VMEM)."""
  budget = int(VMEM_SHARE * scoped_vmem()) if budget is None else budget
  tm = min(start[0], -(-m // 8) * 8)
  tk, tn = _fit_dim(start[1], k), _fit_dim(start[2], n)
  while megablox_vmem((tm, tk, tn), in_bytes, out_bytes) > budget:
    if tn >= max(tk, tm) and tn > 128:
      tn = _fit_dim(tn // 2, n)
    elif tk >= tm and tk > 128:
      tk = _fit_dim(tk // 2, k)
    elif tm > 8:
      tm //= 2
    else:
      break
  return tm, tk, tn


def _tilings(A: int, K: int, N: int, dtype, tiling):
  """The three calls' tiles: the forward gmm ([A, K] x [K, N]), the input gradient's gmm ([A, N] x [N, K]) and the
  weight gradient's tgmm (over A, K, N): the given tiling clamped to each, or the auto rule's."""
  b = jnp.dtype(dtype).itemsize
  if tiling is None:
    return megablox_tiling(A, K, N, b, b), megablox_tiling(A, N, K, b, b), megablox_tiling(A, K, N, b, b)
  tm, tk, tn = tiling
  tm = min(tm, -(-A // 8) * 8)
  return (tm, min(tk, K), min(tn, N)), (tm, min(tk, N), min(tn, K)), (tm, min(tk, K), min(tn, N))


def _gmm_megablox(xs_AD, w_EKN, sizes_E, tiling, rest: bool):
  """megablox's gmm of the sorted rows, its rows padded to a whole number of tm tiles (the pad sliced off); with rest,
  a last group of the rows past the kernels' groups, which megablox zeroes (fewer kernels than groups)."""
  A, K = xs_AD.shape
  N = w_EKN.shape[-1]
  tilings = _tilings(A, K, N, xs_AD.dtype, tiling)
  tm = max(t[0] for t in tilings)
  pad = -A % tm
  x = jnp.concatenate([xs_AD, _zeros((pad, K), xs_AD)]) if pad else xs_AD
  sizes = sizes_E.astype(jnp.int32)
  if rest:
    sizes = jnp.concatenate([sizes, (A + pad - jnp.sum(sizes))[None]])
  y = _megablox_matmul(x, w_EKN, sizes, tilings, platform() != "tpu")
  return y[:A] if pad else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _megablox_matmul(x_AK, w_EKN, sizes, tilings, interpret: bool):
  with _kernels_typed_like(x_AK) as mb:
    return mb.gmm(x_AK, w_EKN, sizes, x_AK.dtype, tilings[0], interpret=interpret)


def _megablox_matmul_fwd(x_AK, w_EKN, sizes, tilings, interpret):
  return _megablox_matmul(x_AK, w_EKN, sizes, tilings, interpret), (x_AK, w_EKN, sizes)


def _megablox_matmul_bwd(tilings, interpret, res, dy_AN):
  """dx = dy @ w^T (gmm reading the kernel transposed, no copy of it); dw = x^T dy per group (tgmm), for the kernels'
  groups only (a rest group has no kernel)."""
  x_AK, w_EKN, sizes = res
  with _kernels_typed_like(dy_AN) as mb:
    dx = mb.gmm(dy_AN, w_EKN, sizes, x_AK.dtype, tilings[1], transpose_rhs=True, interpret=interpret)
    dw = mb.tgmm(x_AK.swapaxes(0, 1), dy_AN, sizes, w_EKN.dtype, tilings[2], num_actual_groups=w_EKN.shape[0],
                 interpret=interpret)
  return dx, dw, None


_megablox_matmul.defvjp(_megablox_matmul_fwd, _megablox_matmul_bwd)


def block_layout(sizes_E: jax.Array, rows: int, b: int):
  """Where the expert-sorted rows go in the per-expert block layout.

  Returns (src [P] row of the sorted buffer for each padded row, `rows` for padding; dst [rows] padded
  row of each sorted row; block_expert [nb]; live [nb], the blocks that hold rows), P = nb * b with
  nb = (rows + E * (b - 1)) // b, the most blocks any split of `rows` over E experts can need.
  """
  E = sizes_E.shape[0]
  nb = (rows + E * (b - 1)) // b
  sizes = sizes_E.astype(jnp.int32)
  nblk = (sizes + b - 1) // b  # [E]
  blk_end = jnp.cumsum(nblk)
  pad_start = (blk_end - nblk) * b  # [E] first padded row of each expert
  row_start = jnp.cumsum(sizes) - sizes  # [E] first sorted row of each expert
  block_expert = jnp.minimum(jnp.searchsorted(blk_end, jnp.arange(nb, dtype=jnp.int32), side="right",
                                              method="compare_all"), E - 1).astype(jnp.int32)
  live = jnp.arange(nb) < blk_end[-1]
  r = jnp.arange(nb * b, dtype=jnp.int32)
  e_r = block_expert[r // b]
  off = r - pad_start[e_r]
  src = jnp.where(live[r // b] & (off < sizes[e_r]), row_start[e_r] + off, rows)
  j = jnp.arange(rows, dtype=jnp.int32)
  e_j = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), j, side="right", method="compare_all"), E - 1)
  dst = pad_start[e_j] + j - row_start[e_j]
  return src, dst, block_expert, live


def _gmm_blocks(xs_AD, ws, sizes_E, b):
  A, D = xs_AD.shape
  src, dst, block_expert, live = block_layout(sizes_E, A, b)
  nb = block_expert.shape[0]
  xp = jnp.take(xs_AD, src, axis=0, mode="fill", fill_value=0).reshape(nb, b, D)
  # Inside shard_map the kernel is invariant and the rows vary: make the kernel varying here, so the
  # custom backward's dW may vary too and autodiff of this cast does the cross-shard sum.
  yp = _blocks_matmul(xp, tuple(vary_like(w, xp) for w in ws), block_expert, live)  # [nb, b, F]
  return yp.reshape(nb * b, -1)[dst]


# --- shard_map varying types and kernel reads -------------------------------------------------------

def _varying(a):
  mat = getattr(jax.typeof(a), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def vary_like(a, like):
  """a, marked as varying over the shard_map axes `like` varies over (a no-op outside shard_map)."""
  axes = tuple(sorted(_varying(like) - _varying(a)))
  return jax.lax.pcast(a, axes, to="varying") if axes else a


def _vary_row(w, like):
  """vary_like for a kernel or a StackRow (its stack marked)."""
  return StackRow(vary_like(w.stack, like), w.index) if is_row(w) else vary_like(w, like)


def _expert_kernel(w, e):
  """Expert e's kernel of w [E, ...]: read from the stack for a StackRow (no copy of the layer's row)."""
  return w.at(e) if is_row(w) else jax.lax.dynamic_index_in_dim(w, e, axis=0, keepdims=False)


def _zeros(shape, like, dtype=None):
  """Zeros that vary over the same shard_map axes as `like` (cond branches and scan carries must agree)."""
  return vary_like(jnp.zeros(shape, dtype or like.dtype), like)


def _cat(parts):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


# --- "blocks": one matmul per row block ------------------------------------------------------------

@jax.custom_vjp
def _blocks_matmul(xp_NbD, ws, block_expert, live):
  """yp[i] = xp[i] @ [w_0 | w_1 ...][block_expert[i]] for the live blocks, zeros for the rest:
  [nb, b, sum F_i]."""
  F = sum(w.shape[-1] for w in ws)

  def body(_, blk):
    x, e, on = blk
    y = jax.lax.cond(on, lambda: _cat([x @ w[e] for w in ws]), lambda: _zeros((x.shape[0], F), x))
    return None, y

  return jax.lax.scan(body, None, (xp_NbD, block_expert, live))[1]


def _blocks_matmul_fwd(xp, ws, block_expert, live):
  return _blocks_matmul(xp, ws, block_expert, live), (xp, ws, block_expert, live)


def _blocks_matmul_bwd(res, dy_NbF):
  xp, ws, block_expert, live = res
  D = xp.shape[-1]
  cuts = list(itertools.accumulate(w.shape[-1] for w in ws))[:-1]

  # dx[i] = dy[i] @ w[e]^T; dw[e] += xp[i]^T @ dy[i], accumulated in place (blocks of one expert are
  # consecutive). Autodiff of the forward would add a full [E, D, F] zero-padded slice per block.
  # The cond holds only the block's matmuls: with the [E, D, F] carry as its operand it would copy it.
  def body(dws, blk):
    x, dy, e, on = blk

    def live_block():
      dys = jnp.split(dy, cuts, axis=-1)
      dx = sum(d @ w[e].T for d, w in zip(dys, ws))
      return dx, tuple(x.T @ d for d in dys)

    dead = lambda: (_zeros((x.shape[0], D), x), tuple(_zeros(w.shape[1:], x, w.dtype) for w in ws))  # noqa: E731
    dx, dw_e = jax.lax.cond(on, live_block, dead)
    dws = tuple(jax.lax.dynamic_update_index_in_dim(dw, dw[e] + d, e, 0) for dw, d in zip(dws, dw_e))
    return dws, dx

  zeros = tuple(_zeros(w.shape, xp, w.dtype) for w in ws)
  dws, dx = jax.lax.scan(body, zeros, (xp, dy_NbF, block_expert, live))
  return dx, dws, None, None


_blocks_matmul.defvjp(_blocks_matmul_fwd, _blocks_matmul_bwd)


# --- "loop": the expert loop --------------------------------------------------------------------------

def loop_block_rows(rows: int, num_experts: int) -> tuple[int, int]:
  """(big, small) row blocks of the expert loop: big is the power of two at or below the mean group
  rows / E in [16, 256]; small = max(8, big / 8) is the least remainder block (rest_block_sizes: small,
  2 small, ... big), so a group's remainder r is one block of at most max(small, 2 r - 1) rows."""
  big = default_block_rows(rows, num_experts)
  return big, max(8, big // 8)


def _expert_rows(sizes_E):
  sizes = sizes_E.astype(jnp.int32)
  return jnp.cumsum(sizes) - sizes, sizes  # first sorted row of each expert, its rows


def rest_block_sizes(big: int, small: int) -> tuple[int, ...]:
  """The sizes a group's remainder block may take: small, 2 small, ... up to big."""
  sizes = [small]
  while sizes[-1] < big:
    sizes.append(min(2 * sizes[-1], big))
  return tuple(sizes)


def _loop_over_blocks(n_big, n_rest, start, big, small, body, carry):
  """carry = body(carry, row0, b, end, whole) over one expert's rows [start, end): blocks of `big` rows,
  each wholly the expert's (whole=True), then one block for the n_rest < big left over, the smallest of
  rest_block_sizes(big, small) that holds them (a lax.switch: one dot of at most 2 n_rest rows rather
  than n_rest / small dots of `small` rows; measured in docs/performance-log.md), which may run past `end`."""
  end = start + n_big * big + n_rest
  carry = jax.lax.fori_loop(0, n_big, lambda i, c: body(c, start + i * big, big, end, True), carry)
  r0 = start + n_big * big
  sizes = rest_block_sizes(big, small)
  branches = [lambda c: c] + [functools.partial(lambda c, b: body(c, r0, b, end, False), b=b) for b in sizes]
  pick = (n_rest > 0).astype(jnp.int32) + sum((n_rest > b).astype(jnp.int32) for b in sizes[:-1])
  return jax.lax.switch(pick, branches, carry)


def _block_at(r0, b, end, rows: int):
  """The b-row block meant to start at r0, moved back to fit in `rows` rows: (its first row, own [b, 1], the
  rows of it in [r0, end): the block's own; the others belong to the experts before or after)."""
  first = jnp.minimum(r0, rows - b)
  at = first + jnp.arange(b)
  return first, ((at >= r0) & (at < end))[:, None]


def _write(buf, block, r0, b, end, whole: bool, col: int = 0):
  """buf with rows [r0, r0 + b) of columns [col, col + width) set to `block` [b, width], only the rows in
  [r0, end) unless the block is the expert's whole (a big block)."""
  col = jnp.int32(col)
  if whole:
    return jax.lax.dynamic_update_slice(buf, block, (r0, col))
  first, own = _block_at(r0, b, end, buf.shape[0])
  old = jax.lax.dynamic_slice(buf, (first, col), block.shape)
  return jax.lax.dynamic_update_slice(buf, jnp.where(own, block, old), (first, col))


def _read(buf, r0, b, end, whole: bool, cols: tuple[int, int] | None = None):
  """Rows [r0, r0 + b) of buf (moved back to fit unless whole), columns [cols[0], cols[1]) or all."""
  c0, c1 = cols or (0, buf.shape[1])
  first = r0 if whole else _block_at(r0, b, end, buf.shape[0])[0]
  return jax.lax.dynamic_slice(buf, (first, jnp.int32(c0)), (b, c1 - c0))


def _column_spans(ws) -> list[tuple[int, int]]:
  """Each kernel's columns [start, end) of the grouped matmul's output (the kernels side by side along F)."""
  edges = [0, *itertools.accumulate(w.shape[-1] for w in ws)]
  return list(zip(edges[:-1], edges[1:]))


def _fit(a, rows: int):
  """a with zero rows appended up to `rows` (tiny calls, e.g. a decode step, with fewer rows than a block)."""
  return a if a.shape[0] >= rows else jnp.concatenate([a, _zeros((rows - a.shape[0], a.shape[1]), a)], axis=0)


def _gmm_loop(xs_AD, ws, sizes_E, big, small):
  """ys[j] = xs[j] @ [w_0 | w_1 ...][e_j]: a scan over the experts, each reading its kernels once (from the
  layer stack for a StackRow) and running its rows straight from the sorted buffer, in blocks of `big` rows,
  then one remainder block (_loop_over_blocks). A remainder block near the buffer's end is moved back to
  fit, and it writes only its expert's rows, so every row is written by its own expert alone; rows no
  expert owns (past sum(sizes): expert parallelism's non-local slots) stay zero."""
  A, D = xs_AD.shape
  F = sum(w.shape[-1] for w in ws)
  cols = [c0 for c0, _ in _column_spans(ws)]
  starts, sizes = _expert_rows(sizes_E)
  x = _fit(xs_AD, big)
  R = x.shape[0]

  def expert(y, e):
    n = sizes[e]
    w_e = [_expert_kernel(w, e) for w in ws]

    def body(y, r0, b, end, whole):
      xb = _read(x, r0, b, end, whole)
      for w, c in zip(w_e, cols):  # each kernel's output straight into its columns (no concatenate)
        y = _write(y, xb @ w, r0, b, end, whole, c)
      return y

    return _loop_over_blocks(n // big, n % big, starts[e], big, small, body, y), None

  y, _ = jax.lax.scan(expert, _zeros((R, F), xs_AD), jnp.arange(ws[0].shape[0], dtype=jnp.int32))
  return y if R == A else y[:A]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _loop_matmul(xs_AD, ws, sizes_E, big, small):
  return _gmm_loop(xs_AD, tuple(ws), sizes_E, big, small)


def _loop_matmul_fwd(xs_AD, ws, sizes_E, big, small):
  return _gmm_loop(xs_AD, tuple(ws), sizes_E, big, small), (xs_AD, ws, sizes_E)


def _loop_matmul_bwd(big, small, res, dy_AF):
  """Two scans over the experts, independent of each other (XLA:CPU can run them side by side; measured with
  the remainder blocks, docs/performance-log.md "Second pass"). dx of each block (dy @ w_e^T) is written as the forward
  writes y; dW_e sums x^T @ dy over the same blocks (the remainder block's rows outside the expert zeroed
  in dy). A StackRow kernel's cotangent is its stack's, zero outside the row (XLA: a pad, fused with the
  other layers' pads into one pass)."""
  xs_AD, ws, sizes_E = res
  A, D = xs_AD.shape
  spans = _column_spans(ws)  # each kernel's columns of dy
  starts, sizes = _expert_rows(sizes_E)
  x, dy = _fit(xs_AD, big), _fit(dy_AF, big)
  R = x.shape[0]

  experts = jnp.arange(ws[0].shape[0], dtype=jnp.int32)

  def expert_dx(dx, e):
    n, s0 = sizes[e], starts[e]
    # dy @ w^T as one dot contracting w's last dim: with an expert's rows in one or two blocks, XLA:CPU's
    # repacking of the kernel per dot costs less than a transposed copy of it per expert (which it made
    # with the kernel's own layout anyway): 5% of the layer (docs/performance-log.md).
    w_e = tuple(_expert_kernel(w, e) for w in ws)

    def dx_block(dx, r0, b, end, whole):
      dys = [_read(dy, r0, b, end, whole, span) for span in spans]
      dxb = sum(jax.lax.dot_general(d, w, (((1,), (1,)), ((), ()))) for d, w in zip(dys, w_e))
      return _write(dx, dxb, r0, b, end, whole)

    return _loop_over_blocks(n // big, n % big, s0, big, small, dx_block, dx), None

  def expert_dw(_, e):
    n, s0 = sizes[e], starts[e]
    n_big = n // big

    def dw_block(dws, r0, b, end, whole):
      first, own = _block_at(r0, b, end, R)
      xb = jax.lax.dynamic_slice_in_dim(x, first, b, 0)
      dys = [_read(dy, first, b, end, True, span) for span in spans]
      blk = tuple(xb.T @ (d if whole else jnp.where(own, d, jnp.zeros_like(d))) for d in dys)
      return blk if dws is None else tuple(dw + g for dw, g in zip(dws, blk))

    # The first big block starts the sums (no zero fill and add: 8% of the 512-expert layer); an expert with
    # no big block starts from zeros.
    zeros = lambda: tuple(_zeros(w.shape[1:], x, w.dtype) for w in ws)  # noqa: E731
    dws = jax.lax.cond(n_big > 0, lambda: dw_block(None, s0, big, s0 + n, True), zeros)
    skip = (n_big > 0).astype(jnp.int32)
    return None, _loop_over_blocks(n_big - skip, n % big, s0 + skip * big, big, small, dw_block, dws)

  dx, _ = jax.lax.scan(expert_dx, _zeros((R, D), xs_AD), experts)
  _, dws = jax.lax.scan(expert_dw, None, experts)
  cts = tuple(StackRow(jax.lax.dynamic_update_slice_in_dim(_zeros(w.stack.shape, w.stack), dw[None], w.index, 0),
                       w.index) if is_row(w) else dw for w, dw in zip(ws, dws))
  return (dx if R == A else dx[:A]), cts, None


_loop_matmul.defvjp(_loop_matmul_fwd, _loop_matmul_bwd)
