"""qwen3_moe: qwen3's block (q/k RMSNorm) with mixture-of-experts MLPs on some layers.

Layer i is MoE when num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is not in
mlp_only_layers (transformers' Qwen3MoeDecoderLayer); the other layers are dense (an MLP of mlp_dim).
The two kinds keep their own parameter stacks, and the plan scans over the shortest repeating
stretch of kinds (qwen3-moe-30b-a3b: every layer MoE, a scan of period 1).
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.models.family import Family, Kind, LayerPlan
from meshlm.models.ffns.glu import glu
from meshlm.models.ffns.moe import moe_ffn, validate_softmax_routing
from meshlm.models.mixers.gqa import gqa


def layer_kinds(m: ModelConfig) -> tuple[str, ...]:
  only = set(m.mlp_only_layers)
  return tuple("moe" if m.num_experts and (i + 1) % m.decoder_sparse_step == 0 and i not in only else "dense"
               for i in range(m.num_layers))


def periodic_plan(kinds: tuple[str, ...], contexts: tuple[str, ...]) -> LayerPlan:
  """The (prefix, period) that unrolls the fewest layers: cost = prefix + remainder + period (the scan body
  is one period, unrolled), ties to the shorter prefix. Scanned layers must repeat (kind, context)."""
  L = len(kinds)
  layers = list(zip(kinds, contexts))
  best = (L + 1, 0, L)
  for pre in range(L):
    for period in range(1, L - pre + 1):
      n = (L - pre) // period * period
      if all(layers[pre + j] == layers[pre + j % period] for j in range(n)):
        cost = pre + (L - pre - n) + period
        best = min(best, (cost, pre, period))
  _, pre, period = best
  return LayerPlan(kinds=kinds, contexts=contexts, period=period, prefix=pre)


def plan(m: ModelConfig) -> LayerPlan:
  return periodic_plan(layer_kinds(m), m.layer_contexts())


FAMILY = Family("qwen3_moe", kinds={"dense": Kind(gqa(), glu()), "moe": Kind(gqa(), moe_ffn())}, plan=plan,
                validate=validate_softmax_routing)
