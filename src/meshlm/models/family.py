"""The family interface: what a model family declares, and the layer plan the decoder runs.

A family is one `Family` value in one file (`models/<name>.py`), registered by one line in
`models/registry.py`. It names its layer kinds, each with a parameter spec and a block function,
and the plan that says which kind (and which attention context) each model layer is.

    block(p, x_BTD, ctx, state) -> (x_BTD, state, side)

- p: one layer's parameters (a slice of its kind's stack).
- ctx: a `Context` (models/context.py): the model config, the dense projection bound to its
  flags, and the per-context inputs (RoPE tables, mask, positions, segment ids, cache slots).
- state: the layer's decode state (its KV cache), or None when training.
- side: a dict of per-layer side outputs (aux losses, routed expert ids), {} when there are none.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from meshlm.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of layer: its own parameter stack (`params["layers"][kind]`) and its block."""
  spec: Callable[[ModelConfig], dict]  # one layer's ParamSpec tree
  block: Callable[..., tuple[Any, Any, dict]]


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Which kind and which attention context each model layer is, and how the decoder groups them.

  Layers [0, prefix) run unrolled first (deepseek's dense first k). The rest repeat a pattern of
  `period` layers: the decoder scans over whole periods and unrolls the remainder. Each kind's
  parameters are one stack holding that kind's layers in model order; `slots()` maps a model layer
  index to (kind, row in that kind's stack). Checkpoints and HF maps see model indices only.
  """
  kinds: tuple[str, ...]  # per model layer
  contexts: tuple[str, ...]  # per model layer: "global" or "local" attention inputs
  period: int = 1
  prefix: int = 0

  def __post_init__(self):
    assert len(self.kinds) == len(self.contexts), (self.kinds, self.contexts)
    assert 0 <= self.prefix <= len(self.kinds) and self.period >= 1

  @property
  def num_layers(self) -> int:
    return len(self.kinds)

  @property
  def groups(self) -> int:
    """Whole periods after the prefix: the scan's length."""
    return (self.num_layers - self.prefix) // self.period

  @property
  def rest(self) -> int:
    """Layers after the last whole period, run unrolled."""
    return (self.num_layers - self.prefix) % self.period

  def kind_names(self) -> tuple[str, ...]:
    """The kinds present, in order of first appearance."""
    return tuple(dict.fromkeys(self.kinds))

  def slots(self) -> list[tuple[str, int]]:
    """Model layer index -> (kind, row in that kind's stack)."""
    seen: dict[str, int] = {}
    out = []
    for k in self.kinds:
      out.append((k, seen.get(k, 0)))
      seen[k] = seen.get(k, 0) + 1
    return out

  def count(self, kind: str) -> int:
    return self.kinds.count(kind)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its layer kinds, its plan, and the two decoder-level switches."""
  name: str
  kinds: Mapping[str, Kind]
  # The layer plan for a config; default: every layer of the first kind, contexts repeating
  # ModelConfig.layer_types() with that pattern as the period.
  plan: Callable[[ModelConfig], LayerPlan] | None = None
  norm_plus_one: bool = False  # RMSNorms scale by (1 + w); the final norm starts at zero
  embed_scale: bool = False  # embeddings are multiplied by sqrt(D) in the compute dtype

  def layer_plan(self, m: ModelConfig) -> LayerPlan:
    if self.plan is not None:
      return self.plan(m)
    types = m.layer_types()
    kind = next(iter(self.kinds))
    return LayerPlan(kinds=(kind,) * m.num_layers,
                     contexts=tuple(types[i % len(types)] for i in range(m.num_layers)), period=len(types))
