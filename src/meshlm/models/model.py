"""The model resolved once: a config's family, plan and kinds, and the questions the decoder asks of them.

    M = model.resolve(cfg)          # cached: the same config resolves to the same Model
    M.plan.kinds, M.kind(i), M.parts, M.input_readers("name"), M.param_specs

`resolve` runs the family's own checks (Family.validate) once and freezes the answer, so the decoder,
the train step and generate ask one object instead of re-deriving the family and plan at each call
site (and per layer). Every decoder entry point takes a Config or a Model; a Config is resolved on
entry. The cache is keyed by the config's contents and checked against the registry's entry, so a config
changed after resolving, or a family swapped in the registry (a test's monkeypatch), resolves anew.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax

from meshlm.config import Config
from meshlm import spec as S
from meshlm.models.context import windows
from meshlm.models.family import Family, Kind, LayerInput, LayerPlan, Part
from meshlm.models import registry
from meshlm.nn import kv_cache
from meshlm.nn.flash_attention import RESIDUALS

_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 64


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
  """A config with its family and layer plan resolved. Derived views are computed once (cached)."""
  cfg: Config
  family: Family
  plan: LayerPlan

  @property
  def m(self):
    return self.cfg.model

  @functools.cached_property
  def kinds(self) -> dict[str, Kind]:
    """The kinds the plan uses, in order of first appearance."""
    return {k: self.family.kinds[k] for k in self.plan.kind_names()}

  def kind(self, i: int) -> Kind:
    """Model layer i's kind."""
    return self.family.kinds[self.plan.kinds[i]]

  @functools.cached_property
  def parts(self) -> tuple[tuple[str, Part], ...]:
    """Every (kind name, Part) of the plan's kinds."""
    return tuple((k, part) for k, kind in self.kinds.items() for part in kind.parts)

  @functools.cached_property
  def unique_parts(self) -> tuple[Part, ...]:
    """The plan's parts, each once (by name), in order of first appearance."""
    seen: dict[str, Part] = {}
    for _, p in self.parts:
      seen.setdefault(p.name, p)
    return tuple(seen.values())

  @functools.cached_property
  def losses(self) -> dict:
    """{metric: (coef, fn(side))}: the loss terms the parts turn on (Part.losses), each part once."""
    out: dict = {}
    for p in self.unique_parts:
      for name, term in p.losses(self.m).items():
        assert name not in out, f"two parts add the loss {name!r}"
        out[name] = term
    return out

  @functools.cached_property
  def metrics(self) -> dict:
    """{metric: fn(side)}: the statistics the parts log beside the loss (Part.metrics), each part once."""
    out: dict = {}
    for p in self.unique_parts:
      for name, term in p.metrics(self.m).items():
        assert name not in out and name not in self.losses, f"two parts log the metric {name!r}"
        out[name] = term
    return out

  @functools.cached_property
  def scans(self) -> bool:
    return self.cfg.scan_layers and self.plan.groups > 0

  @functools.cached_property
  def unrolled_ids(self) -> tuple[int, ...]:
    """The model layers run unrolled: every layer without a scan, else the prefix and the rest."""
    lp = self.plan
    if not self.scans:
      return tuple(range(lp.num_layers))
    return tuple(range(lp.prefix)) + tuple(range(lp.prefix + lp.groups * lp.period, lp.num_layers))

  def _layers_where(self, has) -> list[int]:
    """The model layers (in order) whose kind has a part p with has(p)."""
    return [i for i, k in enumerate(self.plan.kinds) if any(has(p) for p in self.family.kinds[k].parts)]

  def input_readers(self, name: str) -> list[int]:
    """The model layers (in order) whose kind has a part that reads the per-layer input `name`."""
    return self._layers_where(lambda p: name in p.replay.layer_inputs)

  def side_layers(self, name: str) -> list[int]:
    """The model layers (in order) whose kind has a part that returns the side output `name`."""
    return self._layers_where(lambda p: name in p.side_names)

  def layer_input(self, name: str) -> LayerInput:
    """The LayerInput that the first reader of `name` declares."""
    kind = self.kind(self.input_readers(name)[0])
    return next(p.replay.layer_inputs[name] for p in kind.parts if name in p.replay.layer_inputs)

  @functools.cached_property
  def layer_input_names(self) -> tuple[str, ...]:
    """Every per-layer input some layer of the plan reads, sorted."""
    return tuple(sorted({n for _, p in self.parts for n in p.replay.layer_inputs}))

  @functools.cached_property
  def replays(self) -> dict[str, str]:
    """{side output: the per-layer input that replays it} over the plan's parts (what a sampler records)."""
    return {side: name for _, p in self.parts for side, name in p.replay.replays.items()}

  @functools.cached_property
  def shard_multiple(self) -> int:
    """What each context shard's length must be a multiple of, over the plan's parts (MeshRules.shard_multiple)."""
    return math.lcm(*(p.mesh.shard_multiple(self.m) for _, p in self.parts))

  @functools.cached_property
  def rotary_dims(self) -> tuple[int, ...]:
    """The RoPE widths the plan's parts read from their context."""
    return tuple(sorted({d for _, p in self.parts for d in p.rotary_dims(self.m)}))

  @functools.cached_property
  def attention_shapes(self) -> tuple:
    """The attention shapes (nn/attention.Shape) the plan's parts declare (Instrument.attention_shape), sorted."""
    shapes = {p.instrument.attention_shape(self.m) for _, p in self.parts if p.instrument.attention_shape is not None}
    return tuple(sorted(shapes, key=repr))

  def state_spec(self, i: int, batch: int, cache_len: int) -> dict:
    """Model layer i's {part key: {leaf: StateLeaf}} for a cache of cache_len positions."""
    size = kv_cache.cache_size(cache_len, windows(self.m)[self.plan.contexts[i]])
    return self.kind(i).state_spec(self.m, batch, size)

  @functools.cached_property
  def remat_policy(self):
    """remat=full saves nothing but the values the parts name as cheap to keep and dear to recompute (a
    part's permutation, say: without it the backward sorts again) and, with remat_attention=save, the attention
    core's output and row log-sum-exp (so the backward does not rerun the forward kernel); remat=dots saves dots
    too."""
    cp = jax.checkpoint_policies
    saved = {n for _, p in self.parts for n in p.compute.remat_save_names}
    if self.cfg.remat_attention == "save":  # the attention core's output and log-sum-exp (nn/flash_attention.RESIDUALS)
      saved.add(RESIDUALS)
    names = cp.save_only_these_names(*sorted(saved))
    return names if self.cfg.remat == "full" else cp.save_from_both_policies(cp.checkpoint_dots, names)

  @functools.cached_property
  def param_specs(self) -> dict:
    m, fam, lp = self.m, self.family, self.plan
    specs = {
        # Untied embedding rows have unit scale. A tied head reuses the rows as its kernel, and families
        # that multiply embeddings by sqrt(D) scale them up: both draw rows at D ** -0.5, so the
        # logits (and the scaled input) start at unit scale.
        "embed": S.ParamSpec((m.vocab_size, m.embed_dim), ("vocab", "embed"), "normal",
                             fan_in=m.embed_dim if (fam.embed_scale or m.tie_embeddings) else 1),
        "layers": {k: S.stack(kind.spec(m), lp.count(k), self.cfg.param_scan_axis) for k, kind in self.kinds.items()},
        "final_norm": S.zeros(m.embed_dim) if fam.norm_plus_one else S.ones(m.embed_dim),
    }
    if not m.tie_embeddings:
      specs["lm_head"] = S.kernel((m.embed_dim, m.vocab_size), ("embed", "vocab"))
    return specs

  @functools.cached_property
  def model_state_specs(self) -> dict:
    """The non-trainable leaves the parts declare (ModelState), stacked like the parameters:
    {"layers": {kind: {part key: ...}}} for the kinds that have any; {} when none do."""
    m, lp = self.m, self.plan
    layers = {k: S.stack(kind.model_state(m), lp.count(k), self.cfg.param_scan_axis)
              for k, kind in self.kinds.items() if kind.model_state(m)}
    return {"layers": layers} if layers else {}


def resolve(cfg: Config | Model) -> Model:
  """cfg's Model (cfg itself when it is one), after its family's checks (ConfigError names a bad key), holding cfg
  resolved (registry.resolved: the parts' sections written out whole, their run knobs decided)."""
  if isinstance(cfg, Model):
    return cfg
  key = cfg.model_dump_json()
  registered = registry.get(cfg.model.family)  # what the registry holds now: a swapped entry resolves anew
  hit = _CACHE.get(key)
  if hit is not None and hit[0] is registered:
    _CACHE.move_to_end(key)
    return hit[1]
  fam = registry.family(cfg)
  cfg = registry.resolved(cfg)  # what the parts read: every knob of their sections, those left to the run decided
  out = Model(cfg, fam, fam.layer_plan(cfg.model))
  _CACHE[key] = (registered, out)
  if len(_CACHE) > _CACHE_SIZE:
    _CACHE.popitem(last=False)
  return out


def clear_cache() -> None:
  """Forget every resolved Model (a test that swaps a registry entry resolves anew)."""
  _CACHE.clear()
