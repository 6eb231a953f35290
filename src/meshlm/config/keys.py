"""The config's dotted keys, read from the pydantic schema: the `--help` listing and "did you mean".

Both read the schema itself, so a new field shows up in `meshlm train --help` and in suggestions
the moment it is added; its one-line meaning is its `Field(description=...)`, marked "(may change on resume)"
for the keys config/resume.py declares and a part section's COMPUTE knobs.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from meshlm.config.resume import may_change_on_resume
from meshlm.config.schema import Config


@dataclasses.dataclass(frozen=True)
class Key:
  name: str  # dotted: train.steps
  type: str  # int, float|null, explicit|auto, list[global|local]
  default: str  # as typed on the command line; "(preset)" where the preset must give it
  meaning: str  # the field's description, one line
  resume: bool = False  # may change when a run resumes (config/resume.py; a part section's COMPUTE knobs)


def _section(annotation) -> type[BaseModel] | None:
  return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def type_name(annotation) -> str:
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if origin is Literal:
    return "|".join(str(a) for a in args)
  if origin in (Union, types.UnionType):
    return "|".join("null" if a is type(None) else type_name(a) for a in args)
  if origin is list:
    return f"list[{type_name(args[0])}]" if args else "list"
  if origin is dict:
    return "dict"
  return getattr(annotation, "__name__", str(annotation))


def show_value(value: Any) -> str:
  """A value as the user would type it after key=."""
  if value is PydanticUndefined:
    return "(preset)"
  if value is None:
    return "null"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, list):
    return "[" + ",".join(show_value(v) for v in value) + "]"
  return str(value)


def _walk(model: type[BaseModel], prefix: str):
  for name, field in model.model_fields.items():
    dotted = prefix + name
    sub = _section(field.annotation)
    if sub is not None:
      yield from _walk(sub, dotted + ".")
      continue
    meaning = " ".join((field.description or "").split())
    default = field.default_factory() if field.default_factory is not None else field.default
    resume = may_change_on_resume(dotted) or name in getattr(model, "COMPUTE", ())
    yield Key(dotted, type_name(field.annotation), show_value(default), meaning, resume)


@functools.cache
def leaf_keys() -> tuple[Key, ...]:
  """Every settable key of the schema, in schema order (sections expanded)."""
  return tuple(_walk(Config, ""))


@functools.cache
def _children() -> dict[str, tuple[str, ...]]:
  """section ('' for the top level) -> the names of its fields, sections included."""
  out: dict[str, list[str]] = {}

  def visit(model: type[BaseModel], prefix: str) -> None:
    out[prefix] = list(model.model_fields)
    for name, field in model.model_fields.items():
      sub = _section(field.annotation)
      if sub is not None:
        visit(sub, f"{prefix}.{name}" if prefix else name)
  visit(Config, "")
  return {k: tuple(v) for k, v in out.items()}


def suggest(key: str) -> str | None:
  """The known key closest to an unknown one, or None when nothing is close.

  First a sibling in the same section (train.stpes -> train.steps), then the same name in
  another section (train.embed_dim -> model.embed_dim), then any dotted key (modle.embed_dim).
  """
  children = _children()
  parent, _, name = key.rpartition(".")
  near = difflib.get_close_matches(name, children.get(parent, ()), n=1, cutoff=0.6)
  if near:
    return f"{parent}.{near[0]}" if parent else near[0]
  everything = [f"{p}.{c}" if p else c for p, cs in children.items() for c in cs]
  same_name = [k for k in everything if k.rpartition(".")[2] == name]
  if len(same_name) == 1:
    return same_name[0]
  near = difflib.get_close_matches(key, everything, n=1, cutoff=0.8)
  return near[0] if near else None


# TRL's GRPOConfig names typed under rl. (docs/rl.md, "Coming from TRL"): the meshlm key of each, or per TRL value
# the meshlm setting, for the one-line refusal of an unknown key.
TRL_KEYS: dict[str, str | dict[str, str]] = {
    "rl.loss_type": {"dapo": "rl.loss_agg=token_mean (the default)", "grpo": "rl.loss_agg=sequence_mean",
                     "dr_grpo": "rl.loss_agg=constant", "bnpo": "rl.loss_agg=bnpo",
                     "cispo": "rl.policy_loss=cispo (its cap: rl.cispo_cap)"},
    "rl.max_completion_length": "rl.max_new_tokens",
    "rl.importance_sampling_level": "rl.ratio_level",
    "rl.use_bias_correction_kl": "rl.kl_estimator=k3_ratio (true) or k3 (false)",
    "rl.vllm_importance_sampling_mode": "rl.sampler_is",
    "rl.gradient_accumulation_steps": "train.micro_batches",
    "rl.learning_rate": "train.learning_rate",
    "rl.max_steps": "train.steps",
}


def trl_hint(key: str, value: Any) -> str | None:
  """The refusal of TRL's name `key` (set to value): which meshlm key (and value) means the same; None for others."""
  hint = TRL_KEYS.get(key)
  if hint is None:
    return None
  if isinstance(hint, dict):
    if isinstance(value, str) and value in hint:
      return f"{key}={value}: TRL's spelling; meshlm's is {hint[value]} (docs/rl.md: coming from TRL)"
    return (f"{key}: TRL's name; meshlm spells its values as " + ", ".join(f"{v}: {h}" for v, h in hint.items()) +
            " (docs/rl.md: coming from TRL)")
  return f"{key}: TRL's name; meshlm's key is {hint} (docs/rl.md: coming from TRL)"


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
  """name is one of prefixes, or under one that ends in '.' (mesh. covers mesh.fsdp)."""
  return any(name == p or (p.endswith(".") and name.startswith(p)) for p in prefixes)


def section_keys(prefix: str, section: type[BaseModel]) -> tuple[Key, ...]:
  """The keys of a config section that is not a schema field (a layer part's own, model.parts.<part>.)."""
  return tuple(_walk(section, prefix))


def render_keys(only: tuple[str, ...] | None = None, skip: tuple[str, ...] = (), extra: tuple[Key, ...] = ()) -> str:
  """The table `meshlm <command> --help` prints: key, type, default, meaning; only the keys `only` names (keys or
  sections ending in '.'), without those `skip` names; `extra` (the parts' own keys) after the schema's."""
  keys = [k for k in leaf_keys() + tuple(extra) if (only is None or _matches(k.name, only)) and not _matches(k.name, skip)]
  rows = [("key", "type", "default", "meaning")] + [
      (k.name, k.type, k.default, f"{k.meaning} (may change on resume)" if k.resume else k.meaning) for k in keys]
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)
