"""Every tiny preset's attending part under every attention core, from the registry: one row per (preset, core).

The rows are configurations, not parts: each tiny preset (analysis/golden.tiny_presets) runs its own attending part
with its own options (q/k norms and their (1 + w) form, partial rotary, a sliding window, the logit soft-cap, query
scalars, MLA's dims, GQA ratios), so every option a preset uses meets every core, and a preset an author adds gets
its rows with no list kept here. A row runs the attending half of one layer alone, as the model runs it
(tests/conformance.py part_step: the pre-norm, the part, the residual; the parameters prepared as the layer loop
prepares them, the context the decoder makes for the batch), forward and backward, for each distinct (attending part, attention context) of the preset's plan (gemma2's and
gemma3's local and global layers apart); float32, the window pulled in to 2 + 2 x the flash block (the window's lower
edge then falls on a block's last key) and the soft-cap to 1.0 where the preset has them. The cores, each against
the `xla` core (the materialized mask) on the same parameters and inputs:

- flash: one device, T = 37 (odd), the kernel's block 8: five blocks, the last ragged (37 = 4 x 8 + 5);
- splash: one device, T = 37, Pallas interpret mode (the sequence padded to the kernel's 128 lanes inside);
- ring: mesh.context=2 (explicit), T = 36 (ring needs 2 x context whole chunks: chunks of 9, the block 4, so every
  chunk's last block is ragged); its xla reference is the same part on one device at the same T.

Every row: packed documents (two rows of two and three documents, padding after the last), the part's output at the
real positions, the gradient of its input there and of every parameter leaf, each within ATOL of its largest entry.

Control (test_a_qk_norm_broken_only_under_splash_fails_its_row_by_name): a throwaway part whose q/k norm
normalizes over the wrong axes only under the splash core, as a second copy of a transform written for one core
would: qwen3-tiny's splash row fails naming the preset and the core, its flash row passes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm import spec as S
from meshlm.analysis.golden import tiny_presets
from meshlm.config import load_config
from meshlm.models import registry
from meshlm.models.mixers import gqa
from meshlm.nn import attention as A, gather_once
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import ACT, logical_spec

import conformance as C
from seams import packed_batch

# Float32 reassociation only (blocks, an online softmax, the ring's order): measured at most 3e-6 of a leaf's largest
# entry; a core-specific slip (the control) moves some leaf by 1e-2 or more.
ATOL = 1e-5
FLASH_BLOCK, RING_BLOCK = 8, 4
WINDOW = 2 + 2 * FLASH_BLOCK  # the lower edge of a query block's window on the last key of a block (a mutation-audit miss)
SOFTCAP = 1.0
ODD_T, RING_T = 37, 36
CORES = {  # core: (T, the keys of its row)
    "flash": (ODD_T, ("cpu_devices=1", "attention_impl=flash")),
    "splash": (ODD_T, ("cpu_devices=1", "attention_impl=splash")),
    "ring": (None, ("cpu_devices=2", "mesh.context=2", "shard_mode=explicit", "attention_impl=flash",
                      "context_attention=ring")),
}
REFERENCE = ("cpu_devices=1", "attention_impl=xla")


def attention_parts() -> list[str]:
  """The registered parts that attend over earlier keys (Instrument.attention_width), in PARTS order."""
  return [name for name, part in registry.parts().items() if part.instrument.attention_width is not None]


@functools.cache
def preset_keys(preset: str) -> tuple[str, ...]:
  """A preset's row keys: float32, its window and soft-cap pulled in where it has them."""
  m = load_config(f"model={preset}").model
  keys = (f"model={preset}", "train.compute_dtype=float32", "train.per_device_batch_size=1")
  if m.sliding_window is not None:
    keys += (f"model.sliding_window={WINDOW}",)
  if m.attn_logit_softcap is not None:
    keys += (f"model.attn_logit_softcap={SOFTCAP}",)
  return keys


def _batch(T: int) -> dict:
  """Two rows of packed documents (documents across flash's blocks and the ring's chunks), padding after the last."""
  return packed_batch(2, T, ((0, 12, T - 7, T), (0, 3, T - 4)))


@functools.cache
def _inputs(keys: tuple[str, ...], kind: str, T: int):
  """(parameters, x, ct) as numpy, seed 0: the part's one-layer parameters, x [2, T, D] and a cotangent zero on
  the padding."""
  cfg = load_config(*keys, *REFERENCE)
  _, specs = C.part_step(cfg, kind, "global")
  params = jax.tree.map(np.asarray, S.init_tree(specs, jax.random.key(0), jnp.float32))
  rng = np.random.default_rng(1)
  real = _batch(T)["segment_ids"] > 0
  x, ct = (rng.standard_normal(real.shape + (cfg.model.embed_dim,)).astype(np.float32) for _ in range(2))
  return params, x, ct * real[..., None]


@functools.cache
def run(keys: tuple[str, ...], kind: str, context: str, T: int, core_keys: tuple[str, ...]):
  """(y at the real positions, {"x": dx there, leaf path: dp}) as numpy: the part of `kind` under `context` over
  the packed batch and the VJP of the fixed cotangent, one jit, under the row's mesh; flash and ring at their test
  blocks."""
  cfg = load_config(*keys, f"train.seq_len={T}", *core_keys)
  # flash at its test block; ring at one that leaves each chunk (T / 2 context) a ragged last block.
  chunk = T // (2 * cfg.mesh.context)
  block = FLASH_BLOCK if cfg.mesh.context == 1 else RING_BLOCK if chunk % RING_BLOCK else RING_BLOCK + 1
  cfg = load_config(*keys, f"train.seq_len={T}", *core_keys, f"flash_block={block}")
  registry.validate(cfg)
  mesh = make_mesh(cfg)
  fn, specs = C.part_step(cfg, kind, context)
  params, x, ct = _inputs(keys, kind, T)
  batch = _batch(T)
  put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
  with jax.set_mesh(mesh):
    p = jax.tree.map(lambda a, s: put(a, s.axes), params, specs, is_leaf=S.is_spec)
    y, dp, dx = jax.jit(fn)(p, put(x, ACT), put(batch["positions"], ACT[:2]), put(batch["segment_ids"], ACT[:2]),
                            put(ct, ACT))
  real = batch["segment_ids"] > 0
  flat = jax.tree_util.tree_flatten_with_path(dp)[0]
  return np.asarray(y)[real], {"x": np.asarray(dx)[real], **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}}


def relative_errors(got, want) -> dict[str, float]:
  """max |got - want| / max |want| of the output and of each gradient."""
  def rel(a, b):
    return float(np.max(np.abs(a - b))) / (float(np.max(np.abs(b))) or 1.0)
  assert got[1].keys() == want[1].keys()
  return {"y": rel(got[0], want[0]), **{k: rel(got[1][k], want[1][k]) for k in want[1]}}


def ring_length(keys: tuple[str, ...]) -> int:
  """The ring rows' T: RING_T, or the least multiple of the context shards times what the family's parts need of
  a shard's length (Part.mesh.shard_multiple: GDN's chunk) at or above it."""
  cfg = load_config(*keys, *CORES["ring"][1])
  fam = registry.get(cfg.model.family)
  n = cfg.mesh.context
  step = math.lcm(2 * n, *(n * p.mesh.shard_multiple(cfg.model) for kind in fam.kinds.values() for p in kind.parts))
  return -(-RING_T // step) * step


def check_row(preset: str, core: str, keys: tuple[str, ...] | None = None) -> dict[str, float]:
  """The row's errors over every (attending part, context) of the preset's plan; an AssertionError naming the
  preset, the part, the context, the core and the values outside ATOL."""
  keys = preset_keys(preset) if keys is None else keys
  T, core_keys = CORES[core]
  T = ring_length(keys) if T is None else T
  out = {}
  for kind, context in C.attending(load_config(*keys)):
    errs = relative_errors(run(keys, kind, context, T, core_keys), run(keys, kind, context, T, REFERENCE))
    bad = {k: f"{v:.3g}" for k, v in errs.items() if not v < ATOL}
    part = registry.get(load_config(*keys).model.family).kinds[kind].mixer.name
    assert not bad, f"{preset}: part {part!r} ({context} layers) under the {core} core differs from the xla core: {bad}"
    assert len(errs) > 4, errs  # the output, x's gradient and every parameter's
    out |= {f"{context}:{k}": v for k, v in errs.items()}
  return out


ROWS = [pytest.param(preset, core, id=f"{preset}-{core}") for preset in tiny_presets() for core in CORES]


@pytest.mark.parametrize("preset, core", ROWS)
def test_every_presets_attention_equals_xla_under_every_core(preset, core):
  errs = check_row(preset, core)
  print(f"{preset} under {core}: max relative |diff| {max(errs.values()):.3g} over {len(errs)} outputs and gradients")


def test_the_rows_come_from_the_registry():
  """Every tiny preset is a row under every core, and together they run every registered attending part and the
  options the presets use."""
  presets = {r.values[0] for r in ROWS}
  assert presets == set(tiny_presets()) and {r.values[1] for r in ROWS} == set(CORES)
  run_parts = {registry.get(load_config(f"model={preset}").model.family).kinds[kind].mixer.name
               for preset in presets for kind, _ in C.attending(load_config(*preset_keys(preset)))}
  assert set(attention_parts()) <= run_parts and {"gqa", "gated_gqa", "mla"} <= set(attention_parts())
  models = [load_config(*preset_keys(p)).model for p in presets]
  assert any(m.qk_norm for m in models) and any(m.partial_rotary_factor < 1 for m in models)
  assert any(m.attn_logit_softcap == SOFTCAP for m in models) and any(m.sliding_window == WINDOW for m in models)
  assert any(m.query_pre_attn_scalar for m in models) and any(m.parts.get("mla") for m in models)
  assert [c for _, c in C.attending(load_config(*preset_keys("gemma2-tiny")))] == ["local", "global"]


# --- the control: a q/k norm broken only under one core ----------------------------------------------------------


def _skewed_apply(p, x_BTD, ctx, state=None):
  """gqa's apply with q/k norms that, under the splash core, normalize the heads-first rows [B, N, T, H] over
  positions and head dims (a transform written twice, once wrong); under the others, over the head dims (gqa's)."""
  if ctx.core.name != "splash":
    return gqa.apply(p, x_BTD, ctx, state)
  m = ctx.model
  dt = x_BTD.dtype
  q_kernel = gather_once.gathered(p["q"], p["q_full"], A.Q_AXES)
  q = ctx.dense(x_BTD, q_kernel.astype(dt), "btd,dnh->bnth", A.HEADS)
  k, v = gqa.project_kv(p, x_BTD, ctx)

  def wrong_norm(w, x):  # over T and H: every position's scale leaks into every other's
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=(-2, -1), keepdims=True) + m.norm_eps) * w).astype(x.dtype)
  q, k = wrong_norm(p["q_norm"], q), wrong_norm(p["k_norm"], k)
  y, update = gqa.attend(ctx.rope(q, m.head_dim), ctx.rope(k, m.head_dim), v, p["o"].astype(dt), ctx, state)
  return y, update, {}


def skewed_gqa():
  """The throwaway part (registered as tests/test_attention_conformance.py:skewed_gqa)."""
  return dataclasses.replace(gqa.gqa(), name="skewed_gqa", apply=_skewed_apply)


def test_a_qk_norm_broken_only_under_splash_fails_its_row_by_name(monkeypatch):
  """The throwaway part in qwen3-tiny's family (q/k norms): its splash row fails, naming the preset and the core;
  its flash row passes (the norm is gqa's there), as gqa's own rows do."""
  qwen3 = registry.get("qwen3")
  kinds = {n: dataclasses.replace(k, mixer=skewed_gqa()) for n, k in qwen3.kinds.items()}
  module = types.ModuleType("skewed_family")
  module.FAMILY = dataclasses.replace(qwen3, name="skewed", kinds=kinds)
  monkeypatch.setitem(sys.modules, "skewed_family", module)
  monkeypatch.setitem(registry.FAMILIES, "skewed", "skewed_family")
  monkeypatch.setitem(registry.PARTS, "skewed_gqa", "test_attention_conformance:skewed_gqa")
  assert "skewed_gqa" in attention_parts()  # a registered part is picked up
  keys = (*preset_keys("qwen3-tiny"), "model.family=skewed")
  check_row("qwen3-tiny", "flash", keys)
  with pytest.raises(AssertionError, match=r"qwen3-tiny: part 'skewed_gqa' \(global layers\) under the splash core "
                                           r"differs from the xla core"):
    check_row("qwen3-tiny", "splash", keys)
