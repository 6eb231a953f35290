"""The structural counts that tests/golden/ pins, and how a mismatch is reported.

- tests/golden/census/<preset>.json: for every tiny preset and every arm in ARMS, the StableHLO
  counts in keys(), from lowering alone (no compile), so that test stays fast and does not move with
  XLA's optimizer.
- tests/golden/compiled_census.json: the compiled step's collective counts (all-gathers and the
  rest) for one config, COMPILED_CONFIG; these do move with XLA.

Both hold for the JAX that requirements.lock pins, and each file records the version it was made
with. `scripts/regen_golden_census.py` (REGEN) writes them; the tests only read.
"""
from __future__ import annotations

import re
from typing import Any

REGEN = "scripts/regen_golden_census.py"

# Small shapes: the counts are structural, so the batch and length do not change them.
BASE = ("cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1", "train.seq_len=32")
ARMS: dict[str, tuple[str, ...]] = {
    "explicit": ("shard_mode=explicit",),
    "explicit-noflags": ("shard_mode=explicit", "lm_head_weight_grad_in_kernel_order=false",
                         "dense_weight_grad_in_kernel_order=false"),
    # The other kernel-order implementation: must differ from the plain path (explicit-noflags), so a
    # silent fallback to it shows up as a diff.
    "explicit-auto_axes": ("shard_mode=explicit", "weight_grad_impl=auto_axes"),
    "auto": ("shard_mode=auto",),
}
STEP_KEYS = ("stablehlo.sharding_barriers", "stablehlo.transpose_of_dot.adjacent",
             "stablehlo.transpose_of_dot.blocked", "stablehlo.transpose_of_dot.weight_grad.adjacent",
             "stablehlo.transpose_of_dot.weight_grad.blocked", "stablehlo.transposes", "stablehlo.dots", "blowups",
             # Per step: call sites expanded, scan bodies times their trip count.
             "stablehlo.sorts.forward", "stablehlo.sorts.backward", "stablehlo.weight_grad_dots",
             # Scheduling fences (a part's own, e.g. one per layer in the backward; remat's).
             "stablehlo.optimization_barriers.forward", "stablehlo.optimization_barriers.backward")


def keys() -> tuple[str, ...]:
  """The pinned fields: STEP_KEYS, then the fields of the StableHLO counters the registered parts declare
  (analysis/counters.py; an HLO counter moves with XLA's optimizer, so it is not pinned here)."""
  from meshlm.analysis.counters import KINDS, part_counters
  return STEP_KEYS + tuple(f"{c.field}.{leaf}" for c in part_counters() if KINDS[c.kind][0] == "stablehlo"
                           for leaf in KINDS[c.kind][1])


# The scanned stack, as real-size models run it (the llama2-tiny preset itself unrolls its layers).
COMPILED_CONFIG = ("model=llama2-tiny", "scan_layers=true") + BASE
COMPILED_KEYS = tuple(f"hlo.collectives.{kind}.count"
                      for kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"))


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


def shrink(preset: str) -> tuple[str, ...]:
  """Overrides that keep a long preset's every layer kind and attention context with fewer layer bodies to
  lower and compile: the Gated DeltaNet hybrids one period of two layers (linear + full) instead of 3 + 1,
  gemma3 one local and one global layer instead of its 8 (a scanned period of 6, then 2); () for the rest.
  The golden census counts the shrunk presets (each file records its "shrink"), as tests/test_conformance.py
  trains them."""
  from meshlm.config import load_config
  m = load_config(f"model={preset}").model
  if m.full_attention_interval:
    return ("model.num_layers=2", "model.full_attention_interval=2")
  if m.layer_pattern and len(m.layer_pattern) > 2:
    return ("model.num_layers=2", "model.layer_pattern=[local,global]")
  return ()


def golden_counts(preset: str, arms: list[str] | None = None, over: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
  """{arm: {key: count}} for the named arms (all of ARMS by default), with the config overrides `over`
  (a golden file's "shrink")."""
  from meshlm.analysis.census import field
  from meshlm.config import load_config
  out = {}
  for arm in ARMS if arms is None else arms:
    result = stablehlo_census(load_config(f"model={preset}", *BASE, *over, *ARMS[arm]))
    out[arm] = {k: field(result, k) for k in keys()}
  return out


def compiled_counts(result: dict[str, Any]) -> dict[str, Any]:
  """The COMPILED_KEYS fields of a full census() result."""
  from meshlm.analysis.census import field
  return {k: field(result, k) for k in COMPILED_KEYS}


def diff_counts(want: dict[str, Any], got: dict[str, Any], prefix: str = "") -> list[str]:
  """One line per differing field, dotted path first: 'explicit.stablehlo.dots: expected 30, got 31'."""
  lines = []
  for k in sorted(set(want) | set(got)):
    path = f"{prefix}{k}"
    if k not in got:
      lines.append(f"{path}: expected {want[k]!r}, missing")
    elif k not in want:
      lines.append(f"{path}: not in the golden file, got {got[k]!r}")
    elif isinstance(want[k], dict) and isinstance(got[k], dict):
      lines += diff_counts(want[k], got[k], f"{path}.")
    elif want[k] != got[k]:
      lines.append(f"{path}: expected {want[k]!r}, got {got[k]!r}")
  return lines


def mismatch_report(what: str, want: dict[str, Any], got: dict[str, Any], regen_args: str = "") -> str | None:
  """None when equal; otherwise the field-by-field diff and how to regenerate the golden file."""
  lines = diff_counts(want, got)
  if not lines:
    return None
  return "\n".join([f"{what}: {len(lines)} field(s) differ from the golden file:", *("  " + l for l in lines),
                    "If the change is intended, review it and regenerate the golden files with",
                    f"  .venv/bin/python {REGEN}{' ' + regen_args if regen_args else ''}"])


def pinned_jax_version(lock_path: str) -> str:
  """The jax version requirements.lock pins ('jax==X')."""
  with open(lock_path) as f:
    for line in f:
      m = re.match(r"\s*jax==([^\s;#]+)", line)
      if m:
        return m.group(1)
  raise ValueError(f"{lock_path}: no 'jax==VERSION' line")
