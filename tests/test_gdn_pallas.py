"""gdn_impl=pallas: the Gated DeltaNet Pallas kernels (nn/gdn_pallas.py), run here in Pallas interpret mode, against
the recurrence (nn/gdn.gated_delta_rule_reference) and the chunked JAX rule: outputs, final states and every gradient
(q, k, v, g, beta, initial state) at ragged lengths, packed rows and head groups, float32 and bfloat16, with a
negative control (the resets dropped); the key's resolution and reports; and the kernels compiled for TPU through
libtpu (the Mosaic custom calls, which analysis/cost.py counts). Every GDN family training under pallas to the losses
of jax, the kernel in its shard_map on fsdp=2 and under remat: tests/test_conformance.py's real-run rows.

Interpret mode is slow (seconds per program): three kernel programs carry the features between them, each compiled
once per process (module caches)."""
from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.errors import ConfigError
from meshlm.models import registry
from meshlm.nn import gdn, gdn_pallas

from test_gdn import rel_err, rule_inputs

# Float32, max |kernel - reference| / max |reference| per array (o, final state, dq, dk, dv, dg, dbeta, d initial
# state): the chunks sum in another order than the recurrence (and the inverse is another algorithm than the chunked
# rule's). Measured at most 7.5e-7 over the cases below; dropping the resets moves o alone by 0.1 or more.
KERNEL_RTOL = 5e-6
# bfloat16 inputs: every product on bf16 operands (the state and the float32 terms rounded as they enter one), against
# the recurrence in float32 on the same (bf16) inputs. Measured at most 6.7e-3 (o, itself rounded to bf16); the float32
# cases' reset control misses by 0.1 or more.
BF16_RTOL = 2e-2
NAMES = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state")

# name: (T, chunk, K, N, dtype, packed rows, initial state, value heads per grid step). T = 37 in chunks of 16: a
# ragged last chunk of 5; the packed row resets inside chunk 0 (5), on the chunk edge (16), inside chunk 1 (23) and in
# the ragged chunk (34), then a padding tail. T = 100 in chunks of 32 without segment ids or an initial state (the
# None paths).
CASES = {
    "packed_groups_f32": (37, 16, 2, 4, jnp.float32, True, True, 2),  # G = 2, one key head a step: two tiles
    "plain_f32": (100, 32, 2, 2, jnp.float32, False, False, 8),  # G = 1, both heads in one step
    "packed_bf16": (37, 16, 1, 4, jnp.bfloat16, True, True, 8),  # G = 4
}


def packed_ids(T: int) -> jax.Array:
  """Row 0: one document, then padding (0) from 33. Row 1: documents from 0, 5, 16, 23 and 34 (ids 1..5)."""
  ids = np.ones((2, T), np.int32)
  ids[0, 33:] = 0
  for i, start in enumerate((5, 16, 23, 34)):
    ids[1, start:] = i + 2
  return jnp.asarray(ids)


def case_inputs(case: str):
  """(q, k, v, g, beta, initial state), cotangents (o, final state), segment ids: in the case's dtype (q, k, v).
  Row 0's positions 10 to 13 neither decay nor write (g = beta = 0: a right-padded prompt's tail in prefill)."""
  T, _, K, N, dtype, packed, _, _ = CASES[case]
  (q, k, v, g, beta, s0), cots = rule_inputs(T, k_heads=K, n=N)
  g, beta = np.array(g), np.array(beta)  # in numpy: an eager jnp update would compile a program per shape
  g[0, 10:14], beta[0, 10:14] = 0.0, 0.0
  g, beta = jnp.asarray(g), jnp.asarray(beta)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  return (q, k, v, g, beta, s0), (cots[0].astype(dtype), cots[1]), packed_ids(T) if packed else None


def _value_and_grads(rule, case: str):
  """(o, final state, and the gradients w.r.t. q, k, v, g, beta, initial state) of `rule` on the case, as float32."""
  args, cots, ids = case_inputs(case)
  with_state = CASES[case][6]

  def run(args, cots):
    def f(q, k, v, g, beta, s0):
      return rule(q, k, v, g, beta, segment_ids_BT=ids, initial_state_BNHJ=s0 if with_state else None)
    (o, S), vjp = jax.vjp(f, *args)
    return tuple(x.astype(jnp.float32) for x in (o, S, *vjp(cots)))
  return jax.jit(run)(args, cots)


def pallas_rule(case: str, inverse: str = "split"):
  return functools.partial(gdn_pallas.gated_delta_rule_pallas, chunk_size=CASES[case][1],
                           heads_per_step=CASES[case][7], inverse=inverse)


@functools.cache
def kernel(case: str, inverse: str = "split"):
  return _value_and_grads(pallas_rule(case, inverse), case)


@functools.cache
def reference(case: str):
  """The recurrence in float32 on the case's inputs (bf16 ones upcast: the same values)."""
  def rule(q, k, v, *rest, **kw):
    o, S = gdn.gated_delta_rule_reference(*(x.astype(jnp.float32) for x in (q, k, v)), *rest, **kw)
    return o.astype(v.dtype), S
  return _value_and_grads(rule, case)


def errors(got, want) -> dict[str, float]:
  return {name: rel_err(a, b) for name, a, b in zip(NAMES, got, want)}


def assert_close(got, want, rtol: float, what: str) -> dict[str, float]:
  errs = errors(got, want)
  bad = {k: v for k, v in errs.items() if not v <= rtol}
  assert not bad, f"{what}: {bad} over {rtol} (all: {errs})"
  return errs


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4] == jnp.float32])
def test_kernel_equals_the_recurrence_and_the_chunked_rule(case):
  got = kernel(case)
  errs = assert_close(got, reference(case), KERNEL_RTOL, f"{case}: kernel vs recurrence")
  T, W = CASES[case][:2]
  chunked = _value_and_grads(functools.partial(gdn.gated_delta_rule_chunked, chunk_size=W), case)
  errs_chunked = assert_close(got, chunked, KERNEL_RTOL, f"{case}: kernel vs chunked")
  print(f"{case}: max relative error vs the recurrence {max(errs.values()):.2g}, vs chunked "
        f"{max(errs_chunked.values()):.2g}")


@pytest.mark.parametrize("inverse", gdn_pallas.INVERSES)
def test_bf16_inputs_are_close_to_the_recurrence(inverse):
  errs = assert_close(kernel("packed_bf16", inverse), reference("packed_bf16"), BF16_RTOL, "bf16 kernel vs recurrence")
  print(f"packed_bf16, inverse={inverse}: {errs}")


def test_a_kernel_without_resets_fails_the_check(monkeypatch):
  """Control: the segment rows computed without segment ids (no reset: documents read each other's state) fail the
  check the kernel passes, in the output and the final state."""
  real = gdn_pallas._segment_rows
  monkeypatch.setattr(gdn_pallas, "_segment_rows", lambda ids, *a: real(None, *a))
  case = "packed_groups_f32"
  broken = _value_and_grads(pallas_rule(case), case)
  with pytest.raises(AssertionError, match="over") as failed:
    assert_close(broken, reference(case), KERNEL_RTOL, f"{case} without resets")
  errs = errors(broken, reference(case))
  print(f"{case} without resets: {errs}")
  assert errs["o"] > 1e-2 and errs["final state"] > 1e-2, failed.value


# The kernel's inverse of I + A (chunk 64) against numpy's in float64, max |X - X64| / max |X64|: float32 products at
# HIGHEST measured at most 2.2e-7, bf16 inputs' three bf16 passes (inverse=split) 1.5e-5 (on A uniform in (0.9, 1):
# the entries of X alternate at 1); stopping one doubling short moves it by 0.1 or more.
INVERSE_RTOL = {jnp.float32: 1e-6, jnp.bfloat16: 5e-5}
# inverse=refine (one-pass doubling, one Newton step with a three-pass residual), chunk: bound. Measured at most 7.5e-5
# (64) and 1.7e-4 (128), both under the 2e-3 that rounding the exact inverse to bf16 costs (every use of Tm rounds it);
# the doubling alone, or the Newton step with a one-pass residual, 4e-3 or more.
REFINE_RTOL = {64: 2e-4, 128: 5e-4}


def inverse_cases(W: int):
  r = np.random.default_rng(0)
  return [np.tril(r.uniform(-0.5, 0.5, (W, W)), -1).astype(np.float32),
          np.tril(r.uniform(0.9, 1.0, (W, W)), -1).astype(np.float32)]


@pytest.mark.parametrize("dtype", list(INVERSE_RTOL))
def test_the_inverse_against_float64(dtype):
  for a in inverse_cases(64):
    want = np.linalg.inv(np.eye(64) + a.astype(np.float64))
    inverse = jax.jit(lambda x: gdn_pallas._inverse(x, dtype, "split"))
    assert rel_err(inverse(jnp.asarray(a)), want) <= INVERSE_RTOL[dtype]
    # Control: the last doubling left out (the 32 x 32 blocks' inverse only).
    short = jax.jit(lambda x: gdn_pallas._inverse(jnp.where(jnp.tri(64, k=-1, dtype=bool) & (
        jnp.arange(64)[:, None] // 32 == jnp.arange(64)[None, :] // 32), x, 0.0), dtype, "split"))
    assert rel_err(short(jnp.asarray(a)), want) > 0.1


@pytest.mark.parametrize("W", list(REFINE_RTOL))
def test_the_refined_inverse_against_float64(W, monkeypatch):
  """inverse=refine on bf16 within REFINE_RTOL; controls: without the Newton step, and with its residual in one bf16
  pass (the three-pass residual is what the step needs), it misses by 10x."""
  refine = jax.jit(lambda x: gdn_pallas._inverse(x, jnp.bfloat16, "refine"))
  one_pass = jax.jit(lambda x: gdn_pallas._inverse(x, jnp.bfloat16, "split"))  # split, its products in one pass below
  one_pass_residual = jax.jit(lambda x: gdn_pallas._inverse(x, jnp.bfloat16, "refine"))
  cases = inverse_cases(W)
  wants = [np.linalg.inv(np.eye(W) + a.astype(np.float64)) for a in cases]
  errs = [rel_err(refine(jnp.asarray(a)), want) for a, want in zip(cases, wants)]
  assert max(errs) <= REFINE_RTOL[W], errs
  monkeypatch.setattr(gdn_pallas, "_mm_split", lambda a, b, cdt: gdn_pallas._mm(a, b, jnp.bfloat16))
  for control in (one_pass, one_pass_residual):
    assert max(rel_err(control(jnp.asarray(a)), want) for a, want in zip(cases, wants)) > 10 * REFINE_RTOL[W]


def test_a_step_takes_a_tile_of_heads_mosaic_can_block():
  """key_tile: the most key heads up to HEADS_PER_STEP value heads whose blocks are whole 128-lane tiles (or every
  head); interpret mode any divisor; none past MAX_HEADS_PER_STEP (the kernel then does not fit)."""
  assert gdn_pallas.key_tile(16, 1, 128, 128) == 8 and gdn_pallas.key_tile(16, 2, 128, 128) == 4
  assert gdn_pallas.key_tile(16, 1, 64, 64) == 8 and gdn_pallas.key_tile(16, 1, 32, 32) == 8
  assert gdn_pallas.key_tile(4, 1, 32, 32) == 4 and gdn_pallas.key_tile(3, 1, 100, 100) == 3
  assert gdn_pallas.key_tile(64, 1, 100, 100) is None and not gdn_pallas.fits(64, 64, 100, 100, 64)
  assert gdn_pallas.key_tile(2, 2, 8, 8, heads_per_step=2, lanes=False) == 1
  assert gdn_pallas.fits(16, 16, 128, 128, 64) and not gdn_pallas.fits(16, 16, 128, 128, 8)


def test_the_key_resolves_per_platform_and_is_reported():
  from meshlm.analysis.census import config_summary
  from meshlm.models.mixers import gdn as mixer
  tiny = meshlm.load_config("model=qwen3.5-tiny")  # 2 key heads of 32: one tile of all (the whole array)
  odd = meshlm.load_config("model=qwen3.5-tiny", "model.parts.gdn.chunk_size=8")  # under Mosaic's 16 rows
  wide = meshlm.load_config("model=qwen3.5-tiny", "model.parts.gdn.key_head_dim=128",
                            "model.parts.gdn.value_head_dim=128")
  m = lambda cfg: registry.resolved(cfg).model  # noqa: E731
  assert mixer.rule_kernel(m(wide), "train", "auto", "tpu", 1) == "pallas"
  assert mixer.rule_kernel(m(wide), "train", "auto", "cpu", 1) == "jax"
  assert mixer.rule_kernel(m(wide), "prefill", "auto", "tpu", 1) == "pallas"
  assert mixer.rule_kernel(m(wide), "decode", "auto", "tpu", 1) == "reference"
  assert mixer.rule_kernel(m(wide), "train", "auto", "tpu", 2) == "jax"  # the context-parallel rule
  assert mixer.rule_kernel(m(tiny), "train", "auto", "tpu", 1) == "pallas"
  assert mixer.rule_kernel(m(odd), "train", "auto", "tpu", 1) == "jax"  # where the kernel does not take the shapes
  pallas = meshlm.load_config("model=qwen3.5-tiny", "model.parts.gdn.chunk_size=8", "gdn_impl=pallas")
  assert mixer.rule_kernel(m(pallas), "train", "pallas", "cpu", 1) == "pallas"  # interpret mode: any shapes
  with pytest.raises(ConfigError, match="gdn_impl=pallas: the TPU kernel needs"):
    mixer.rule_kernel(m(pallas), "train", "pallas", "tpu", 1)
  assert config_summary(wide, "tpu")["gdn_impl"] == "pallas" and config_summary(tiny)["gdn_impl"] == "jax"
  assert "gdn_impl" not in config_summary(meshlm.load_config("model=llama2-tiny"), "tpu")
  with pytest.raises(ConfigError, match="gdn_impl"):
    meshlm.load_config("gdn_impl=triton")


# Every GDN family training under gdn_impl=pallas to the losses of jax: tests/test_conformance.py's real-run rows
# (test_the_gdn_kernel_trains_to_the_jax_losses), whose arms run the kernel.


tpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="compiling for TPU needs libtpu")
# The kernels compiled for TPU at a small shape of the real head dims: 2 rows, 2 key heads of 4 value heads each.
TPU_SHAPE = dict(B=2, T=256, K=2, N=4, H=128, J=128, W=64)


@functools.cache
def tpu_compiled() -> str:
  """The compiled HLO of the kernels' forward and backward (bf16 q, k, v; packed rows) for one v5e chip."""
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  s = TPU_SHAPE
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1").devices
  mesh = Mesh(np.array(devices[:1]), ("data",))
  rows = NamedSharding(mesh, P())
  shapes = [((s["B"], s["T"], s["K"], s["H"]), jnp.bfloat16)] * 2 + [((s["B"], s["T"], s["N"], s["J"]), jnp.bfloat16)]
  shapes += [((s["B"], s["T"], s["N"]), jnp.float32)] * 2 + [((s["B"], s["T"]), jnp.int32)]
  args = [jax.ShapeDtypeStruct(shape, dt, sharding=rows) for shape, dt in shapes]

  def loss(q, k, v, g, beta, ids):
    o, S = gdn_pallas.gated_delta_rule_pallas(q, k, v, g, beta, segment_ids_BT=ids, chunk_size=s["W"])
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile().as_text()


@tpu
def test_the_kernels_compile_for_tpu():
  """Mosaic lowers both kernels (jax's and libtpu's of the lock): two tpu_custom_calls, named."""
  hlo = tpu_compiled()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 2
  assert gdn_pallas.FWD_NAME in hlo and gdn_pallas.BWD_NAME in hlo


@tpu
def test_the_roofline_counts_the_kernels_flops():
  """analysis/cost.gdn_flops reads each kernel's shapes from its operands: per (row, value head, chunk) the forward's
  3 [W, W] x [W, H], 2 [W, W] x [W, J] and 3 [W, H] x [H, J] products and its inverse's 2 (log2 W - 1) [W, W]
  squares, the backward's 9, 5 and 7; both counted in the step's custom-call FLOPs."""
  from meshlm.analysis import cost, hlo as H
  s = TPU_SHAPE
  W, Hd, J = s["W"], s["H"], s["J"]
  chunks = s["B"] * s["N"] * (s["T"] // W)
  want = {"fwd": chunks * (2 * (3 * W * W * Hd + 2 * W * W * J + 3 * W * Hd * J) + 4 * (int(np.log2(W)) - 1) * W ** 3),
          "bwd": chunks * 2 * (9 * W * W * Hd + 5 * W * W * J + 7 * W * Hd * J)}
  mod = H.parse(tpu_compiled())
  got = {i.name.split(".")[0].removeprefix("gdn_chunk_"): cost.gdn_flops(mod, i) for i in mod.instrs()
         if i.opcode == "custom-call" and i.name.startswith("gdn_chunk_")}
  assert got == want, (got, want)
  assert cost.custom_call_flops(mod)[0] == sum(want.values())


# --- the layer around the kernels keeps the flat layout on TPU --------------------------------------------------------

# The GDN half of one qwen3.5-tiny layer at the real head dims (8 key and 8 value heads of 128: a sublane tile of
# heads; at 2 heads XLA:TPU lays the reshape out without copies), 2 rows of 192 positions, bf16, remat=full, for one
# v5e chip: an activation of B T K H or B T N J elements copied is a relayout of a flat [B, T, heads * dim] array into
# [B, T, heads, dim] tiles (measured on the hybrid's step: 830 MiB of such copies per layer from the per-head norms'
# reshapes, none with models/mixers/gdn.py's head_sums; docs/gdn.md). About 30 s of compile each.
LAYER = ("model=qwen3.5-tiny", "model.embed_dim=256", "model.parts.gdn.key_heads=8", "model.parts.gdn.value_heads=8",
         "model.parts.gdn.key_head_dim=128", "model.parts.gdn.value_head_dim=128", "train.compute_dtype=bfloat16",
         "remat=full", "gdn_impl=pallas")
LAYER_ROWS, LAYER_T = 2, 192


def relayouts(hlo: str) -> list[str]:
  """The compiled program's copies of a per-position activation of the flat widths (B T K H or B T N J elements)."""
  import re
  sizes = {LAYER_ROWS * LAYER_T * 8 * 128}
  out = []
  for shape in re.findall(r"= (?:f32|bf16)\[([\d,]+)\]\{[^}]*\} copy\(", hlo):
    if int(np.prod([int(d) for d in shape.split(",")])) in sizes:
      out.append(shape)
  return out


def compiled_layer() -> str:
  """The GDN half of LAYER (tests/conformance.part_step: forward and backward) compiled for a v5e chip."""
  import conformance as C
  from meshlm.parallel import topology as TP
  from meshlm.parallel.mesh import make_mesh
  cfg = meshlm.load_config(*LAYER, f"train.seq_len={LAYER_T}", f"train.per_device_batch_size={LAYER_ROWS}")
  mesh = make_mesh(cfg, TP.devices(TP.parse("v5e:1x1")))
  fn, specs = C.part_step(cfg, "linear_attn", "global")
  args = C.part_arguments(cfg, specs, mesh, LAYER_T, LAYER_ROWS)
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*args).compile().as_text()


@tpu
def test_the_layer_copies_no_head_relayout_on_tpu():
  hlo = compiled_layer()
  assert gdn_pallas.FWD_NAME in hlo and gdn_pallas.BWD_NAME in hlo and relayouts(hlo) == [], relayouts(hlo)


@tpu
def test_per_head_norms_by_reshape_copy_relayouts(monkeypatch):
  """Control: the per-head norms written as a reshape to [B, T, heads, dim] (rule.l2_normalize) compile to relayout
  copies of the flat activations."""
  from meshlm.models.mixers import gdn as mixer

  def by_reshape(x_BTC, heads, eps=1e-6):
    B, T, C = x_BTC.shape
    return gdn.l2_normalize(x_BTC.reshape(B, T, heads, C // heads), eps).reshape(B, T, C)
  monkeypatch.setattr(mixer, "l2_normalize_heads", by_reshape)
  assert len(relayouts(compiled_layer())) >= 2
