"""The instrument: HLO/StableHLO readers, census counts, detectors, compare and golden counts."""
import contextlib
import io
import json
import os
import sys

import jax
import pytest

from meshlm.analysis import census as C
from meshlm.analysis import golden
from meshlm.analysis.compare import diff_buckets, signature_buckets
from meshlm.analysis.scopes import attribute
from meshlm.config import load_config

HERE = os.path.dirname(__file__)
GOLDEN_DIR = os.path.join(HERE, "golden", "census")
COMPILED_GOLDEN = os.path.join(HERE, "golden", "compiled_census.json")
PINNED_JAX = golden.pinned_jax_version(os.path.join(HERE, "..", "requirements.lock"))
# The scanned stack, as real-size models run it (the llama2-tiny preset itself unrolls its two
# layers; its own golden counts are checked with the other presets').
LLAMA = golden.COMPILED_CONFIG
NOFLAGS = ("lm_head_weight_grad_in_kernel_order=false", "dense_weight_grad_in_kernel_order=false")

# A hand-written optimized-HLO module: an async all-gather pair and an all-reduce inside a 3-trip
# while body, a stacked loop carry with a non layer-major layout, a transpose and a copy.
HLO = """HloModule m, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[3,8,16])) -> (s32[], f32[3,8,16]) {
  %p = (s32[], f32[3,8,16]{1,0,2}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[3,8,16]{1,0,2} get-tuple-element(%p), index=1
  %ar = f32[3,8,16]{1,0,2} all-reduce(%x), replica_groups={}, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/while/body/closed_call/layers/mlp/down/dot_general"}
  ROOT %t = (s32[], f32[3,8,16]{1,0,2}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[3,8,16])) -> pred[] {
  %p = (s32[], f32[3,8,16]{1,0,2}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[4,8]) -> f32[] {
  %x = f32[4,8]{1,0} parameter(0)
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%x), dimensions={0}, metadata={op_name="jit(f)/jvp(lm_head)/dot_general"}
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %tr = f32[8,16]{1,0} transpose(%agd), dimensions={1,0}
  %cp = f32[8,16]{0,1} copy(%tr)
  %init = (s32[], f32[3,8,16]{1,0,2}) tuple(%x, %x)
  %w = (s32[], f32[3,8,16]{1,0,2}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[] constant(0)
}
"""


def test_hlo_reader_counts_async_pairs_once_and_multiplies_loops():
  counts, mod = C.hlo_counts(HLO)
  ag = counts["collectives"]["all-gather"]
  assert ag["count"] == 1 and ag["bytes"] == 16 * 8 * 4
  assert ag["calls"][0]["scope"] == "lm_head forward"
  ar = counts["collectives"]["all-reduce"]
  assert ar["count"] == 3 and ar["bytes"] == 3 * (3 * 8 * 16 * 4)  # trip count 3
  assert ar["calls"][0]["scope"] == "layers/mlp/down backward"
  assert counts["transposes"] == 1 and counts["copies"] == 1
  assert counts["while_loops"] == [{"trip_count": 3, "scope": "other"}]
  flags = C.scan_layout_flags(mod)
  assert [f["array"] for f in flags] == ["f32[3,8,16]{1,0,2}"]


# Two sibling while bodies in one function that reuse the value name %2, as JAX >= 0.11 prints scan
# bodies inlined into main: a dot then its transpose in the first, an add then a transpose in the second.
SIBLINGS = """module @m {
  func.func public @main(%arg0: tensor<4x8xf32>) -> tensor<8x4xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32> loc(#loc0)
%WHILE0
%WHILE1
    return %arg0 : tensor<4x8xf32> loc(#loc0)
  } loc(#loc0)
}
#loc0 = loc(unknown)
"""
_WHILE = """    %R:2 = stablehlo.while(%iterArg = %c, %iterArg_1 = %arg0) : tensor<i32>, tensor<4x8xf32>
    cond {
      %c_2 = stablehlo.constant dense<3> : tensor<i32> loc(#loc0)
      %2 = stablehlo.compare LT, %iterArg, %c_2, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1> loc(#loc0)
      stablehlo.return %2 : tensor<i1> loc(#loc0)
    } do {
      %2 = OP
      %3 = stablehlo.transpose %2, dims = [1, 0] : (tensor<4x8xf32>) -> tensor<8x4xf32> loc(#loc0)
      stablehlo.return %iterArg, %iterArg_1 : tensor<i32>, tensor<4x8xf32> loc(#loc0)
    } loc(#loc0)"""
_DOT = "stablehlo.dot_general %iterArg_1, %iterArg_1, contracting_dims = [] x [] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc(#loc0)"
_ADD = "stablehlo.add %iterArg_1, %iterArg_1 : tensor<4x8xf32> loc(#loc0)"


def test_stablehlo_reader_resolves_a_value_in_its_own_region():
  text = (SIBLINGS.replace("%WHILE0", _WHILE.replace("%R", "%0").replace("OP", _DOT))
          .replace("%WHILE1", _WHILE.replace("%R", "%1").replace("OP", _ADD)))
  counts, pairs, mod = C.stablehlo_counts(text)
  assert [(p["kind"], p["shape"]) for p in pairs] == [("adjacent", [8, 4])]  # the first body's; not the add's
  # Control: with the bodies swapped the one pair is the second body's.
  swapped = (SIBLINGS.replace("%WHILE0", _WHILE.replace("%R", "%0").replace("OP", _ADD))
             .replace("%WHILE1", _WHILE.replace("%R", "%1").replace("OP", _DOT)))
  assert len(C.stablehlo_counts(swapped)[1]) == 1
  # A block argument has no defining op where it is used.
  transpose = [op for op in mod.ops if op.name == "stablehlo.transpose"][0]
  assert mod.def_of("main", "%iterArg_1", at=transpose) is None


def test_attribution_names_the_layer_and_direction():
  assert attribute("jit(<lambda>)/transpose(jvp(lm_head))/dot_general") == "lm_head backward"
  assert attribute("jit(<lambda>)/jvp()/while/body/closed_call/layers/mlp/mlp/down/btf,fd->btd/dot_general") \
      == "layers/mlp/down forward"
  assert attribute("jit(<lambda>)/reduce_sum") == "other"
  # JAX 0.12 puts an eval_jaxpr frame in front of the scopes.
  assert attribute("jit(<lambda>)/eval_jaxpr/transpose(jvp(layers/mlp/down))/dot_general") == "layers/mlp/down backward"
  # A custom VJP's backward that transposes a function traced under its call's scopes (the fused GLU-down's) repeats
  # them: the kernel's own scope once; scopes that differ stay.
  assert attribute("jit(step)/transpose(jvp())/while/body/eval_jaxpr/layers/mlp/moe/experts/down/transpose(experts)/"
                   "down/jvp()/dot_general") == "layers/mlp/moe/experts/down backward"
  assert attribute("jit(f)/layers/attn/q/attn/k/dot_general") == "layers/attn/q/attn/k forward"


def test_signature_diff_lists_only_differing_buckets():
  a = signature_buckets(HLO)
  b = signature_buckets(HLO.replace("%cp = f32[8,16]{0,1} copy(%tr)", "%cp = f32[8,16]{1,0} negate(%tr)"))
  diff = diff_buckets({"a": a, "b": b})
  assert {d["signature"]: d["counts"] for d in diff} == {"copy f32[8,16]{0,1}": {"a": 1, "b": 0},
                                                         "negate f32[8,16]{1,0}": {"a": 0, "b": 1}}


@pytest.fixture(scope="module")
def lowered():
  """StableHLO census of llama2-tiny (fsdp=4) in the arms the issue names; lowering only."""
  arms = {"explicit": ("shard_mode=explicit",), "explicit-noflags": ("shard_mode=explicit",) + NOFLAGS,
          "auto": ("shard_mode=auto",),
          "auto-flags-on": ("shard_mode=auto", "dense_weight_grad_in_kernel_order=true",
                            "lm_head_weight_grad_in_kernel_order=true")}
  return {name: golden.stablehlo_census(load_config(*LLAMA, *o)) for name, o in arms.items()}


def test_explicit_without_flags_blocks_weight_gradient_transposes(lowered):
  r = lowered["explicit-noflags"]
  assert C.field(r, "stablehlo.transpose_of_dot.blocked") > 0
  # Every dense weight gradient: 6 per layer (q k v gate up down; scanned, so once) plus the LM
  # head. The output projection runs inside the attention's auto-axes region, where its gradient
  # comes out in kernel order with or without the flags.
  assert C.field(r, "stablehlo.transpose_of_dot.weight_grad.blocked") == 7
  scopes = {p["scope"] for p in _pairs(r) if p["weight_grad"]}
  assert "lm_head backward" in scopes and "layers/mlp/down backward" in scopes


def _pairs(result):
  return result["stablehlo"]["transpose_of_dot"]["pairs"]


def test_default_flags_leave_no_blocked_weight_gradient(lowered):
  r = lowered["explicit"]
  assert C.field(r, "stablehlo.transpose_of_dot.weight_grad.blocked") == 0
  # One weight gradient comes with a transpose, adjacent (XLA folds it): the output projection's, which runs in the
  # attention's auto-axes region (no kernel-order dense there) and contracts the core's heads-first rows.
  assert C.field(r, "stablehlo.transpose_of_dot.weight_grad.adjacent") == 1
  assert [p["scope"] for p in _pairs(r) if p["weight_grad"]] == ["layers/attn/o backward"]
  # Nothing is blocked at all: the attention einsums' own transposes sit next to their dots
  # inside the attention's auto-axes region, where XLA folds them.
  assert C.field(r, "stablehlo.transpose_of_dot.blocked") == 0
  assert {p["scope"] for p in _pairs(r)} <= {"layers/attn/attention forward", "layers/attn/attention backward",
                                             "layers/attn/o backward", "layers/attn/q forward",
                                             "layers/attn/k forward", "layers/attn/v forward"}


def test_auto_folds_and_the_flags_change_nothing(lowered):
  auto, on = lowered["auto"], lowered["auto-flags-on"]
  assert C.field(auto, "stablehlo.transpose_of_dot.weight_grad.blocked") == 0
  assert C.field(auto, "stablehlo.transpose_of_dot.blocked") == 0
  assert C.field(auto, "stablehlo.transpose_of_dot.weight_grad.adjacent") == 8  # 7 dense ones and o's
  assert auto["stablehlo"]["op_counts"] == on["stablehlo"]["op_counts"]
  assert auto["stablehlo"]["sharding_barriers"] < lowered["explicit"]["stablehlo"]["sharding_barriers"]


@pytest.fixture(scope="module")
def cli_census():
  """One full census of LLAMA through the command (`meshlm census ... --json`), compiled once."""
  from meshlm.cli import main
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert main(["census", *LLAMA, "--json"]) == 0
  return json.loads(out.getvalue())


def test_census_json_from_the_cli(cli_census):
  """DESIGN.md's field names, compiled counts, memory."""
  r = cli_census
  for f in ("stablehlo.sharding_barriers", "stablehlo.transpose_of_dot.adjacent", "stablehlo.transpose_of_dot.blocked",
            "hlo.op_counts", "hlo.copies", "hlo.transposes", "blowups", "memory"):
    assert C.field(r, f) is not None, f
  for kind in C.COLLECTIVES:
    assert set(r["hlo"]["collectives"][kind]) >= {"count", "bytes"}
  assert r["hlo"]["transposes"] == sum(v for k, v in r["hlo"]["op_counts"].items() if k == "transpose")
  assert r["memory"]["temp_size_in_bytes"] > 0 and r["cost"]["flops"] > 0
  assert r["blowups"] == [] and r["scan_layout"] == []


def test_compiled_collective_counts(cli_census):
  """The compiled step's collective counts (tests/golden/compiled_census.json), exact for the pinned JAX."""
  require_pinned_jax()
  want = golden_file(COMPILED_GOLDEN, "compiled")["counts"]
  report = golden.mismatch_report("compiled census of " + " ".join(LLAMA), want, golden.compiled_counts(cli_census),
                                  "compiled")
  if report:
    pytest.fail(report, pytrace=False)
  # And what the golden number means: fsdp=4 all-gathers every kernel forward and backward, 6 per
  # layer x 2 passes x 2 layers, the query kernel's stack once before the layers (gather-once),
  # then head + embed.
  assert want["hlo.collectives.all-gather.count"] == 6 * 2 * 2 + 1 + 2


def test_compare_rejects_bad_arms_before_compiling(capsys):
  from meshlm.cli import main
  assert main(["compare", *LLAMA, "--arm", "a:shard_mode=auto", "--arm", "a:shard_mode=explicit"]) == 2
  assert "--arm a: duplicate arm name" in capsys.readouterr().err
  assert main(["compare", *LLAMA, "--arm", "a:shard_mode=auto", "--arm", "b:shard_mod=explicit"]) == 2
  assert "--arm b: shard_mod: unknown key" in capsys.readouterr().err
  assert main(["compare", *LLAMA, "--arm", "a:shard_mode=auto"]) == 2
  assert "need at least 2 arms" in capsys.readouterr().err


# --- golden counts -------------------------------------------------------------------------------
# The counts are the pinned JAX's (requirements.lock). On another JAX the comparisons skip, saying
# so: a different JAX lowers differently, which says nothing about meshlm, and a red suite on every
# unpinned install would teach people to ignore it. The pinned environment (`make setup`, CI) runs
# them, and test_golden_files_are_for_the_pinned_jax holds the files to the lock on any JAX.
# A file's "shrink" overrides (scripts/regen_golden_census.py) count the GDN hybrids and gemma3 on one
# period of two layers: every layer kind and attention context, a fraction of the layer bodies to lower.

def require_pinned_jax() -> None:
  if jax.__version__ != PINNED_JAX:
    pytest.skip(f"the golden census counts are for jax=={PINNED_JAX} (requirements.lock), this is jax "
                f"{jax.__version__}: run `make setup` to check them")


def test_golden_comparisons_skip_on_another_jax(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.0.0")
  with pytest.raises(pytest.skip.Exception, match=rf"golden census counts are for jax=={PINNED_JAX} "
                                                   r"\(requirements.lock\), this is jax 0.0.0"):
    require_pinned_jax()
  monkeypatch.setattr(jax, "__version__", PINNED_JAX)
  require_pinned_jax()  # does not skip


def golden_file(path: str, regen_arg: str) -> dict:
  if not os.path.exists(path):
    pytest.fail(f"no golden file {os.path.relpath(path, HERE)}: run .venv/bin/python {golden.REGEN} {regen_arg}",
                pytrace=False)
  with open(path) as f:
    return json.load(f)


def _golden_presets():
  return golden.tiny_presets()


def _preset_file(preset: str) -> dict:
  return golden_file(os.path.join(GOLDEN_DIR, f"{preset}.json"), preset)


@pytest.mark.parametrize("preset", _golden_presets())
def test_golden_census_counts(preset):
  require_pinned_jax()
  doc = _preset_file(preset)
  want = doc["counts"]
  report = golden.mismatch_report(f"{preset} golden census", want, golden.golden_counts(preset, over=tuple(doc.get("shrink", []))), preset)
  if report:
    pytest.fail(report, pytrace=False)
  for arm in want.values():
    assert arm["blowups"] == 0


def test_golden_files_are_for_the_pinned_jax():
  """Every golden file was written with the JAX that requirements.lock pins, for today's arms."""
  docs = {p: _preset_file(p) for p in _golden_presets()}
  docs["compiled"] = golden_file(COMPILED_GOLDEN, "compiled")
  stale = [name for name, doc in docs.items() if doc.get("jax") != PINNED_JAX]
  assert not stale, (f"golden files {stale} were not written with jax=={PINNED_JAX} (requirements.lock): "
                     f"regenerate them with .venv/bin/python {golden.REGEN}")
  for p in _golden_presets():
    assert docs[p]["arms"] == {k: list(v) for k, v in golden.ARMS.items()}, f"{p}: arms changed; run {golden.REGEN}"
    assert docs[p]["base"] == list(golden.BASE), f"{p}: base changed; run {golden.REGEN}"
    # A shrunk preset keeps every layer kind (and every attention context) of the preset as shipped.
    from meshlm.models.decoder import plan
    full, shrunk = plan(load_config(f"model={p}")), plan(load_config(f"model={p}", *docs[p].get("shrink", [])))
    assert set(zip(shrunk.kinds, shrunk.contexts)) == set(zip(full.kinds, full.contexts)), p
  assert docs["compiled"]["config"] == list(golden.COMPILED_CONFIG)


def test_auto_axes_arm_differs_from_the_plain_path():
  """weight_grad_impl=auto_axes removes the blocked weight-gradient transposes the plain explicit
  path has, in every preset, so a silent fallback to the plain path cannot match its golden arm."""
  for p in _golden_presets():
    arms = _preset_file(p)["counts"]
    plain, auto_axes = arms["explicit-noflags"], arms["explicit-auto_axes"]
    assert plain["stablehlo.transpose_of_dot.weight_grad.blocked"] > 0, p
    assert auto_axes["stablehlo.transpose_of_dot.weight_grad.blocked"] == 0, p


def test_mismatch_report_names_each_field_and_the_script():
  want = {"explicit": {"stablehlo.dots": 30, "blowups": 0}, "auto": {"stablehlo.dots": 30}}
  assert golden.mismatch_report("x", want, json.loads(json.dumps(want))) is None
  got = {"explicit": {"stablehlo.dots": 31, "blowups": 0}, "explicit-auto_axes": {"stablehlo.dots": 30}}
  report = golden.mismatch_report("llama2-tiny golden census", want, got, "llama2-tiny")
  assert report.splitlines() == [
      "llama2-tiny golden census: 3 field(s) differ from the golden file:",
      "  auto: expected {'stablehlo.dots': 30}, missing",
      "  explicit.stablehlo.dots: expected 30, got 31",
      "  explicit-auto_axes: not in the golden file, got {'stablehlo.dots': 30}",
      "If the change is intended, review it and regenerate the golden files with",
      f"  .venv/bin/python {golden.REGEN} llama2-tiny"]
  assert os.path.exists(os.path.join(HERE, "..", golden.REGEN))


def test_pinned_jax_version_reads_the_lock(tmp_path):
  lock = tmp_path / "requirements.lock"
  lock.write_text("jaxlib==9.9.9\njax==0.10.2\nnumpy==2.0\n")
  assert golden.pinned_jax_version(str(lock)) == "0.10.2"
  lock.write_text("jaxlib==0.10.2\n")
  with pytest.raises(ValueError, match="no 'jax==VERSION' line"):
    golden.pinned_jax_version(str(lock))


# --- controls: bugs the golden census must catch ------------------------------------------------

def _patch_dense(monkeypatch, wrap) -> list:
  """Replaces the dense primitive everywhere meshlm holds it (modules import it by name) with
  wrap(dense); returns a list that records each call, to prove the patch was traced."""
  import importlib
  original, calls = importlib.import_module("meshlm.nn.dense").dense, []
  patched = wrap(original, calls)
  holders = [m for name, m in list(sys.modules.items())
             if name.startswith("meshlm") and getattr(m, "dense", None) is original]
  assert holders
  for m in holders:
    monkeypatch.setattr(m, "dense", patched)
  return calls


def _control_counts(monkeypatch, wrap, arm: str) -> tuple[dict, list]:
  calls = _patch_dense(monkeypatch, wrap)
  try:
    got = golden.golden_counts("llama2-tiny", [arm])
  finally:
    monkeypatch.undo()
    jax.clear_caches()  # nothing traced with the bug may be reused
  return got, calls


def test_a_silent_auto_axes_fallback_fails_the_golden_census(monkeypatch):
  """dense falling back to the plain path under weight_grad_impl=auto_axes: the auto_axes arm's counts
  become the plain path's, and the golden comparison reports it."""
  require_pinned_jax()
  def fall_back(dense, calls):
    def plain(x, kernel, eqn, out_axes, *, kernel_order=False, impl="custom_vjp", **kw):
      calls.append(impl)
      return dense(x, kernel, eqn, out_axes, kernel_order=kernel_order and impl != "auto_axes", impl=impl, **kw)
    return plain
  got, calls = _control_counts(monkeypatch, fall_back, "explicit-auto_axes")
  assert "auto_axes" in calls
  want = _preset_file("llama2-tiny")["counts"]
  report = golden.mismatch_report("llama2-tiny golden census", {"explicit-auto_axes": want["explicit-auto_axes"]}, got)
  assert report is not None
  assert "explicit-auto_axes.stablehlo.transpose_of_dot.weight_grad.blocked: expected 0, got " in report
  assert golden.REGEN in report
  assert got["explicit-auto_axes"] == want["explicit-noflags"]


def test_a_wrong_out_sharding_fails_the_golden_census(monkeypatch):
  """A layout-only bug: every dense output loses its batch sharding (so each device computes the whole
  batch's projection). Values are unchanged, so the explicit-vs-auto loss parity cannot see it; the
  golden census's sharding counts do. (A transposed out_sharding is refused outright under explicit:
  tracing raises ShardingTypeError at the next elementwise op.)"""
  require_pinned_jax()
  def replicated(dense, calls):
    def wrong(x, kernel, eqn, out_axes, **kw):
      calls.append(eqn)
      return dense(x, kernel, eqn, tuple(None if a == "batch" else a for a in out_axes), **kw)
    return wrong
  got, calls = _control_counts(monkeypatch, replicated, "explicit")
  assert calls
  want = _preset_file("llama2-tiny")["counts"]
  report = golden.mismatch_report("llama2-tiny golden census", {"explicit": want["explicit"]}, got)
  assert report is not None and "explicit.stablehlo.sharding_barriers: expected " in report, report


@pytest.mark.slow
def test_kernel_order_numerics_20_steps(tmp_path):
  """float32, 20 steps: auto_axes is bit-identical to the flags off; custom_vjp differs only by
  reassociation of the dW sum (measured 4.8e-7 on CPU, JAX 0.10.2)."""
  import numpy as np
  from meshlm.train.loop import train
  base = (*LLAMA, "train.steps=20", "train.sample_tokens=0", "train.compute_dtype=float32", "data.source=synthetic")
  losses = {}
  for name, extra in {"off": NOFLAGS, "auto_axes": ("weight_grad_impl=auto_axes",),
                      "custom_vjp": ("weight_grad_impl=custom_vjp",)}.items():
    cfg = load_config(*base, *extra, f"run_dir={tmp_path / name}")
    assert cfg.shard_mode == "explicit"
    losses[name] = np.asarray(train(cfg, show_progress=False).losses)
  assert len(losses["off"]) == 20 and np.all(np.isfinite(losses["off"]))
  np.testing.assert_array_equal(losses["auto_axes"], losses["off"])
  diff = np.max(np.abs(losses["custom_vjp"] - losses["off"]))
  print(f"custom_vjp vs flags off, max |loss diff| over 20 steps: {diff:.3g}")
  assert diff <= 1e-5
