"""Every registered family through the public API as users call it, generated from models/registry: no list of
presets or families is kept here. tests/conformance.py holds the checks:

- on each tiny preset (the product rows, which every family needs): greedy generate (three right-padded prompts,
  past every sliding window and across a GDN chunk boundary) equals recomputing with forward, token for token,
  log-probs within 1e-5; packed documents get the logits each has alone; for MoE, generate's recorded expert ids
  fed back as forced_expert_ids give the same logits, bit for bit; and explicit equals auto over a few float32
  train steps on fsdp=4, with no blocked transpose-of-dot pair under explicit;
- on a family with a Hugging Face adapter (hf/adapters/<family>.py, which declares its model_type; a family
  without one has no HF rows and is asked for no fixture): hf.save -> hf.load keeps every leaf and the logits of
  each tiny preset bit for bit; on one HF fixture per family, hf.load -> forward matches transformers' logits and
  hf.save -> hf.load is bit for bit; for MoE, the README's calls (hf.load, forward, generate) give the same inside
  a jax.set_mesh as outside.

A family registered without what these need (a tiny preset, a part that declares neither its decode state nor
that it is position-wise; with an HF adapter, a fixture) fails test_every_family_has_what_conformance_needs,
naming what is missing.

A tiny preset's rows (marked tiny_preset) exist in every process and are a 1-device user's calls, outside any
mesh context as the README makes them: in a process of more devices on the first one (cpu_devices=1), so a part
author's `pytest tests/test_conformance.py -k <preset>` runs every row of the preset on the default 8 devices.
The fixtures' rows depend on the process's device count. With 1 device (the user's default and no cpu_devices;
tests/test_conformance_devices.py starts that process, leaving the tiny_preset rows to the suite's own process
so that none runs twice) every fixture row. With more, the MoE families' fixtures through the README's calls
(hf.load and forward, in and outside a jax.set_mesh, the logits against transformers') as a user of those
devices makes them: in the suite's 8-device process a 4-device user's (cpu_devices=4); and there explicit ==
auto for one tiny preset of every family (the first by name: llama2-tiny for llama). Under CI=true none may skip
(ci_must_run).

Measured (XLA:CPU, float32, 1 device): generate against the forward at most 1.4e-6 in log-probs, no ties; packed
against alone at most 3.9e-6 of the largest logit; fixture logits against transformers at most 3.3e-6 relative.
"""
from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import meshlm
import conformance as C
from meshlm.analysis.golden import shrink, tiny_presets
from meshlm.models import registry
from meshlm.models.ffns.moe import knobs
from meshlm.parallel import make_mesh

pytestmark = pytest.mark.ci_must_run

DEVICES = len(jax.devices())
FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FIXTURE_TOL = 1e-5  # relative, logits against transformers (test_hf holds every layer's hidden state at 3e-6)
# In the suite's 8-device process the calls are a 4-device user's (cpu_devices=4 names the first 4 devices).
USER = ("cpu_devices=4",) if DEVICES >= 4 else ()
# A tiny preset's rows are a 1-device user's in every process: with more devices, the first one.
ONE = ("cpu_devices=1",) if DEVICES > 1 else ()
TINY_PRESET = pytest.mark.tiny_preset  # the 1-device process deselects these rows: the suite's own runs them


def presets_of(family: str) -> list[str]:
  return [p for p in tiny_presets() if meshlm.load_config(f"model={p}").model.family == family]


def fixtures_of(family: str) -> list[str]:
  return sorted(p.name for p in FIXTURES.iterdir()
                if (p / "config.json").is_file() and C.family_of_fixture(str(p)) == family)


def has_hf(family: str) -> bool:
  """The family declares a Hugging Face model type: it has an adapter (hf/adapters/<family>.py), so HF rows."""
  from meshlm.hf.adapters import ADAPTERS
  return family in ADAPTERS


def replays(family: str) -> bool:
  """The family has a part whose side output a per-layer input replays (MoE's routed ids)."""
  return any(p.replay.replays for kind in registry.get(family).kinds.values() for p in kind.parts)


def preset_rows(moe_only: bool = False, hf_only: bool = False) -> list:
  """Every tiny preset (moe_only: of the MoE families; hf_only: of the families with an HF adapter), in every
  process."""
  fams = [f for f in sorted(registry.FAMILIES) if (replays(f) or not moe_only) and (has_hf(f) or not hf_only)]
  return [pytest.param(p, id=p) for f in fams for p in presets_of(f)]


def fixture_rows(moe_only: bool = False) -> list:
  """One HF fixture per family with an adapter (moe_only, and in processes of more than 1 device: of the MoE
  families)."""
  fams = [f for f in sorted(registry.FAMILIES) if replays(f) or not (moe_only or DEVICES > 1)]
  return [pytest.param(n, id=n) for f in fams for n in fixtures_of(f)[:1]]


def user_mesh():
  return make_mesh(meshlm.load_config("model=llama2-tiny", *USER))


def where():
  """The mesh context of this process's calls: none with fewer than 4 devices (the README's calls, on the default
  mesh of every device), else a jax.set_mesh of a 4-device user's default mesh."""
  return contextlib.nullcontext() if DEVICES < 4 else jax.set_mesh(user_mesh())


def elsewhere():
  """The other context, on the same mesh: a jax.set_mesh of it (fewer than 4 devices), else none."""
  return jax.set_mesh(user_mesh()) if DEVICES < 4 else contextlib.nullcontext()


@functools.cache
def preset_model(preset: str):
  cfg = meshlm.load_config(f"model={preset}", *shrink(preset), "train.compute_dtype=float32", *ONE)
  return cfg, meshlm.init_params(cfg, jax.random.key(0))


@functools.cache
def fixture_model(name: str):
  with where():
    return meshlm.hf.load(FIXTURES / name, "train.compute_dtype=float32", *USER)


@functools.cache
def sample(kind: str, name: str):
  """Greedy generate on a tiny preset (outside any mesh context) or a fixture (in this process's: where())."""
  if kind == "preset":
    return C.greedy(*preset_model(name))
  cfg, params = fixture_model(name)
  with where():
    return C.greedy(cfg, params)


# --- what a family needs ---------------------------------------------------------------------------

def missing_for(fam: str) -> list[str]:
  """What the product rows need of family `fam` and do not find, one phrase each: every family's."""
  out = []
  if not presets_of(fam):
    out.append(f"a tiny preset (src/meshlm/config/presets/<name>-tiny.yaml with model.family: {fam})")
  for kind_name, kind in registry.get(fam).kinds.items():
    for part in kind.parts:
      if part.state_spec is None and not part.position_wise:
        out.append(f"kind {kind_name!r}: part {part.name!r} declares neither its decode state (state_spec) nor "
                   "position_wise=True")
  return out


def hf_missing_for(fam: str) -> list[str]:
  """What the HF rows need of family `fam` and do not find: asked only of a family with an HF adapter."""
  if has_hf(fam) and not fixtures_of(fam):
    return ["an HF fixture (its adapter declares an HF model type; scripts/make_hf_fixtures.py writes "
            "tests/fixtures/hf/<name>/)"]
  return []


@pytest.mark.parametrize("fam", sorted(registry.FAMILIES))
def test_every_family_has_what_conformance_needs(fam):
  missing = missing_for(fam) + hf_missing_for(fam)
  assert not missing, f"family {fam!r} lacks: " + "; ".join(missing)


def test_a_family_without_what_it_needs_is_named(monkeypatch):
  """Control: a registered family with no tiny preset and a mixer declaring no decode state; with no HF adapter it
  is asked for no fixture, with one (llama's) for a fixture."""
  import dataclasses
  import types
  import sys
  llama = registry.get("llama")
  mixer = dataclasses.replace(llama.kinds["dense"].mixer, name="stateless", state_spec=None)
  module = types.ModuleType("throwaway_family")
  module.FAMILY = dataclasses.replace(llama, name="throwaway", kinds={"dense": dataclasses.replace(
      llama.kinds["dense"], mixer=mixer)})
  monkeypatch.setitem(sys.modules, "throwaway_family", module)
  monkeypatch.setitem(registry.FAMILIES, "throwaway", "throwaway_family")
  missing = " ".join(missing_for("throwaway"))
  assert "a tiny preset" in missing and "part 'stateless' declares neither its decode state" in missing
  assert not has_hf("throwaway") and hf_missing_for("throwaway") == []
  from meshlm.hf import adapters
  monkeypatch.setitem(adapters.ADAPTERS, "throwaway", adapters.ADAPTERS["llama"])
  assert "an HF fixture" in " ".join(hf_missing_for("throwaway"))


def test_the_rows_come_from_the_registry():
  """This process's rows: in every process every tiny preset (its HF round trip where its family has an adapter);
  with 1 device one fixture of every family with an adapter; with more, one fixture of every MoE family, and
  explicit == auto for one tiny preset of every family where there are 2 devices."""
  moe = {f for f in registry.FAMILIES if replays(f)}
  hf = {f for f in registry.FAMILIES if has_hf(f)}
  assert moe and moe != set(registry.FAMILIES) and moe <= hf
  fams = hf if DEVICES == 1 else moe
  family = {p: meshlm.load_config(f"model={p}").model.family for p in tiny_presets()}
  assert {p.values[0] for p in preset_rows()} == set(tiny_presets())
  assert {p.values[0] for p in preset_rows(hf_only=True)} == {p for p, f in family.items() if f in hf}
  assert {C.family_of_fixture(str(FIXTURES / p.values[0])) for p in fixture_rows()} == fams
  assert {C.family_of_fixture(str(FIXTURES / p.values[0])) for p in fixture_rows(moe_only=True)} == moe
  parity = [p.values[0] for p in parity_rows()]
  assert len(parity) == (len(registry.FAMILIES) if DEVICES >= 2 else 0)
  want = set(registry.FAMILIES) if DEVICES >= 2 else set()
  assert {meshlm.load_config(f"model={p}").model.family for p in parity} == want


# --- tiny presets through the public API --------------------------------------------------------------
# A 1-device user's calls in every process (ONE), outside any mesh context.

@TINY_PRESET
@pytest.mark.parametrize("preset", preset_rows())
def test_generate_equals_recomputing_with_forward(preset):
  cfg, params = preset_model(preset)
  got = C.check_generate_equals_recompute(cfg, params, sample("preset", preset))
  print(f"{preset} on 1 device: {got}")


@TINY_PRESET
@pytest.mark.parametrize("preset", preset_rows())
def test_packed_documents_equal_each_alone(preset):
  print(f"{preset}: packed vs alone, relative max |diff| {C.check_packed_documents(*preset_model(preset)):.3g}")


@TINY_PRESET
@pytest.mark.parametrize("preset", preset_rows(hf_only=True))
def test_hf_save_then_load_is_bit_identical(preset, tmp_path):
  cfg, params = preset_model(preset)
  C.check_hf_round_trip(cfg, params, tmp_path / "hf", over=ONE)


@TINY_PRESET
@pytest.mark.parametrize("preset", preset_rows(moe_only=True))
def test_recorded_expert_ids_replay_bit_for_bit(preset):
  cfg, params = preset_model(preset)
  agree = C.check_replay(cfg, params, sample("preset", preset))
  print(f"{preset}: the sampler and the forward routed {agree:.2%} of the fed tokens' layers alike")


# --- HF fixtures through the public API ---------------------------------------------------------------

def reference(name: str):
  return np.load(FIXTURES / name / "reference.npz")


def assert_matches_transformers(name: str, logits) -> None:
  ref = reference(name)["logits"]
  err = float(np.max(np.abs(np.asarray(logits, np.float32) - ref)) / np.max(np.abs(ref)))
  print(f"{name}: logits relative error {err:.3g}")
  assert err <= FIXTURE_TOL, f"{name}: logits relative error {err:.3g} against transformers (want <= {FIXTURE_TOL})"


# Generate against recomputing is the tiny presets' (every family, above); a fixture's generate is the README
# calls' test below, in and outside a mesh context.
if DEVICES == 1:
  @pytest.mark.parametrize("name", fixture_rows())
  def test_fixture_logits_match_transformers(name):
    cfg, params = fixture_model(name)
    with where():
      assert_matches_transformers(name, meshlm.forward(cfg, params, reference(name)["input_ids"]))


  @pytest.mark.parametrize("name", fixture_rows())
  def test_fixture_save_then_load_is_bit_identical(name, tmp_path):
    cfg, params = fixture_model(name)
    with where():
      C.check_hf_round_trip(cfg, params, tmp_path / "hf", reference(name)["input_ids"])


@pytest.mark.parametrize("name", fixture_rows(moe_only=True))
def test_the_readme_calls_inside_a_mesh_context_equal_outside(name):
  """hf.load -> forward, as the README writes them, in this process's other context (elsewhere(): inside a
  jax.set_mesh of the mesh the calls otherwise make, or outside the one they otherwise run in): the same logits
  bit for bit, and those of transformers. With 1 device, generate too: in both contexts the same tokens,
  log-probs and expert ids bit for bit. With more (in the 8-device process a 4-device user's calls), forward
  only: generate on a multi-device mesh outside any mesh context is tests/test_rollout.py's (qwen3-moe-tiny on
  fsdp=2, both modes, against one device) and tests/test_generate_context.py's (mixtral-tiny on context shards);
  its sampler compiles here were a third of this process's conformance time."""
  ids = reference(name)["input_ids"]
  with elsewhere():
    cfg, params = meshlm.hf.load(FIXTURES / name, "train.compute_dtype=float32", *USER)
    logits = np.asarray(meshlm.forward(cfg, params, ids))
    out = C.greedy(cfg, params) if DEVICES == 1 else None
  assert_matches_transformers(name, logits)
  cfg0, params0 = fixture_model(name)
  with where():
    np.testing.assert_array_equal(logits, np.asarray(meshlm.forward(cfg0, params0, ids)))
  if out is not None:
    want = sample("fixture", name)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    np.testing.assert_array_equal(out.logprobs, want.logprobs)
    np.testing.assert_array_equal(out.expert_ids, want.expert_ids)


# --- the settings real runs use, on every tiny preset; explicit == auto there -------------------------------
# remat=full and remat=dots over the scanned layers, attention_impl=flash and the blockwise loss (C.REAL_RUN):
# full on one device, dots on fsdp=2, on the same batches and equal; on the GDN preset the rematerialization
# crashed (issue 53), also against remat=none. One preset of each family also runs its dots_fsdp2 steps under
# shard_mode=auto, each from the explicit run's state (C.stepped_pair), and equal, with nothing blocked under
# explicit (the golden census counts the default path's blocked pairs on fsdp=4: 0). Defined where there are 2
# devices (an empty parametrization or a skipif would be a skip, which CI=true fails): the 1-device process runs
# the public-API rows alone.

def parity_rows() -> list:
  """One tiny preset of every family (its first by name): the sharding is the family's parts', so a second preset
  of a family (llama3-tiny beside llama2-tiny) adds compiles, not cases."""
  firsts = [presets_of(f)[0] for f in sorted(registry.FAMILIES)] if DEVICES >= 2 else []
  return [pytest.param(p, id=p) for p in firsts]


@functools.cache
def paired(preset: str):
  """(C.stepped_pair of explicit and auto on the dots_fsdp2 arm, explicit's census)."""
  t = time.process_time()
  got = C.explicit_and_auto((f"model={preset}", *shrink(preset)))
  print(f"{preset} dots_fsdp2, explicit and auto: {time.process_time() - t:.1f} s CPU")
  return got


@functools.cache
def real_run(preset: str, arm: str) -> dict:
  if arm == "dots_fsdp2" and preset in {p.values[0] for p in parity_rows()}:
    return paired(preset)[0]["a"]  # the explicit arm's own steps, from a fresh state
  t = time.process_time()
  got = C.real_run_metrics((f"model={preset}", *shrink(preset), *REAL_ARMS[arm]))
  print(f"{preset} {arm}: {time.process_time() - t:.1f} s CPU, {got}")
  return got


if DEVICES >= 2:
  @pytest.mark.parametrize("preset", parity_rows())
  def test_explicit_equals_auto_and_nothing_is_blocked(preset):
    got = C.check_explicit_equals_auto((f"model={preset}",), paired(preset))
    print(f"{preset}: explicit vs auto, remat=dots, fsdp=2, flash, blockwise, float32, {C.REAL_STEPS} steps: {got}")


# "full_jax": the full arm with the Gated DeltaNet rule in pure JAX (the real runs' gdn_impl=pallas is the kernel).
REAL_ARMS = dict(C.REAL_ARMS, none=C.REFERENCE, full_jax=(*C.REAL_ARMS["full"], "gdn_impl=jax"))


def gdn_preset() -> str:
  """The first tiny preset with a Gated DeltaNet layer."""
  def parts(preset: str) -> set[str]:
    family = registry.get(meshlm.load_config(f"model={preset}").model.family)
    return {part.name for kind in family.kinds.values() for part in kind.parts}
  return next(p for p in tiny_presets() if "gdn" in parts(p))


if DEVICES >= 2:
  @pytest.mark.parametrize("preset", preset_rows())
  def test_remat_flash_and_the_blockwise_loss_train_alike(preset):
    got = C.check_real_runs_agree({arm: real_run(preset, arm) for arm in C.REAL_ARMS}, REAL_ARMS)
    print(f"{preset}: max differences from remat=full on 1 device {got}")


  def test_remat_trains_as_without_remat():
    """remat=full on one device against remat=none, on the GDN preset (where remat moves float32 sums most)."""
    preset = gdn_preset()
    got = C.check_real_runs_agree({arm: real_run(preset, arm) for arm in ("none", "full")}, REAL_ARMS)
    print(f"{preset}: remat=full against remat=none {got}")


  def gdn_rows() -> list:
    """The first tiny preset of every family with a Gated DeltaNet layer."""
    def has_gdn(family: str) -> bool:
      return any(part.name == "gdn" for kind in registry.get(family).kinds.values() for part in kind.parts)
    return [pytest.param(presets_of(f)[0], id=presets_of(f)[0]) for f in sorted(registry.FAMILIES) if has_gdn(f)]


  @pytest.mark.parametrize("preset", gdn_rows())
  def test_the_gdn_kernel_trains_to_the_jax_losses(preset):
    """The real runs' gdn_impl=pallas (the Pallas kernels in interpret mode, remat=full over scanned layers) against
    gdn_impl=jax on the same batches: losses and gradient norms within C.GDN_KERNEL_ATOL (measured at most 2.4e-6
    and 4.7e-7)."""
    pallas, jax_ = real_run(preset, "full"), real_run(preset, "full_jax")
    loss = float(np.max(np.abs(pallas["loss"] - jax_["loss"])))
    grad = float(np.max(np.abs(pallas["grad_norm"] / jax_["grad_norm"] - 1)))
    print(f"{preset}: gdn_impl=pallas against jax, max |loss diff| {loss:.3g}, gradient norms {grad:.3g} relative")
    assert len(set(pallas["loss"].tolist())) == C.REAL_STEPS, f"the losses do not move: {pallas['loss']}"
    assert loss <= C.GDN_KERNEL_ATOL and grad <= C.GDN_KERNEL_ATOL, (pallas, jax_)


  def test_a_remat_that_changes_the_gradient_fails_the_check(monkeypatch):
    """Control: a layer whose rematerialized gradient is 1.001 times its own (the forward unchanged), under
    remat=dots on fsdp=2, fails the check against remat=full's run (llama2-tiny)."""
    real = jax.checkpoint
    calls = []

    def broken(f, **kw):
      g = real(f, **kw)

      def h(*args):
        calls.append(1)
        x, *rest = g(*args)
        return (x + 1e-3 * (x - jax.lax.stop_gradient(x)), *rest)
      return h
    monkeypatch.setattr(jax, "checkpoint", broken)
    preset = "llama2-tiny"
    bad = C.real_run_metrics((f"model={preset}", *REAL_ARMS["dots_fsdp2"]))
    monkeypatch.undo()
    assert calls, "the broken remat was never traced: models/layers.py no longer calls jax.checkpoint"
    with pytest.raises(AssertionError, match="gradient norms"):
      C.check_real_runs_agree({"full": real_run(preset, "full"), "dots_fsdp2": bad}, REAL_ARMS)


def _shard_on_the_wrong_device(real_reshard, calls: list):
  """jax.sharding.reshard with a bug: a batch-sharded value is resharded correctly, then each fsdp shard lands
  on the next device along the axis (what a wrong device order or a shard_map with a wrong permutation does).
  Only the explicit path calls reshard; auto uses a sharding constraint."""
  def reshard(x, spec):
    y = real_reshard(x, spec)
    spec = tuple(spec) if spec is not None else ()
    if spec and spec[0] == "fsdp":
      calls.append(x.shape)
      n = jax.sharding.get_abstract_mesh().shape["fsdp"]
      rotate = lambda b: jax.lax.ppermute(b, "fsdp", [(i, (i + 1) % n) for i in range(n)])  # noqa: E731
      y = jax.shard_map(rotate, in_specs=jax.sharding.PartitionSpec(*spec),
                        out_specs=jax.sharding.PartitionSpec(*spec))(y)
    return y
  return reshard


def injected_sharding_bug_fails_the_parity_check(monkeypatch):
  preset = "llama2-tiny"
  calls = []
  monkeypatch.setattr(jax.sharding, "reshard", _shard_on_the_wrong_device(jax.sharding.reshard, calls))
  try:
    got, _ = C.explicit_and_auto((f"model={preset}",))
  finally:
    monkeypatch.undo()  # nothing traced with the bug may be reused by a later test
    jax.clear_caches()
  assert calls, "the injected bug was never traced: the seam (constrain -> jax.sharding.reshard) moved"
  broken, auto = got["a"]["loss"], got["b"]["loss"]
  print(f"{preset} with a shard on the wrong device: max |loss diff| vs auto = {np.max(np.abs(broken - auto)):.3g}")
  with pytest.raises(AssertionError, match="Not equal to tolerance"):
    C.assert_pair(got)


# --- negative controls of the public-API checks ----------------------------------------------------------

@TINY_PRESET
def test_a_load_that_moves_one_leaf_by_an_ulp_fails_the_round_trip(monkeypatch, tmp_path):
  preset = preset_rows(hf_only=True)[0].values[0]
  cfg, params = preset_model(preset)
  real = meshlm.hf.load

  def nudged(*a, **kw):
    cfg2, tree = real(*a, **kw)
    leaf = np.asarray(tree["final_norm"])
    return cfg2, dict(tree, final_norm=jax.numpy.asarray(np.nextafter(leaf, np.float32(np.inf))))
  monkeypatch.setattr(meshlm.hf, "load", nudged)
  with pytest.raises(AssertionError, match="final_norm"):
    C.check_hf_round_trip(cfg, params, tmp_path / "hf", over=ONE)


@TINY_PRESET
def test_other_expert_ids_forced_change_the_logits():
  """Control of the replay check: forcing each recorded routing's next expert instead moves the logits, so equal
  logits in test_recorded_expert_ids_replay_bit_for_bit mean the forced ids were read."""
  preset = preset_rows(moe_only=True)[0].values[0]
  cfg, params = preset_model(preset)
  out = sample("preset", preset)
  block = C.right_padded([p + n for p, n in zip(C.prompts(cfg), out.token_lists())])
  rec = out.expert_ids[:, :C.T]
  free, side = C.logits_of(cfg, params, block)
  free_ids = np.moveaxis(side["moe_expert_ids"], 0, 2)
  shifted = np.where(rec >= 0, (rec + 1) % knobs(cfg.model).num_experts, free_ids)
  other, _ = C.logits_of(cfg, params, block, forced_expert_ids=shifted)
  real = block[2] > 0
  assert np.abs(other - free)[real].max() > 1e-3


# Last in the file: its jax.clear_caches() drops every program compiled in this process, which the tests after it
# would compile again (the controls above reuse the tiny presets' forward programs).
if DEVICES >= 2:
  test_an_injected_sharding_bug_fails_the_parity_check = injected_sharding_bug_fails_the_parity_check
