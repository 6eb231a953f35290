"""The registries: family name -> the module that defines its `FAMILY`, and part name -> the factory
of a layer part (models/family.py). Adding a family, a mixer or a feed-forward is one file plus one
line here.
"""
from __future__ import annotations

import importlib

from meshlm.config import Config
from meshlm.config.schema import ModelConfig
from meshlm.errors import ConfigError
from meshlm.models.family import CensusCounter, Part, check_needs, check_sections, section

FAMILIES = {
    "llama": "meshlm.models.llama",
    "mistral": "meshlm.models.mistral",
    "qwen3": "meshlm.models.qwen3",
    "gemma": "meshlm.models.gemma",
    "gemma2": "meshlm.models.gemma2",
    "gemma3": "meshlm.models.gemma3",
    "mixtral": "meshlm.models.mixtral",
    "qwen3_moe": "meshlm.models.qwen3_moe",
    "qwen3_next": "meshlm.models.qwen3_next",
    "qwen3_5": "meshlm.models.qwen3_5",
    "qwen3_5_moe": "meshlm.models.qwen3_5_moe",
    "deepseek_v3": "meshlm.models.deepseek_v3",
}


def family_description(families) -> str:
  """The model.family key's description (`meshlm train --help`, docs/config.md), listing the families."""
  return "model family: " + ", ".join(families)


# config/schema.py sits below models/ and cannot import FAMILIES: its family key's description is written here.
ModelConfig.model_fields["family"].description = family_description(FAMILIES)


# The layer parts families compose (models/family.Part): name -> "module:factory". A new mixer or
# feed-forward is one file under models/mixers/ or models/ffns/ plus one line here.
PARTS = {
    "gqa": "meshlm.models.mixers.gqa:gqa",
    "glu": "meshlm.models.ffns.glu:glu",
    "moe": "meshlm.models.ffns.moe:moe_ffn",
    "gdn": "meshlm.models.mixers.gdn:gdn",
    "gated_gqa": "meshlm.models.mixers.gated_gqa:gated_gqa",
    "mla": "meshlm.models.mixers.mla:mla",
}


def parts() -> dict[str, Part]:
  """{part name: the part its factory returns with no arguments}, in PARTS order."""
  out = {}
  for name, where in PARTS.items():
    module, factory = where.split(":")
    out[name] = getattr(importlib.import_module(module), factory)()
  return out


def part_sections() -> dict[str, type]:
  """{part name: its own config section (Part.config)} over the registered parts that declare one."""
  return {name: part.config for name, part in parts().items() if part.config is not None}


def census_counters() -> tuple[CensusCounter, ...]:
  """The counters the registered parts declare for the census (Instrument.census), each field once, in PARTS order.
  Two parts declaring one field differently is a ValueError naming both."""
  out: dict[str, tuple[str, CensusCounter]] = {}
  for name, part in parts().items():
    for c in part.instrument.census:
      first, seen = out.setdefault(c.field, (name, c))
      if seen != c:
        raise ValueError(f"census field {c.field!r}: part {first!r} declares {seen}, part {name!r} declares {c}")
  return tuple(c for _, c in out.values())


def get(name: str):
  """The Family called name."""
  if name not in FAMILIES:
    raise ConfigError(f"model.family={name!r}: unknown; known families: {', '.join(sorted(FAMILIES))}")
  return importlib.import_module(FAMILIES[name]).FAMILY


def family(cfg: Config):
  """cfg's Family, after its parts' checks of the fields they need (Part.needs) and of their config sections
  (model.parts), the family's own checks of the model config (Family.validate), and the parts' of the context
  shards and of the mesh axes the config fixes."""
  fam = get(cfg.model.family)
  parts = _parts(fam)
  check_needs(cfg.model, parts)
  check_sections(cfg.model, parts)
  fam.validate(cfg.model)
  check_shards(cfg, parts)
  check_mesh(cfg)
  return fam


def _parts(fam) -> list[Part]:
  """Every part of the family's kinds, each once (by name), in order of first appearance."""
  return list({p.name: p for kind in fam.kinds.values() for p in kind.parts}.values())


def resolved(cfg: Config) -> Config:
  """cfg with each config section of its parts written out whole (every knob, at its default where model.parts
  leaves it), so that two configs of one model compare equal and a saved config holds every knob, and with the
  knobs its parts leave to the run filled in (MeshRules.run_knobs, decided by the mesh and the batch); cfg itself when
  nothing changes. Runs on a config its family accepts (`family`)."""
  own = {p.name: {**section(cfg.model, p).model_dump(mode="json"), **p.mesh.run_knobs(cfg)}
         for p in _parts(get(cfg.model.family)) if p.config is not None}
  if own == cfg.model.parts:
    return cfg
  return cfg.model_copy(update={"model": cfg.model.model_copy(update={"parts": own})})


def part_reports(cfg: Config, platform: str | None = None) -> dict:
  """What the parts of cfg's model report of their train step (Instrument.report), merged: resolved for `platform`
  (default: JAX's backend) and mesh.context (-1, the devices left, counting as more than one)."""
  import jax
  rc = resolved(cfg)
  context = cfg.mesh.context if cfg.mesh.context > 0 else 2
  return {k: v for p in _parts(get(cfg.model.family))
          for k, v in p.instrument.report(rc, platform or jax.default_backend(), context).items()}


def check_mesh(cfg: Config, sizes: dict[str, int] | None = None) -> None:
  """The mesh axis sizes (default: those cfg.mesh fixes; -1 is not known yet) against the model's parts: an axis
  that only parts this model lacks shard over stays at 1 (MeshRules.axes), and each part accepts the sizes
  (MeshRules.check, with its run knobs filled in). One ConfigError line naming the key otherwise."""
  if sizes is None:
    sizes = {k: v for k, v in cfg.mesh.sizes().items() if v != -1}
  ours = _parts(get(cfg.model.family))
  others = {a: p.name for p in parts().values() for a in p.mesh.axes if all(a not in q.mesh.axes for q in ours)}
  for axis, part in others.items():
    if sizes.get(axis, 1) > 1:
      raise ConfigError(f"mesh.{axis}={sizes[axis]}: {cfg.model_name} (model.family={cfg.model.family}) has no "
                        f"{part} layers, the only ones that shard over mesh.{axis}; leave mesh.{axis} at 1 and give "
                        "the devices to mesh.data or mesh.fsdp")
  m = resolved(cfg).model
  for part in ours:
    part.mesh.check(m, sizes)


def check_shards(cfg: Config, parts: list[Part]) -> None:
  """With the sequence split over mesh.context, each shard's length is a multiple of what every part needs of it
  (MeshRules.shard_multiple: whole chunks of a chunked recurrence): one ConfigError line otherwise."""
  n, T = cfg.mesh.context, cfg.train.seq_len
  for part in parts if n > 1 else ():
    k = part.mesh.shard_multiple(cfg.model)
    if k > 1 and T % (n * k):
      raise ConfigError(f"mesh.context={n}: train.seq_len={T} does not split into {n} shards whose lengths are "
                        f"multiples of {k}, as the {part.name} layers need; make train.seq_len a multiple of "
                        f"{n * k} or lower mesh.context")
  if n > 1 and cfg.context_attention == "ring" and T % (2 * n):
    raise ConfigError(f"context_attention=ring: train.seq_len={T} does not split into 2 x mesh.context={n} chunks "
                      f"(the zigzag ring's); make train.seq_len a multiple of {2 * n}, or set context_attention=gather")


def validate(cfg: Config) -> Config:
  """cfg resolved (`resolved`: its parts' sections written out whole, their run knobs decided), once its family
  accepts its model fields (ConfigError otherwise): commands call this right after loading a config, before
  anything touches the run directory."""
  family(cfg)
  return resolved(cfg)
