"""Every registered attention part under every attention core, from the registry: one row per (part, core).

The parts: every part of models/registry.PARTS that attends over earlier keys (Instrument.attention_width set), so
a part an author registers gets its rows with no list kept here. Each runs in the tiny preset that exercises most
of its features (a sliding window, the logit soft-cap, q/k norms; then the fewest parts with side outputs or model
state; then the first by name), cut to one layer of the kind that runs the part, a vocabulary of 128, float32, with its window
pulled in to 2 + 2 x the flash block (the window's lower edge then falls on a block's last key) and its soft-cap to
1.0 where the preset has them. The cores, each against the `xla` core (the materialized
mask) on the same parameters and batch:

- flash: one device, T = 37 (odd), the kernel's block 8: five blocks, the last ragged (37 = 4 x 8 + 5);
- splash: one device, T = 37, Pallas interpret mode (the sequence padded to the kernel's 128 lanes inside);
- ring: mesh.context=2 (explicit), T = 36 (ring needs 2 x context whole chunks: chunks of 9, the block 4, so every
  chunk's last block is ragged; a family whose parts need longer shards, GDN's chunk, the least T above that
  fits, with a block that leaves the chunk ragged); its xla reference is the unsharded model at the same T.

Every row: packed documents (two rows of two and three documents, padding after the last), the logits of the real
positions and the gradient of every parameter leaf within ATOL of the leaf's largest entry. One compiled program
per row (the forward and the loss's gradients), the parameters and the batch shared by the part's rows.

Control (test_a_part_whose_transform_depends_on_the_core_fails_its_row): a throwaway part, registered for the test,
whose q/k norm normalizes over the wrong axes (positions and head dims of the heads-first rows) everywhere but
under the xla core, as a second copy of a transform written for one core would: its rows fail, each naming the core.
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

from meshlm.analysis.golden import shrink, tiny_presets
from meshlm.config import load_config
from meshlm.models import decoder, registry
from meshlm.models.mixers import gqa
from meshlm.models.params import (init_model_state, init_params, merge_state, model_state_shardings,
                                  param_shardings)
from meshlm.nn import attention as A, gather_once
from meshlm.nn.rope import apply_rope
from meshlm.parallel.mesh import make_mesh
from meshlm.train.step import grads_and_loss
from seams import packed_batch, placed_batch

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


def _one_layer(preset: str) -> tuple[str, ...]:
  """Overrides that leave one layer, of the kind that attends (a local one where the preset has a window): the
  cheapest program that still runs the preset's attention part with its features."""
  m = load_config(f"model={preset}").model
  keys = ("model.num_layers=1",)
  if m.layer_pattern and m.sliding_window is not None:
    keys += ("model.layer_pattern=[local]",)
  if m.full_attention_interval:
    keys += ("model.full_attention_interval=1",)
  if m.first_k_dense_replace:
    keys += ("model.first_k_dense_replace=1",)
  return keys


def _plan_parts(keys: tuple[str, ...]) -> list:
  """The parts of the layers a config runs."""
  cfg = load_config(*keys)
  fam = registry.family(cfg)
  return [p for kind in set(fam.layer_plan(cfg.model).kinds) for p in fam.kinds[kind].parts]


def _candidate(preset: str, part: str):
  """(rank, keys) of a preset for a part's rows (None when its family does not run the part): the most features
  (window, soft-cap, q/k norms) first, then the fewest parts with side outputs or model state (MoE's routing), then
  the name; its keys one layer of the attending kind (_one_layer), or golden.shrink's where that loses the part."""
  for keys in ((f"model={preset}", *_one_layer(preset)), (f"model={preset}", *shrink(preset))):
    try:
      parts = _plan_parts(keys)
    except Exception:  # a one-layer override the family refuses
      continue
    if any(p.name == part for p in parts):
      m = load_config(*keys).model
      features = sum(x not in (None, False) for x in (m.sliding_window, m.attn_logit_softcap, m.qk_norm))
      return (-features, sum(bool(p.side_names) or p.model_state is not None for p in parts), preset), keys
  return None


@functools.cache
def part_keys(part: str) -> tuple[str, ...]:
  """The config keys of a part's rows: the best tiny preset for it (_candidate), float32, a vocabulary of 128, its
  window and soft-cap pulled in where it has them."""
  found = sorted(c for p in tiny_presets() if (c := _candidate(p, part)) is not None)
  assert found, f"part {part!r}: no tiny preset's family runs it (tests/test_conformance.py asks one of a family)"
  keys = found[0][1]
  m = load_config(*keys).model
  keys += ("model.vocab_size=128", "train.compute_dtype=float32", "train.per_device_batch_size=1")
  if m.sliding_window is not None:
    keys += (f"model.sliding_window={WINDOW}",)
  if m.attn_logit_softcap is not None:
    keys += (f"model.attn_logit_softcap={SOFTCAP}",)
  return keys


def _batch(vocab: int, T: int) -> dict:
  """Two rows of packed documents (documents across flash's blocks and the ring's chunks), padding after the last."""
  return packed_batch(vocab, T, ((0, 12, T - 7, T), (0, 3, T - 4)))


@functools.cache
def _params(keys: tuple[str, ...]):
  """(parameters, model state) as numpy, seed 0."""
  cfg = load_config(*keys, *REFERENCE)
  mesh = make_mesh(cfg)
  return tuple(jax.tree.map(np.asarray, init(cfg, jax.random.key(0), mesh)) for init in (init_params, init_model_state))


@functools.cache
def run(keys: tuple[str, ...], T: int, core_keys: tuple[str, ...]):
  """(logits of the real positions, {leaf path: gradient}) as numpy: the model's forward over the packed batch and
  the gradient of sum(logits x a fixed cotangent, zero on the padding) for every parameter, one jit (one forward
  traced), under the row's mesh; flash and ring at their test blocks."""
  cfg = load_config(*keys, f"train.seq_len={T}", *core_keys)
  # flash at its test block; ring at one that leaves each chunk (T / 2 context) a ragged last block.
  chunk = T // (2 * cfg.mesh.context)
  block = FLASH_BLOCK if cfg.mesh.context == 1 else RING_BLOCK if chunk % RING_BLOCK else RING_BLOCK + 1
  cfg = load_config(*keys, f"train.seq_len={T}", *core_keys, f"flash_block={block}")
  registry.validate(cfg)
  mesh = make_mesh(cfg)
  params, state = _params(keys)
  p = jax.device_put(params, param_shardings(cfg, mesh))
  state = jax.device_put(state, model_state_shardings(cfg, mesh)) if state else {}
  batch = _batch(cfg.model.vocab_size, T)
  real = batch["segment_ids"] > 0
  ct = np.random.default_rng(1).standard_normal(real.shape + (cfg.model.vocab_size,)).astype(np.float32)
  ct = ct * real[..., None]
  with jax.set_mesh(mesh):
    put = placed_batch(mesh, batch)

    def step(p, state, b, ct):
      def f(p):
        logits = decoder.forward(cfg, merge_state(p, state), b["inputs"], b["positions"], b["segment_ids"])
        return jnp.sum(logits * jax.sharding.reshard(ct, jax.typeof(logits).sharding.spec)), logits
      return jax.grad(f, has_aux=True)(p)
    grads, logits = jax.jit(step)(p, state, put, ct)
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  return np.asarray(logits)[real], {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def relative_errors(got, want) -> dict[str, float]:
  """max |got - want| / max |want| of the logits and of each gradient leaf."""
  def rel(a, b):
    return float(np.max(np.abs(a - b))) / (float(np.max(np.abs(b))) or 1.0)
  assert got[1].keys() == want[1].keys()
  return {"logits": rel(got[0], want[0]), **{k: rel(got[1][k], want[1][k]) for k in want[1]}}


def ring_length(keys: tuple[str, ...]) -> int:
  """The ring rows' T: RING_T, or the least multiple of the context shards times what the family's parts need of
  a shard's length (Part.mesh.shard_multiple: GDN's chunk) at or above it."""
  cfg = load_config(*keys, *CORES["ring"][1])
  fam = registry.get(cfg.model.family)
  n = cfg.mesh.context
  step = math.lcm(2 * n, *(n * p.mesh.shard_multiple(cfg.model) for kind in fam.kinds.values() for p in kind.parts))
  return -(-RING_T // step) * step


def check_row(part: str, core: str, keys: tuple[str, ...] | None = None) -> dict[str, float]:
  """The row's errors; an AssertionError naming the part, the core and the leaves outside ATOL."""
  keys = part_keys(part) if keys is None else keys
  T, core_keys = CORES[core]
  T = ring_length(keys) if T is None else T
  errs = relative_errors(run(keys, T, core_keys), run(keys, T, REFERENCE))
  bad = {k: f"{v:.3g}" for k, v in errs.items() if not v < ATOL}
  assert not bad, f"part {part!r} under the {core} core differs from the xla core: {bad}"
  assert len(errs) > 5, errs  # the logits and every parameter's gradient
  return errs


ROWS = [pytest.param(part, core, id=f"{part}-{core}") for part in attention_parts() for core in CORES]


@pytest.mark.parametrize("part, core", ROWS)
def test_every_attention_part_equals_xla_under_every_core(part, core):
  errs = check_row(part, core)
  print(f"{part} ({part_keys(part)[0]}) under {core}: max relative |diff| {max(errs.values()):.3g} over "
        f"{len(errs) - 1} gradient leaves and the logits")


def test_the_rows_come_from_the_registry():
  parts = attention_parts()
  assert {"gqa", "gated_gqa", "mla"} <= set(parts) and "gdn" not in parts and "moe" not in parts
  assert {r.values[0] for r in ROWS} == set(parts) and {r.values[1] for r in ROWS} == set(CORES)
  assert part_keys("gqa")[:3] == ("model=gemma2-tiny", "model.num_layers=1", "model.layer_pattern=[local]")
  assert f"model.sliding_window={WINDOW}" in part_keys("gqa") and f"model.attn_logit_softcap={SOFTCAP}" in part_keys("gqa")


# --- the control: a part whose q/k transform differs under one core ---------------------------------------------


def _skewed_apply(p, x_BTD, ctx, state=None):
  """gqa's apply with q/k norms that, off the xla core, normalize the heads-first rows [B, N, T, H] over positions
  and head dims (a transform written twice, once wrong); under xla, over the head dims (gqa's)."""
  if ctx.core.dense_mask:
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
  cos, sin = ctx.here.rope[m.head_dim]
  y, update = gqa.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, p["o"].astype(dt), ctx, state)
  return y, update, {}


def skewed_gqa():
  """The throwaway part (registered as tests/test_attention_conformance.py:skewed_gqa)."""
  return dataclasses.replace(gqa.gqa(), name="skewed_gqa", apply=_skewed_apply)


def test_a_part_whose_transform_depends_on_the_core_fails_its_row(monkeypatch):
  """The throwaway part in qwen3-tiny's family (q/k norms; no window, so the row is cheap): its flash row fails,
  naming the core (gqa itself passes its flash row above)."""
  qwen3 = registry.get("qwen3")
  kinds = {n: dataclasses.replace(k, mixer=skewed_gqa()) for n, k in qwen3.kinds.items()}
  module = types.ModuleType("skewed_family")
  module.FAMILY = dataclasses.replace(qwen3, name="skewed", kinds=kinds)
  monkeypatch.setitem(sys.modules, "skewed_family", module)
  monkeypatch.setitem(registry.FAMILIES, "skewed", "skewed_family")
  monkeypatch.setitem(registry.PARTS, "skewed_gqa", "test_attention_conformance:skewed_gqa")
  assert "skewed_gqa" in attention_parts()  # a registered part is picked up
  base = ("model=qwen3-tiny", "model.num_layers=1", "model.vocab_size=128", "train.compute_dtype=float32",
          "train.per_device_batch_size=1")
  with pytest.raises(AssertionError, match=r"part 'skewed_gqa' under the flash core differs from the xla core"):
    check_row("skewed_gqa", "flash", (*base, "model.family=skewed"))
