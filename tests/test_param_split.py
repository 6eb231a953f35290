"""Nothing large stays whole by accident (issue 45): every published preset's parameters split evenly over the
devices of each layout, from abstract shapes only (ParamSpecs and logical_spec on a jax AbstractMesh: no arrays,
no compile, about a second for all of them).

On each layout no parameter holds more than LIMIT bytes on a device beyond its even share (bytes / devices), and
the per-device parameter bytes are within SLACK of total / devices. AdamW's two moments take their parameters'
shardings, so the train state's arguments split the same way. The controls run the same check on the rules
before issue 45 (MLA's rank dims whole; embed over fsdp alone) and hold that it fails there, naming the kernels.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from meshlm import spec as S
from meshlm.config import load_config
from meshlm.models import param_specs
from meshlm.parallel import RULES, logical_spec
from meshlm.parallel.mesh import AXES
from meshlm.parallel.sharding import ShardingWarning

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "src/meshlm/config/presets").glob("*.yaml"))
LIMIT = 16 * 2**20  # bytes a parameter may hold beyond its even share: the GDN conv kernels [L, 4, C] (at most
# 8.8 MB in float32, qwen3.5-397b-a17b) stay whole
SLACK = 0.03  # per-device bytes at most (1 + SLACK) x the even split, or 1 MiB over it (the tiny presets' norms)
# Every preset on FSDP alone and on FSDP with the context axis (and the expert axis, for the MoE models: a dense
# model refuses mesh.expert > 1), 16 devices each; the two largest on their reference layouts (issue 45: the seed's
# 397B bench layout, MaxText's deepseek3-671b layout).
LAYOUTS = {"fsdp16": {"fsdp": 16}, "context2": {"context": 2, "fsdp": 8},
           "expert2_context2": {"expert": 2, "context": 2, "fsdp": 4}}
REFERENCE = {"qwen3.5-397b-a17b": {"expert": 8, "context": 2, "fsdp": 16}, "deepseek-v3": {"expert": 8, "fsdp": 32}}
MOE = {p for p in PRESETS if "moe" in load_config(f"model={p}").model.parts}
CASES = ([(p, name) for p in PRESETS for name in ("fsdp16", "expert2_context2" if p in MOE else "context2")]
         + [(p, "reference") for p in REFERENCE])
RULES_BEFORE = {"latent": (), "embed": ("fsdp",)}  # RULES before issue 45 (the controls)


@dataclasses.dataclass
class Split:
  total: int  # parameter bytes
  per_device: float  # parameter bytes on one device
  devices: int
  over: list[tuple[str, float]]  # (path, bytes beyond its even share) of each parameter over LIMIT

  def problems(self) -> list[str]:
    out = [f"{path}: {extra / 2**20:.1f} MiB over its even share" for path, extra in self.over]
    even = self.total / self.devices
    if self.per_device > max(even * (1 + SLACK), even + 2**20):
      out.append(f"{self.per_device / 2**30:.3f} GiB per device against an even split of {even / 2**30:.3f} GiB")
    return out


def abstract_mesh(layout: dict[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(layout.get(a, 1) for a in AXES), AXES, axis_types=(AxisType.Explicit,) * len(AXES))


def split(preset: str, layout: dict[str, int]) -> Split:
  """How preset's parameters split over an abstract mesh of layout's sizes (the config's mesh keys set too, so
  that the parts resolve their layouts, e.g. the MoE kernels', for it)."""
  cfg = load_config(f"model={preset}", *(f"mesh.{a}={n}" for a, n in layout.items()))
  mesh = abstract_mesh(layout)
  sizes = dict(zip(AXES, mesh.axis_sizes))
  devices = math.prod(mesh.axis_sizes)
  itemsize = jnp.dtype(cfg.train.param_dtype).itemsize
  total, per_device, over = 0, 0.0, []
  for path, s in jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=S.is_spec)[0]:
    shards = math.prod(sizes[a] for part in logical_spec(s.axes, s.shape, mesh) if part is not None
                       for a in ((part,) if isinstance(part, str) else part))
    size = math.prod(s.shape) * itemsize
    total += size
    per_device += size / shards
    if size / shards - size / devices > LIMIT:
      over.append((jax.tree_util.keystr(path), size / shards - size / devices))
  return Split(total, per_device, devices, over)


@pytest.mark.parametrize("preset,layout", CASES)
def test_parameters_split_evenly(preset, layout):
  got = split(preset, REFERENCE[preset] if layout == "reference" else LAYOUTS[layout])
  assert not got.problems(), f"{preset} on {layout}: " + "; ".join(got.problems())


def test_the_reference_layouts_reach_the_even_split():
  """The issue's figures: deepseek-v3's parameters were 23.5 GiB per device on expert=8 fsdp=32 where the even
  split is 9.8; they are now within 0.1% of it (qwen3.5-397b-a17b: within 0.2%, its conv kernels whole)."""
  for preset, bound in (("deepseek-v3", 1.001), ("qwen3.5-397b-a17b", 1.002)):
    got = split(preset, REFERENCE[preset])
    assert got.per_device <= bound * got.total / got.devices, (preset, got.per_device / 2**30)


def test_control_mla_rank_dims_whole(monkeypatch):
  """With MLA's rank dims whole (latent -> (), the rules before issue 45) FSDP leaves q_b, k_b and v_b whole:
  the check names the three kernels of deepseek-v3 on fsdp=16 (7% over the even split there; 2.4x on its reference
  layout) and finds deepseek-v3-small 1.6x the split (its kernels are each under LIMIT)."""
  monkeypatch.setitem(RULES, "latent", RULES_BEFORE["latent"])
  problems = split("deepseek-v3", LAYOUTS["fsdp16"]).problems()
  assert {p.split(":")[0].rsplit("[", 1)[1] for p in problems[:-1]} == {"'q_b']", "'k_b']", "'v_b']"}, problems
  assert "against an even split" in problems[-1]
  for preset, ratio in (("deepseek-v3", 1.05), ("deepseek-v3-small", 1.5)):
    got = split(preset, LAYOUTS["fsdp16"])
    assert got.problems() and got.per_device > ratio * got.total / got.devices, preset


@pytest.mark.parametrize("preset,layout", [("deepseek-v3", "reference"), ("qwen3.5-397b-a17b", "reference"),
                                           ("llama3-8b", "context2"), ("mixtral-8x7b", "expert2_context2")])
def test_control_embed_over_fsdp_alone(monkeypatch, preset, layout):
  """With embed over fsdp alone (the rules before issue 45; MLA's rank dims over fsdp) the context axis holds
  replicas and the expert axis replicates every non-expert kernel: the check fails on the reference layouts (the
  397B one at 2.3x the even split) and on the context and expert layouts of a dense and an MoE model."""
  monkeypatch.setitem(RULES, "embed", RULES_BEFORE["embed"])
  monkeypatch.setitem(RULES, "latent", ("fsdp",))
  got = split(preset, REFERENCE[preset] if layout == "reference" else LAYOUTS[layout])
  assert got.problems() and got.per_device > 1.15 * got.total / got.devices, got.per_device / got.total * got.devices


def test_parameter_dims_take_fsdp_then_expert_then_context():
  """The rule's order (the batch's device order first), an expert kernel's embed dim left what its experts dim did
  not take, and a dim expert or context does not divide left a replica over them (the longest dividing prefix of
  the rule, as every rule) with no ShardingWarning (a designed fallback), while fsdp not dividing still warns."""
  mesh = abstract_mesh({"expert": 2, "context": 2, "fsdp": 2})
  assert logical_spec(("embed", "mlp"), (64, 32), mesh) == P(("fsdp", "expert", "context"), None)
  assert logical_spec(("latent", "heads", "head_dim"), (64, 4, 8), mesh) == P(("fsdp", "expert", "context"), None, None)
  assert logical_spec(("layers", "experts", "embed", "mlp"), (3, 8, 64, 32), mesh) == P(
      None, "expert", ("fsdp", "context"), None)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ShardingWarning)
    assert logical_spec(("embed",), (12,), abstract_mesh({"expert": 5, "context": 2, "fsdp": 2})) == P("fsdp")
    assert logical_spec(("latent",), (6,), abstract_mesh({"expert": 4, "fsdp": 2})) == P("fsdp")
  with pytest.warns(ShardingWarning, match=r"mesh.fsdp=3 does not divide the embed dimension \(size 14\)"):
    assert logical_spec(("embed",), (14,), abstract_mesh({"expert": 2, "fsdp": 3})) == P(None)
