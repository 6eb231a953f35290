"""The structural counts that tests/golden/census/<preset>.json pin for every tiny preset.

They come from the lowered StableHLO only (no compile), so the golden test stays fast and does not
move with XLA's optimizer. `scripts/regen_golden_census.py` writes the files; the test only reads.
"""
from __future__ import annotations

from typing import Any

# Small shapes: the counts are structural, so the batch and length do not change them.
BASE = ("cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1", "train.seq_len=32")
ARMS: dict[str, tuple[str, ...]] = {
    "explicit": ("shard_mode=explicit",),
    "explicit-noflags": ("shard_mode=explicit", "lm_head_weight_grad_in_kernel_order=false",
                         "dense_weight_grad_in_kernel_order=false"),
    "auto": ("shard_mode=auto",),
}
KEYS = ("stablehlo.sharding_barriers", "stablehlo.transpose_of_dot.adjacent", "stablehlo.transpose_of_dot.blocked",
        "stablehlo.transpose_of_dot.weight_grad.adjacent", "stablehlo.transpose_of_dot.weight_grad.blocked",
        "stablehlo.transposes", "stablehlo.dots", "blowups")


def tiny_presets() -> list[str]:
  from meshlm.config import preset_names
  return [p for p in preset_names() if p.endswith("-tiny")]


def stablehlo_census(cfg) -> dict[str, Any]:
  """The StableHLO half of the census (fields as in census()), from lowering alone."""
  from meshlm.analysis.census import blowups, stablehlo_counts
  from meshlm.train.step import build_train_step
  counts, pairs, mod = stablehlo_counts(build_train_step(cfg).lower().as_text(debug_info=True))
  counts["transpose_of_dot"]["pairs"] = [{k: p[k] for k in ("kind", "weight_grad", "between", "scope", "shape")}
                                         for p in pairs]
  return {"stablehlo": counts, "blowups": blowups(mod)}


def golden_counts(preset: str) -> dict[str, dict[str, Any]]:
  from meshlm.analysis.census import field
  from meshlm.config import load_config
  out = {}
  for arm, overrides in ARMS.items():
    result = stablehlo_census(load_config(f"model={preset}", *BASE, *overrides))
    out[arm] = {k: field(result, k) for k in KEYS}
  return out
