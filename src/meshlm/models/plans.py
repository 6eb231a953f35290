"""Layer plans more than one family builds: the periodic scan plan, and the Gated DeltaNet hybrids' plan and
checks. Families import these (and parts, and models/family.py), never another family module
(tests/test_imports.py holds that).

- periodic_plan(kinds, contexts): the (prefix, period) that unrolls the fewest layers (qwen3_moe, the hybrids).
- hybrid_plan(m): model.hybrid_types() (Hugging Face's layer_types) mapped to kinds by KINDS, then periodic
  (qwen3-next-80b-a3b: 3 linear + 1 full, 12 periods).
- validate_hybrid(m, moe=...): the fields a GDN hybrid needs (qwen3_next, qwen3_5, qwen3_5_moe); a dense one has no
  moe part, so its family refuses model.parts.moe.
"""
from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.models.family import LayerPlan
from meshlm.models.ffns.moe import knobs, validate_softmax_routing

# Hugging Face's layer_types -> the hybrids' kind names.
KINDS = {"linear_attention": "linear_attn", "full_attention": "full_attn"}


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


def hybrid_plan(m: ModelConfig) -> LayerPlan:
  """A GDN hybrid's plan: its layer types as kinds (KINDS), grouped by periodic_plan."""
  kinds = tuple(KINDS[t] for t in m.hybrid_types())
  return periodic_plan(kinds, m.layer_contexts())


def validate_hybrid(m: ModelConfig, *, moe: bool) -> None:
  """A GDN hybrid's rules beyond the fields and knobs its parts need (Part.needs, their sections): its layer plan
  (model.hybrid_layer_types, one known type per layer, or model.full_attention_interval); one ConfigError line
  naming the key."""
  fam, types = m.family, m.hybrid_layer_types
  if types is not None:
    bad = [(i, t) for i, t in enumerate(types) if t not in KINDS]
    if bad:
      i, t = bad[0]
      raise ConfigError(f"model.hybrid_layer_types[{i}]={t!r}: unknown layer type; expected {' or '.join(KINDS)}")
    if len(types) != m.num_layers:
      raise ConfigError(f"model.hybrid_layer_types: {len(types)} entries for model.num_layers={m.num_layers}; give "
                        "one per layer")
  if m.hybrid_types() is None:
    raise ConfigError(f"model.hybrid_layer_types: model.family={fam} needs its layer pattern; set "
                      "model.hybrid_layer_types (one linear_attention or full_attention per layer) or "
                      "model.full_attention_interval")
  if m.layer_pattern is not None or m.sliding_window is not None:
    raise ConfigError(f"model.layer_pattern / model.sliding_window: model.family={fam} has no sliding-window "
                      "layers; leave them null")
  if moe:
    if knobs(m).shared_expert_mlp_dim is None:
      raise ConfigError(f"model.parts.moe.shared_expert_mlp_dim: required by model.family={fam} (its gated shared "
                        "expert)")
    if m.mlp_only_layers or m.decoder_sparse_step != 1:
      raise ConfigError(f"model.mlp_only_layers / model.decoder_sparse_step: model.family={fam} is built with "
                        "every layer MoE; leave them at [] and 1")
    validate_softmax_routing(m)
