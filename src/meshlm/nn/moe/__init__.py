"""The mixture-of-experts feed-forward layer: a float32 router, top-k, the experts' sorted dispatch.

Per token the router picks k of E experts; each picked expert runs a GLU MLP on the token and the
k outputs are summed with the routing weights. The sorted dispatch drops no token (it is dropless),
except the compact expert-parallel form with a bounded buffer (ep_buffer_factor: expert_parallel.py), which
drops the rows past it and counts them:

  route:     logits = x @ router (float32, through the dense primitive) -> softmax -> top-k
  sort:      perm = argsort(expert id of each of the A = M*k (token, slot) pairs, slot-major: s = k' M + n)
  gather:    xs[j] = x[perm[j] % M]                                                # [A, D]
  matmuls:   h = xs @ gate_up[e_j] (one grouped matmul), a = act(h_gate) * h_up, ys = a @ down[e_j]
  back:      y[n] = sum_k' w[n, k'] * ys[inverse(perm)[k' M + n]]

The files, by concern:
- routing.py: the router's top-k (softmax, DeepSeek-V3's group-limited sigmoid), the bias rule, aux losses.
- gmm.py: the grouped matmul (loop, blocks, ragged, megablox) and its custom backwards.
- rows.py: the rows' movement (the sort, into expert order and back by gathers), each with its reference.
- fused.py: the GLU, the down matmul and the way back as one op whose backward runs no down matmul again;
  glu_rows.py: its GLU backward over the rows (a Pallas kernel on TPU, XLA's form the reference).
- dropless.py: the dispatch on local tokens (sort, gather, grouped matmuls, back) and its plain variants.
- expert_parallel.py: the dispatch with the experts sharded over ep devices (the group's tokens gathered, or compact:
  only the routed rows moved by all-to-all in bounded buffers, the overflow dropped and counted).
- layer.py: moe_spec, Options (what the layer reads besides the part's section, which it takes as it is) and moe_mlp,
  the layer (routing, then the dispatch under shard_map); reduce_barrier, which the part applies around every use of
  the layer's input.
The reference beside it (nn/moe_reference.py) runs every expert on every token and masks.

Router replay (`forced_ids_BTk` [B, T, k], -1 = not forced; nn/router_replay.py): forced tokens take
the given expert ids, weighted by the live router probabilities at those ids (so the router keeps its
gradient); top-k runs over at most `replay_rows` gathered tokens that are neither forced nor padding,
with a lax.cond fallback to the full top-k, bit-identical to `replay_impl="full"`. The side outputs
always carry the routed ids ("moe_expert_ids"), which is what a rollout records for replay.
"""
from meshlm.nn.moe.dropless import (REMAT_SAVE_NAMES, UNSORTS, combine, dispatch, expert_grad_barrier, expert_rows,
                                    fused_glu, gather_router_once, inverse_permutation, sort_slots, split_glu, unsort,
                                    unsort_rows)
from meshlm.nn.moe.expert_parallel import (EP_IMPLS, EXPERT_AXIS, capacity, dispatch_compact, dispatch_gather,
                                           ep_mesh_axes, local_expert_offset, send_layout)
from meshlm.nn.moe.gmm import (GROUPED_MATMULS, block_layout, default_block_rows, default_grouped_matmul,
                               grouped_matmul, loop_block_rows, rest_block_sizes)
from meshlm.nn.moe.layer import (DROPPED, EXPERTS_AXES, KERNEL_FSDP, SCOPE, TOKENS, Options, experts_axis, moe_mlp,
                                 moe_spec, reduce_barrier)
from meshlm.nn.moe.routing import (GROUP_MASKS, NORM_EPS, ROUTER_AXES, ROUTER_LOGITS, ROUTER_SCORINGS, aux_stats,
                                   bias_update, expert_load, group_limited_topk, group_route, load_balancing_loss,
                                   route, sigmoid_weights)

__all__ = [
    "DROPPED", "EP_IMPLS", "EXPERT_AXIS", "EXPERTS_AXES", "GROUP_MASKS", "GROUPED_MATMULS", "KERNEL_FSDP", "NORM_EPS",
    "REMAT_SAVE_NAMES", "ROUTER_AXES", "ROUTER_LOGITS", "ROUTER_SCORINGS", "SCOPE", "TOKENS", "UNSORTS", "Options",
    "aux_stats", "bias_update", "block_layout", "capacity", "combine", "default_block_rows", "default_grouped_matmul",
    "dispatch", "dispatch_compact", "dispatch_gather", "ep_mesh_axes", "expert_grad_barrier", "expert_load", "expert_rows", "experts_axis", "fused_glu",
    "gather_router_once", "group_limited_topk", "group_route", "grouped_matmul", "inverse_permutation",
    "load_balancing_loss", "local_expert_offset", "loop_block_rows", "moe_mlp", "moe_spec", "reduce_barrier",
    "rest_block_sizes", "route", "send_layout", "sigmoid_weights", "sort_slots", "split_glu", "unsort", "unsort_rows",
]
