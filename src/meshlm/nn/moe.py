"""The mixture-of-experts feed-forward layer: a float32 router, top-k, dropless dispatch.

Per token the router picks k of E experts; each picked expert runs a GLU MLP on the token and the
k outputs are summed with the routing weights. Dropless dispatch never drops a token:

  route:     logits = x @ router (float32, through the dense primitive) -> softmax -> top-k
  sort:      perm = argsort(expert id of each of the M*k (token, slot) pairs)      # the only sort
  gather:    xs[j] = x[perm[j] // k]                                               # [A, D], A = M*k
  matmuls:   h = xs @ gate_up[e_j] (one grouped matmul), a = act(h_gate) * h_up, ys = a @ down[e_j]
  unsort:    y_flat = ys[inverse(perm)], y[n] = sum_k w[n, k] * y_flat[n, k]

The reference beside it (`moe_reference.py`) runs every expert on every token and masks.

Two speedups from the RL trainer (issue 11), each kept switchable against its plain version:
- `unsort_impl="perm"`: the inverse permutation is a scatter of the sort's own permutation, and the
  unsort's backward is a gather by `perm` (custom VJP) instead of autodiff's scatter-add. The
  plain version ("argsort") argsorts perm again. Bit-identical gradients; one sort in the forward,
  none in the backward (`count_sorts`).
- `fused_gate_up=True`: gate and up are one grouped matmul of width 2F, and `fused_glu`'s backward
  writes both half-gradients in one concatenate instead of autodiff's pad-and-add.

Router replay (`forced_ids_BTk` [B, T, k], -1 = not forced; nn/router_replay.py): forced tokens take
the given expert ids, weighted by the live router probabilities at those ids (so the router keeps its
gradient); top-k runs over at most `replay_rows` gathered tokens that are neither forced nor padding,
with a lax.cond fallback to the full top-k, bit-identical to `replay_impl="full"`. The side outputs
always carry the routed ids ("moe_expert_ids"), which is what a rollout records for replay.

The grouped matmul has three implementations (`grouped_matmul=`, model.moe_grouped_matmul), measured with
benchmarks/moe_vs_dense.py (docs/performance.md and docs/performance-log.md, issues 11 and 19):
- "loop" (`_gmm_loop`): a scan over the experts; each reads its kernels once and runs its rows straight
  from the sorted buffer in blocks of `big` rows, then one block for the remainder, the smallest power-of-two
  multiple of `small` that holds it (loop_block_rows, a lax.switch), which writes only its expert's rows. The
  backward runs dx and dW in two independent scans over the same blocks. In unrolled layers the kernels come
  as StackRow (nn/stack_row.py) and each expert's is read straight from the layer stack.
- "blocks": the sorted rows are laid out per expert in row blocks of `block_rows` (each block holds
  one expert's rows, padded with zeros), and a scan runs one [b, D] x [D, F] matmul per used block.
- "ragged": `jax.lax.ragged_dot` (the GPU/TPU choice, where it lowers to a grouped kernel; on XLA:CPU a
  dense masked matmul per group).
"auto" picks "loop" on CPU and "ragged" elsewhere.

Under a mesh, the dispatch runs inside `shard_map`, the same code under explicit and auto sharding.
Which mesh axes shard the kernels' experts dim is sharding data (model.moe_kernel_fsdp picks the
logical axis names in moe_spec; parallel/sharding.py's RULES map them):
- no mesh axis shards the experts (mesh.expert = 1 with moe_kernel_fsdp embed or mlp): per batch (and
  length) shard; tokens stay on their device, the expert kernels are gathered whole.
- the experts dim is sharded over ep devices, on mesh.expert, mesh.fsdp or both (`ep_mesh_axes`, expert
  parallelism, `_dispatch_ep`): the kernels stay sharded on their experts dim, each device holding E / ep
  experts (with moe_kernel_fsdp embed or mlp FSDP still gathers their other dim). The tokens of the ep
  devices of an expert group are all-gathered over those axes; each device sorts the group's (token,
  slot) pairs with its local experts first (ids outside its range sort last and get no grouped-matmul
  rows: `dispatch(expert_offset=)`), computes its experts' part of every token's weighted sum, and a
  reduce-scatter over the same axes returns each device its own tokens' sums. The kernels' gradients
  stay local to their experts. (Over an axis the batch does not split on, the tokens are already shared
  by the group: no gather, and a psum adds the parts.) All-gather in and reduce-scatter out was chosen
  over all-to-all: dropless routing has no static per-peer row count, so an all-to-all would need
  worst-case buffers of the same size, plus a second sort.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshlm import spec as S
from meshlm.nn import gather_once
from meshlm.nn.dense import dense as dense_primitive
from meshlm.nn.router_replay import REPLAY_ROWS, check_forced_ids, replay_route
from meshlm.nn.stack_row import StackRow, is_row, materialize
from meshlm.parallel.sharding import auto_region, constrain, current_mesh, logical_spec, out_sharding

ROUTER_LOGITS = ("batch", "length", None)
ROUTER_AXES = ("embed", None)
# Values a remat policy should save so that the backward replays no sort: the sort's permutation.
# jax.checkpoint(policy=checkpoint_dots) alone recomputes the argsort in the backward; combine it with
# save_only_these_names(*REMAT_SAVE_NAMES) (save_from_both_policies) to keep it at one sort per layer.
REMAT_SAVE_NAMES = ("moe_perm",)
TOKENS = ("batch", "length", None)
EXPERT_AXIS = "expert"  # the mesh axis that shards the "experts" logical axis (parallel/sharding.RULES)
# The logical names of a kernel's experts dim: "experts" (over mesh.expert) or, with model.moe_kernel_fsdp
# experts or null, "experts_fsdp" (over mesh.expert and mesh.fsdp). The HF adapters' per-expert tensors declare
# these as the axes their {e} indexes (hf/maps.Tensor.inner_axes).
EXPERTS_AXES = ("experts", "experts_fsdp")
KERNEL_FSDP = ("experts", "embed", "mlp")  # model.moe_kernel_fsdp's values (null: "experts", falling back to embed)
GROUPED_MATMULS = ("auto", "blocks", "loop", "ragged")
UNSORTS = ("perm", "argsort")


def experts_axis(m) -> str:
  """The logical name of the expert kernels' experts dim for model.moe_kernel_fsdp (m: the model config)."""
  layout = m.moe_kernel_fsdp
  if layout is not None and layout not in KERNEL_FSDP:
    raise ValueError(f"moe_kernel_fsdp={layout!r}: expected one of {KERNEL_FSDP} or None")
  return "experts_fsdp" if layout in (None, "experts") else "experts"


def moe_spec(m) -> dict:
  """Parameters of one MoE layer: router [D, E], gate/up [E, D, F], down [E, F, D].

  model.moe_kernel_fsdp picks what mesh.fsdp shards in the kernels, as logical axis names: "experts" (or
  null) the experts dim ("experts_fsdp"; where mesh.expert x mesh.fsdp does not divide E, fsdp drops off it
  and shards the embed dim, as "embed"), "embed" the embed dim, "mlp" gate/up's embed and down's mlp dim.
  """
  D, E, F = m.embed_dim, m.num_experts, m.moe_mlp_dim
  e = experts_axis(m)
  return {
      "router": S.kernel((D, E), ROUTER_AXES),
      "gate": S.kernel((E, D, F), (e, "embed", "mlp"), n_in=2),
      "up": S.kernel((E, D, F), (e, "embed", "mlp"), n_in=2),
      "down": S.kernel((E, F, D), (e, "mlp_fsdp" if m.moe_kernel_fsdp == "mlp" else "mlp", "embed"), n_in=2),
  }


# --- routing ---------------------------------------------------------------------------------------

def route(logits_BTE: jax.Array, k: int, norm_topk: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(probs [B, T, E] float32, top-k weights [B, T, k] float32, top-k expert ids [B, T, k] int32)."""
  probs = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
  weights, ids = jax.lax.top_k(probs, k)
  if norm_topk:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return probs, weights, ids.astype(jnp.int32)


ROUTER_SCORINGS = ("softmax", "sigmoid")
# What an expert of a dropped group scores in group-limited routing's final top-k (model.router_group_mask):
# "zero" (0.0, DeepSeek's published modeling_deepseek.py; a dropped expert then beats a kept one whose
# biased score is negative) or "-inf" (transformers 5's DeepseekV3TopkRouter: only kept groups' experts).
GROUP_MASKS = {"zero": 0.0, "-inf": -math.inf}
NORM_EPS = 1e-20  # sigmoid routing's top-k renormalization: w / (sum + NORM_EPS), as DeepSeek-V3 does


def group_limited_topk(scores_ME: jax.Array, bias_E: jax.Array, k: int, *, n_group: int, topk_group: int,
                       dropped: float = 0.0) -> jax.Array:
  """DeepSeek-V3's selection: top-k expert ids [..., k] int32 of scores + bias (float32), limited to groups.

  The E experts form n_group consecutive groups; each group scores the sum of its top 2 biased scores;
  the topk_group best groups are kept and every expert of the others scores `dropped` (0.0 or -inf);
  then the top k of all E. Ties go to the lower index (jax.lax.top_k), in both top-k's.
  """
  biased = scores_ME.astype(jnp.float32) + bias_E.astype(jnp.float32)  # [..., E]
  if n_group == 1:
    return jax.lax.top_k(biased, k)[1].astype(jnp.int32)
  *lead, E = biased.shape
  grouped = biased.reshape(*lead, n_group, E // n_group)  # [..., G, E / G]
  group_score = jnp.sum(jax.lax.top_k(grouped, min(2, E // n_group))[0], axis=-1)  # [..., G]
  _, kept = jax.lax.top_k(group_score, topk_group)  # [..., topk_group]
  keep = jnp.any(kept[..., :, None] == jnp.arange(n_group), axis=-2)  # [..., G]
  choice = jnp.where(keep[..., None], grouped, jnp.float32(dropped)).reshape(*lead, E)
  return jax.lax.top_k(choice, k)[1].astype(jnp.int32)


def sigmoid_weights(w_Mk: jax.Array, norm_topk: bool, scaling: float) -> jax.Array:
  """The routing weights from the unbiased sigmoid scores at the chosen ids: renormalized by
  (sum + 1e-20) with norm_topk, times routed_scaling_factor."""
  if norm_topk:
    w_Mk = w_Mk / (jnp.sum(w_Mk, axis=-1, keepdims=True) + NORM_EPS)
  return w_Mk * jnp.float32(scaling)


def group_route(logits_BTE: jax.Array, bias_E: jax.Array, k: int, *, n_group: int, topk_group: int,
                norm_topk: bool, scaling: float = 1.0, dropped: float = 0.0
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Group-limited sigmoid routing (DeepSeek-V3): (scores s = sigmoid(logits) [B, T, E] float32, weights
  [B, T, k] float32, ids [B, T, k] int32). The bias (float32) picks experts and never weights them: the
  weights are s at the chosen ids (sigmoid_weights)."""
  s = jax.nn.sigmoid(logits_BTE.astype(jnp.float32))
  ids = group_limited_topk(jax.lax.stop_gradient(s), bias_E, k, n_group=n_group, topk_group=topk_group,
                           dropped=dropped)
  return s, sigmoid_weights(jnp.take_along_axis(s, ids, axis=-1), norm_topk, scaling), ids


def expert_load(ids_BTk: jax.Array, num_experts: int, token_mask_BT: jax.Array | None = None) -> jax.Array:
  """Routed (token, slot) pairs per expert [E] float32, padding (token_mask 0) excluded: the counts
  the aux-loss-free bias update balances."""
  onehot = jax.nn.one_hot(ids_BTk, num_experts, dtype=jnp.float32)  # [B, T, k, E]
  if token_mask_BT is not None:
    onehot = onehot * (token_mask_BT > 0).astype(jnp.float32)[:, :, None, None]
  return jnp.sum(onehot, axis=(0, 1, 2))  # integers, exact in float32 below 2^24 pairs


def bias_update(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
  """The aux-loss-free balancing rule (DeepSeek-V3): bias += rate * sign(mean load - load), per layer
  [L, E]; rate 0 returns the bias itself (bit-unchanged)."""
  if rate == 0:
    return bias_LE
  load = load_LE.astype(jnp.float32)
  step = jnp.float32(rate) * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
  return (bias_LE.astype(jnp.float32) + step).astype(bias_LE.dtype)


def aux_stats(logits_BTE: jax.Array, probs_BTE: jax.Array, ids_BTk: jax.Array, num_experts: int,
              token_mask_BT: jax.Array | None = None) -> dict:
  """Per-layer router statistics and losses, float32.

  moe_expert_fraction [E]: top-k assignments per expert / tokens (sums to k over the experts);
  moe_expert_prob [E]: mean router probability per expert;
  moe_load_balance_loss: E * sum_e fraction_e * prob_e, transformers' `load_balancing_loss_func`
    for this one layer (padding excluded when token_mask is given, as its attention_mask does);
  moe_z_loss: mean over tokens of logsumexp(logits)^2 (ST-MoE's router z-loss).
  Over several layers transformers averages fraction and prob over the layers before the product:
  `load_balancing_loss(side)` does that from the stacked side outputs.
  """
  E = num_experts
  mask = jnp.ones(ids_BTk.shape[:2], jnp.float32) if token_mask_BT is None else token_mask_BT.astype(jnp.float32)
  rows = jnp.maximum(jnp.sum(mask), 1.0)
  onehot = jax.nn.one_hot(ids_BTk, E, dtype=jnp.float32)  # [B, T, k, E]
  # A mask sharded like the tokens makes both einsum operands batch-sharded: under explicit sharding
  # the output's sharding must then be named (replicated [E]).
  out = {} if token_mask_BT is None else {"out_sharding": out_sharding((None,), (E,))}
  fraction = jnp.einsum("btke,bt->e", onehot, mask, **out) / rows
  prob = jnp.einsum("bte,bt->e", probs_BTE.astype(jnp.float32), mask, **out) / rows
  z = jax.nn.logsumexp(logits_BTE.astype(jnp.float32), axis=-1)
  return {
      "moe_load_balance_loss": E * jnp.sum(fraction * prob),
      "moe_z_loss": jnp.sum(z * z * mask) / rows,
      "moe_expert_fraction": fraction,
      "moe_expert_prob": prob,
  }


def load_balancing_loss(side: dict) -> jax.Array:
  """transformers' load_balancing_loss_func over all MoE layers, from side outputs stacked [L, E]:
  E * sum_e mean_L(fraction) * mean_L(prob). (Not the mean of the per-layer losses.)"""
  frac, prob = side["moe_expert_fraction"], side["moe_expert_prob"]
  return frac.shape[-1] * jnp.sum(jnp.mean(frac, axis=0) * jnp.mean(prob, axis=0))


# --- the speedups: unsort with the sort's permutation, fused GLU -----------------------------------

def inverse_permutation(perm: jax.Array) -> jax.Array:
  """inv with inv[perm[j]] = j, by one scatter (no sort)."""
  n = perm.shape[0]
  return jnp.zeros((n,), perm.dtype).at[perm].set(jnp.arange(n, dtype=perm.dtype), unique_indices=True)


@jax.custom_vjp
def unsort(ys_AD: jax.Array, perm: jax.Array, inv: jax.Array) -> jax.Array:
  """ys[inv]: rows back from expert order to (token, slot) order. The backward gathers by perm."""
  return ys_AD[inv]


def _unsort_fwd(ys_AD, perm, inv):
  return ys_AD[inv], perm


def _unsort_bwd(perm, dy_AD):
  # Autodiff of ys[inv] scatter-adds dy into zeros at inv; each row lands once, so that is the gather
  # dy[perm], except that 0 + (-0) = +0: where() keeps that, so the result is bit-identical.
  d = dy_AD[perm]
  return jnp.where(d == 0, jnp.zeros_like(d), d), None, None


unsort.defvjp(_unsort_fwd, _unsort_bwd)


def _glu(act, g, u):
  return act(g) * u


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_glu(act: Callable, h_A2F: jax.Array) -> jax.Array:
  """act(gate) * up for h = [gate | up] (the fused gate|up matmul's output), [A, 2F] -> [A, F]."""
  F = h_A2F.shape[-1] // 2
  g = checkpoint_name(h_A2F[..., :F], "moe_gate")
  u = checkpoint_name(h_A2F[..., F:], "moe_up")
  return _glu(act, g, u)


def _fused_glu_fwd(act, h_A2F):
  F = h_A2F.shape[-1] // 2
  g = checkpoint_name(h_A2F[..., :F], "moe_gate")
  u = checkpoint_name(h_A2F[..., F:], "moe_up")
  return _glu(act, g, u), (g, u)


def _fused_glu_bwd(act, res, d_AF):
  g, u = res
  _, vjp = jax.vjp(functools.partial(_glu, act), g, u)
  dg, du = vjp(d_AF)
  # Autodiff of the split pads each half-gradient with zeros and adds them: -0 becomes +0 there.
  fix = lambda a: jnp.where(a == 0, jnp.zeros_like(a), a)  # noqa: E731
  return (jnp.concatenate([fix(dg), fix(du)], axis=-1),)


fused_glu.defvjp(_fused_glu_fwd, _fused_glu_bwd)


def split_glu(act: Callable, h_A2F: jax.Array) -> jax.Array:
  """The plain version of fused_glu: slice and let autodiff transpose the slices."""
  F = h_A2F.shape[-1] // 2
  return _glu(act, checkpoint_name(h_A2F[..., :F], "moe_gate"), checkpoint_name(h_A2F[..., F:], "moe_up"))


# --- grouped matmul ---------------------------------------------------------------------------------

def default_grouped_matmul() -> str:
  return "loop" if jax.default_backend() == "cpu" else "ragged"


def default_block_rows(rows: int, num_experts: int) -> int:
  """Rows per block: the power of two at or below rows / E (the mean group), in [16, 256]. Padding
  is at most E * (b - 1) rows, about rows / 2 on average; measured best of 32..256 at 4096 rows with
  8 and 64 groups (docs/performance-log.md, 2026-11-30)."""
  target = max(rows // num_experts, 1)
  return int(min(256, max(16, 2 ** int(math.floor(math.log2(target))))))


def grouped_matmul(xs_AD: jax.Array, w_EDF, sizes_E: jax.Array, *, impl: str = "auto",
                   block_rows: int | None = None) -> jax.Array:
  """ys[j] = xs[j] @ w[e_j] where rows are sorted by expert and sizes_E counts each expert's rows.

  w_EDF may be a tuple of kernels [E, D, F_i]: one grouped matmul against their concatenation along
  F (the fused gate|up), [A, sum F_i]. "ragged" concatenates them; "blocks" runs each block's rows
  against each kernel in the same pass and concatenates the [b, F_i] outputs, with no kernel copy.
  """
  ws = tuple(w_EDF) if isinstance(w_EDF, (tuple, list)) else (w_EDF,)
  impl = default_grouped_matmul() if impl == "auto" else impl
  if impl != "loop":
    ws = tuple(materialize(w) for w in ws)
  if impl == "ragged":
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=-1)
    return jax.lax.ragged_dot(xs_AD, w, sizes_E.astype(jnp.int32))
  if impl == "blocks":
    b = block_rows or default_block_rows(xs_AD.shape[0], ws[0].shape[0])
    return _gmm_blocks(xs_AD, ws, sizes_E, b)
  if impl == "loop":
    big, small = loop_block_rows(xs_AD.shape[0], ws[0].shape[0])
    if block_rows:
      big, small = block_rows, max(1, block_rows // 4)
    x = _vary_like(xs_AD, _leaf(ws[0]))
    return _loop_matmul(x, tuple(_vary_row(w, x) for w in ws), sizes_E, big, small)
  raise ValueError(f"grouped_matmul={impl!r}: expected one of {GROUPED_MATMULS}")


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
  yp = _blocks_matmul(xp, tuple(_vary_like(w, xp) for w in ws), block_expert, live)  # [nb, b, F]
  return yp.reshape(nb * b, -1)[dst]


def _varying(a):
  mat = getattr(jax.typeof(a), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def _vary_like(a, like):
  """a, marked as varying over the shard_map axes `like` varies over (a no-op outside shard_map)."""
  axes = tuple(sorted(_varying(like) - _varying(a)))
  return jax.lax.pcast(a, axes, to="varying") if axes else a


def _leaf(w):
  """A kernel's array: a StackRow's stack."""
  return w.stack if is_row(w) else w


def _vary_row(w, like):
  """_vary_like for a kernel or a StackRow (its stack marked)."""
  return StackRow(_vary_like(w.stack, like), w.index) if is_row(w) else _vary_like(w, like)


def _expert_kernel(w, e):
  """Expert e's kernel of w [E, ...]: read from the stack for a StackRow (no copy of the layer's row)."""
  return w.at(e) if is_row(w) else jax.lax.dynamic_index_in_dim(w, e, axis=0, keepdims=False)


def _zeros(shape, like, dtype=None):
  """Zeros that vary over the same shard_map axes as `like` (cond branches and scan carries must agree)."""
  return _vary_like(jnp.zeros(shape, dtype or like.dtype), like)


def _cat(parts):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


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


# --- grouped matmul: the expert loop ------------------------------------------------------------------

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


# --- the expert-weight-gradient scheduling barrier ---------------------------------------------------

@jax.custom_vjp
def expert_grad_barrier(xs_AD: jax.Array, kernels: tuple) -> tuple[jax.Array, tuple]:
  """Identity on (the experts' input rows, expert kernels). In the backward, the rows' cotangent
  (what the gather's scatter-add turns into x's gradient) and the kernels' cotangents (the grouped
  matmuls' weight gradients) pass one optimization_barrier together: XLA must have all of them
  before any leaves, so the expert weight gradients are scheduled with the input gradient that the
  previous layer's backward waits on, not deferred and interleaved with it. Numerically a no-op
  (bit-identical values)."""
  return xs_AD, kernels


def _expert_grad_barrier_fwd(xs_AD, kernels):
  return (xs_AD, kernels), None


def _expert_grad_barrier_bwd(_, cts):
  return jax.lax.optimization_barrier(cts)


expert_grad_barrier.defvjp(_expert_grad_barrier_fwd, _expert_grad_barrier_bwd)


# --- the router kernel, gathered once before the layers (issue 11 speedup 5) -------------------------

def gather_router_once(router_stack: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """The stacked router [L, D, E] (logical axes `axes`) gathered once before the layer scan: no
  all-gather in the scan's body; each layer's gradient goes back per layer (nn/gather_once.py)."""
  return gather_once.gather_stack(router_stack, axes, "router_gather_once")


# --- dispatch ----------------------------------------------------------------------------------------

def dispatch(x_MD: jax.Array, ids_Mk: jax.Array, w_Mk: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array,
             down_EFD: jax.Array, *, fused_gate_up: bool = True, activation=jax.nn.silu,
             grouped_matmul_impl: str = "auto", block_rows: int | None = None, unsort_impl: str = "perm",
             expert_offset: jax.Array | None = None, grad_barrier: bool = True):
  """Dropless expert computation on local tokens: y [M, D] = sum_k w[n, k] * expert_{ids[n, k]}(x[n]).

  fused_gate_up: gate and up in one grouped matmul ([A, 2F]) and fused_glu; else two and autodiff.
  grad_barrier: `expert_grad_barrier` on the gathered rows and the kernels (identity; one
  optimization barrier over their cotangents in the backward).
  expert_offset (expert parallelism): the kernels hold experts [offset, offset + E) of all experts;
  only the slots routed to those run, the rest sort to the end, get no rows in the grouped matmul
  and give zeros (y is this shard's part of the sum over k).
  """
  if unsort_impl not in UNSORTS:
    raise ValueError(f"unsort_impl={unsort_impl!r}: expected one of {UNSORTS}")
  M, D = x_MD.shape
  k = ids_Mk.shape[1]
  E = down_EFD.shape[0]
  dt = x_MD.dtype
  gmm = functools.partial(grouped_matmul, impl=grouped_matmul_impl, block_rows=block_rows)
  with jax.named_scope("sort"):
    flat = ids_Mk.reshape(-1)  # [A], slot j belongs to token j // k
    local = None
    if expert_offset is not None:
      # Local expert ids; every other expert becomes E, which sorts last and is counted in no group.
      flat = flat - expert_offset
      local = (flat >= 0) & (flat < E)  # [A]
      flat = jnp.where(local, flat, E)
    perm = checkpoint_name(jnp.argsort(flat, stable=True).astype(jnp.int32), "moe_perm")
    sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1, mode=None if local is None else "drop")
  with jax.named_scope("gather"):
    xs = x_MD[perm // k]  # [A, D]
  if (default_grouped_matmul() if grouped_matmul_impl == "auto" else grouped_matmul_impl) != "loop":
    # Only the expert loop reads a StackRow in place; the others take the row sliced out.
    gate_EDF, up_EDF, down_EFD = (materialize(w) for w in (gate_EDF, up_EDF, down_EFD))
  # Kernels left in their stacks (StackRow, read by the expert loop) skip the barrier: their cotangents are
  # stack-shaped pads that XLA fuses across layers into one pass, which a barrier on each would block.
  if grad_barrier and not any(is_row(w) for w in (gate_EDF, up_EDF, down_EFD)):
    # On the grouped matmuls' input rows and kernels: the rows' cotangent enters the barrier before
    # the gather's scatter-add, so XLA may still fold other gradients of x into that scatter (as
    # without the barrier: on x itself it blocked the fold and moved x's gradient by 1 ulp). Inside
    # shard_map the kernels are made varying first (as the grouped matmul would), so the barrier's
    # cotangents have its inputs' types; the cast's transpose (the cross-shard sum) stays outside.
    kernels = tuple(_vary_like(w, xs) for w in (gate_EDF, up_EDF, down_EFD))
    xs, (gate_EDF, up_EDF, down_EFD) = expert_grad_barrier(xs, kernels)
  # Each grouped matmul in its own scope, so the census counts weight-gradient dots per kernel.
  with jax.named_scope("experts"):
    if fused_gate_up:
      with jax.named_scope("gate_up"):
        h = gmm(xs, (_as(gate_EDF, dt), _as(up_EDF, dt)), sizes)  # [A, 2F]
      a = fused_glu(activation, h)
    else:
      with jax.named_scope("gate"):
        g = checkpoint_name(gmm(xs, _as(gate_EDF, dt), sizes), "moe_gate")
      with jax.named_scope("up"):
        u = checkpoint_name(gmm(xs, _as(up_EDF, dt), sizes), "moe_up")
      a = activation(g) * u
    with jax.named_scope("down"):
      ys = gmm(a, _as(down_EFD, dt), sizes)  # [A, D]
  with jax.named_scope("unsort"):
    if unsort_impl == "perm":
      y_flat = unsort(ys, perm, inverse_permutation(perm))
    else:
      y_flat = ys[jnp.argsort(perm)]
    if local is not None:
      # The rows past the local groups are not computed (zeros, or a clamped gather in "blocks").
      y_flat = jnp.where(local[:, None], y_flat, jnp.zeros_like(y_flat))
  with jax.named_scope("combine"):
    y = jnp.einsum("nkd,nk->nd", y_flat.reshape(M, k, D).astype(jnp.float32), w_Mk.astype(jnp.float32))
  return y.astype(dt)


def _as(w, dt):
  """w.astype(dt); a StackRow of that dtype stays in its stack (a cast would copy its row anyway)."""
  return w if is_row(w) and w.dtype == dt else materialize(w).astype(dt)


def _batch_spec(shape) -> jax.sharding.PartitionSpec:
  return logical_spec(TOKENS, shape)


def moe_mlp(p: dict, x_BTD: jax.Array, ctx=None, *, num_experts: int, k: int, norm_topk: bool,
            activation: Callable = jax.nn.silu, router_dtype=jnp.float32, impl: str = "dropless",
            grouped_matmul: str = "auto", block_rows: int | None = None, fused_gate_up: bool = True,
            unsort_impl: str = "perm", token_mask_BT: jax.Array | None = None,
            forced_ids_BTk: jax.Array | None = None, replay_rows: int = REPLAY_ROWS, replay_impl: str = "compact",
            grad_barrier: bool = True, router_full: jax.Array | None = None, scoring: str = "softmax",
            router_bias: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
            routed_scaling: float = 1.0, dropped_score: float = 0.0, experts_axis: str = "experts",
            kernel_axes: tuple | None = None):
  """The MoE feed-forward layer: (y [B, T, D], side) with side = aux_stats(...) (float32) plus
  "moe_expert_ids", the routed ids [B, T, k] int32 (what router replay records and forces).

  scoring "softmax" (route: softmax, top-k) or "sigmoid" (group_route, DeepSeek-V3: sigmoid scores,
  group-limited selection of scores + router_bias [E] (zeros when None) with n_group / topk_group and
  dropped groups scoring dropped_score, weights from the unbiased scores times routed_scaling); the
  side then also holds "moe_expert_load" [E] (expert_load: routed pairs per expert, padding excluded),
  and the aux statistics' "prob" is the mean sigmoid score.
  experts_axis: the logical name of the kernels' experts dim (one of EXPERTS_AXES, as moe_spec named it):
  the mesh axes it maps to are the ones the dispatch runs expert-parallel over.

  kernel_axes: the logical axes of gate, up and down (moe_spec's), for kernels given as StackRow (an
  unrolled layer's row left in its stack, nn/stack_row.py): under a mesh a StackRow is read in place only
  where its stack is stored as the dispatch needs it (whole, or sharded on the experts dim alone under
  expert parallelism); elsewhere, or without kernel_axes, its row is sliced out first.

  p: {"router": [D, E], "gate": [E, D, F], "up": [E, D, F], "down": [E, F, D]}; router_full: this
  layer's slice of the router stack gathered once before the layers (gather_router_once). ctx supplies the dense primitive (ctx.dense); without one the
  plain nn.dense.dense is used. impl: "dropless" or "reference" (every expert on every token).
  token_mask_BT (1 = real token) weighs the aux statistics (and, under replay, spares padding top-k).
  forced_ids_BTk (int32 [B, T, k], -1 = not forced): router replay (nn/router_replay.py). Forced tokens
  use these ids with weights from the live router probabilities; top-k runs over at most replay_rows
  of the rest (replay_impl "compact"), or over all rows ("full"): bit-identical either way.
  """
  E, k = num_experts, k
  if not 1 <= k <= E:
    raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={E}")
  dense = dense_primitive if ctx is None else ctx.dense
  with jax.named_scope("moe"):
    with jax.named_scope("router"):
      rdt = jnp.dtype(router_dtype)
      router = p["router"] if router_full is None else gather_once.gathered(p["router"], router_full, ROUTER_AXES)
      logits = dense(x_BTD.astype(rdt), router.astype(rdt), "btd,de->bte", ROUTER_LOGITS)  # [B, T, E]
      if forced_ids_BTk is not None:
        check_forced_ids(forced_ids_BTk, (*x_BTD.shape[:2], k), E)
      if scoring == "softmax":
        if forced_ids_BTk is None:
          probs, w, ids = route(logits, k, norm_topk)
        else:
          probs, w, ids = replay_route(logits, forced_ids_BTk, k, norm_topk, token_mask_BT, rows=replay_rows,
                                       impl=replay_impl)
      elif scoring == "sigmoid":
        bias = jnp.zeros((E,), jnp.float32) if router_bias is None else router_bias.astype(jnp.float32)
        groups = dict(n_group=n_group, topk_group=topk_group)
        if forced_ids_BTk is None:
          probs, w, ids = group_route(logits, bias, k, norm_topk=norm_topk, scaling=routed_scaling,
                                      dropped=dropped_score, **groups)
        else:
          select = functools.partial(group_limited_topk, dropped=dropped_score, **groups)
          weigh = functools.partial(sigmoid_weights, norm_topk=norm_topk, scaling=routed_scaling)
          probs, w, ids = replay_route(logits, forced_ids_BTk, k, norm_topk, token_mask_BT, rows=replay_rows,
                                       impl=replay_impl, scoring="sigmoid", select=select, select_args=(bias,),
                                       weigh=weigh)
      else:
        raise ValueError(f"router scoring={scoring!r}: expected one of {ROUTER_SCORINGS}")
    side = dict(aux_stats(logits, probs, ids, E, token_mask_BT), moe_expert_ids=ids)
    if scoring == "sigmoid":
      side["moe_expert_load"] = expert_load(ids, E, token_mask_BT)
    if impl == "reference":
      # Every expert on every token, in an auto-axes region: under explicit sharding its einsums' operands
      # (batch on fsdp, the kernels' embed on fsdp) have no one output sharding, and the reference must run
      # on every mesh in both modes.
      from meshlm.nn.moe_reference import experts_reference
      ref = auto_region(functools.partial(experts_reference, activation=activation), ("batch", "length", "act_embed"),
                        x_BTD.shape)
      return ref(x_BTD, ids, w, *(materialize(p[n]) for n in ("gate", "up", "down"))), side
    if impl != "dropless":
      raise ValueError(f"moe_impl={impl!r}: expected dropless or reference")
    fn = functools.partial(_dispatch_BT, activation=activation, grouped_matmul_impl=grouped_matmul,
                           block_rows=block_rows, unsort_impl=unsort_impl, fused_gate_up=fused_gate_up,
                           grad_barrier=grad_barrier)
    kernels = (p["gate"], p["up"], p["down"])
    mesh = current_mesh()
    if mesh.empty:
      return fn(x_BTD, ids, w, *kernels), side
    spec = _batch_spec(x_BTD.shape)
    kspec = logical_spec((experts_axis,), kernels[-1].shape[:1])
    ep_axes = ep_mesh_axes(kspec)
    # The kernels as the dispatch needs them: whole (gathered), or under expert parallelism sharded on the
    # experts dim alone (each device keeps its E / ep experts; their other dims gathered, if sharded).
    want = [(experts_axis if ep_axes else None,) + (None,) * (a.ndim - 1) for a in kernels]
    kernels = tuple(_in_place(a, wa, None if kernel_axes is None else ax)
                    for a, wa, ax in zip(kernels, want, kernel_axes or (None,) * 3))
    kernels = tuple(a if is_row(a) else constrain(a, wa) for a, wa in zip(kernels, want))
    kspecs = tuple(jax.sharding.PartitionSpec(None, *kspec) if is_row(a) else kspec if ep_axes else
                   jax.sharding.PartitionSpec() for a in kernels)
    x_BTD, ids, w = (constrain(a, TOKENS) for a in (x_BTD, ids, w))
    if not ep_axes:
      # One dispatch per batch (and length) shard: tokens stay on their device.
      body = fn
    else:
      # Expert parallelism: each device computes its experts for every token of its expert group (_dispatch_ep).
      batch_axes = _axes_of(spec[:1])
      body = functools.partial(_dispatch_ep, fn, ep_axes=ep_axes, gathered=tuple(a for a in ep_axes if a in batch_axes),
                               block_rows=block_rows, num_experts=E)
    rows = tuple(a.index if is_row(a) else None for a in kernels)
    y = jax.shard_map(functools.partial(_with_rows, body, rows), in_specs=(spec, spec, spec) + kspecs,
                      out_specs=spec)(x_BTD, ids, w, *(_leaf(a) for a in kernels))
    return y, side


def _in_place(w, want: tuple, axes: tuple | None):
  """w, or a StackRow's row sliced out unless its stack is stored (logical axes ("layers",) + axes) as the
  dispatch wants the row (`want`), so reading it in place moves no data."""
  if not is_row(w):
    return w
  if axes is not None and logical_spec(("layers",) + tuple(axes), w.stack.shape) == logical_spec(
      (None,) + want, w.stack.shape):
    return w
  return w.get()


def _with_rows(fn, rows: tuple, x_BTD, ids_BTk, w_BTk, *kernels, **kw):
  """fn on the kernels, those with a row index given back as StackRow (shard_map passes their stacks)."""
  kernels = tuple(a if r is None else StackRow(a, r) for a, r in zip(kernels, rows))
  return fn(x_BTD, ids_BTk, w_BTk, *kernels, **kw)


def _axes_of(spec) -> set[str]:
  """The mesh axes a PartitionSpec (or a slice of one) names."""
  out = set()
  for part in spec:
    out.update((part,) if isinstance(part, str) else (part or ()))
  return out


def ep_mesh_axes(kspec) -> tuple[str, ...]:
  """The mesh axes that shard a kernel's experts dim, in the PartitionSpec's order (major first): kspec
  is the experts dim's one-entry PartitionSpec. () when the experts dim is whole."""
  part = kspec[0] if len(kspec) else None
  return (part,) if isinstance(part, str) else tuple(part or ())


def local_expert_offset(num_local: int, axes: tuple[str, ...] = (EXPERT_AXIS,)) -> jax.Array:
  """The first expert this shard holds: experts are split over the mesh axes `axes` in order, the first
  axis major (axis_index of a tuple is that linear index, the same order as PartitionSpec((axes)))."""
  return jax.lax.axis_index(axes).astype(jnp.int32) * num_local


def _dispatch_ep(fn, x_BTD, ids_BTk, w_BTk, gate, up, down, *, ep_axes: tuple[str, ...],
                 gathered: tuple[str, ...], block_rows, num_experts: int):
  """Inside shard_map: this device's E_l = E / ep experts on all tokens of its expert group.

  ep_axes: the mesh axes that shard the experts dim (expert, fsdp or both, major first). gathered: those of
  them that also shard the batch: all-gather the group's tokens over them in [|gathered| * B, T, D],
  compute the local experts' part of every token's sum over k, reduce-scatter the parts back over them, so
  each device gets its own tokens' full sums. Over the other ep axes the tokens are already the group's,
  and a psum adds the parts. The kernels are never gathered over ep_axes; their gradient stays local.
  """
  E_l = down.shape[0]
  ep = num_experts // E_l
  shared = tuple(a for a in ep_axes if a not in gathered)
  if gathered:
    x_BTD, ids_BTk, w_BTk = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x_BTD, ids_BTk, w_BTk))
  if shared:
    # Mark the shared tokens as varying over those axes, so their cotangent is summed over them
    # (left invariant, x's gradient through the gather by the varying perm misses the other shards').
    x_BTD, w_BTk = (jax.lax.pcast(a, shared, to="varying") for a in (x_BTD, w_BTk))
  B, T, k = ids_BTk.shape
  # About 1 / ep of the group's slots are local: size the blocks from that, not from all slots.
  b = block_rows or default_block_rows(B * T * k // ep, E_l)
  y = fn(x_BTD, ids_BTk, w_BTk, gate, up, down, block_rows=b, expert_offset=local_expert_offset(E_l, ep_axes))
  if shared:
    y = jax.lax.psum(y, shared)
  if gathered:
    y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
  return y


def _dispatch_BT(x_BTD, ids_BTk, w_BTk, gate, up, down, **kw):
  B, T, D = x_BTD.shape
  k = ids_BTk.shape[-1]
  y = dispatch(x_BTD.reshape(B * T, D), ids_BTk.reshape(B * T, k), w_BTk.reshape(B * T, k), gate, up, down, **kw)
  return y.reshape(B, T, D)


# --- introspection for tests and the census ---------------------------------------------------------

def count_primitives(jaxpr, names: tuple[str, ...]) -> int:
  """How many equations of the given primitives a (closed) jaxpr holds, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += count_primitives(sub, names)
  return n


def count_sorts(fn, *args) -> int:
  """Sort ops in the jaxpr of fn(*args) (pass a jax.grad'ed function to count forward + backward)."""
  return count_primitives(jax.make_jaxpr(fn)(*args), ("sort",))
