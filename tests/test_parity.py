"""Explicit equals auto for every tiny preset's layer kinds, and an injected sharding bug fails that check.

Each preset trains STEPS steps in float32 on fsdp=4 under both shard modes from the same
parameters and the same batches; the losses may differ only by float32 reassociation. The sequence
is longer than every preset's sliding window, so local attention is really masked. Only the public
API is used (load_config, build_train_step), so the test does not depend on the decoder's layout.

What this check can and cannot see: under jit a sharding annotation never changes a value, so a
layout-only mistake (an out_sharding that drops the batch axis, a wrong reshard target) trains to
the same losses here; the golden census catches those (tests/test_analysis.py, with its own
control), and explicit mode refuses many outright while tracing. This test catches the bugs that
change numbers: code that computes differently per mode, or data that ends up on the wrong device.
The control below injects the second kind through the mode switch itself.

One preset is covered by its parts rather than trained here (COVERED_BY_PARTS): qwen3.5-moe-tiny's layer kinds
are qwen3.5-tiny's mixers (gdn with separate projections, gated_gqa) with qwen3-next-tiny's feed-forward (the MoE
with a gated shared expert, renormalized top-k), both trained here under both modes;
test_a_preset_covered_by_its_parts_has_exactly_those_parts holds that claim to the family definitions.
"""
import jax
import numpy as np
import pytest

from meshlm.analysis.golden import shrink, tiny_presets
from meshlm.config import load_config
from meshlm.train.step import BATCH_KEYS, build_train_step

STEPS = 3
SEQ_LEN = 96  # longer than every tiny preset's sliding window (checked below)
BASE = ("cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1", f"train.seq_len={SEQ_LEN}",
        "train.compute_dtype=float32", "train.warmup_steps=0", "train.learning_rate=3e-3")
# Float32 reassociation only. Measured max |loss diff| over 3 steps (CPU, JAX 0.10.2): 0 (llama2,
# llama3), 4.8e-7 (gemma2, mistral), 9.5e-7 (gemma), 1.4e-6 (gemma3), 4.8e-6 (qwen3), i.e. a few
# float32 ulps of a loss near 7-11. The injected bug below moves the loss by 0.12.
PARITY_ATOL = 1e-5


def _batches(vocab: int, rows: int):
  """STEPS batches of random tokens, two packed documents per row, a ragged loss mask."""
  rng = np.random.default_rng(0)
  for _ in range(STEPS):
    toks = rng.integers(0, vocab, (rows, SEQ_LEN + 1)).astype(np.int32)
    cut = rng.integers(SEQ_LEN // 4, 3 * SEQ_LEN // 4, rows)[:, None]
    col = np.arange(SEQ_LEN)[None, :]
    seg = np.where(col < cut, 1, 2).astype(np.int32)
    yield {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg,
           "positions": np.where(col < cut, col, col - cut).astype(np.int32),
           "loss_mask": (rng.random((rows, SEQ_LEN)) < 0.9).astype(np.float32)}


# preset -> (the preset whose mixers it has, the preset whose feed-forwards it has); see the module docstring.
# qwen3.5-moe-tiny still trains end to end (explicit, fsdp=2) in tests/test_qwen3_next.py.
COVERED_BY_PARTS = {"qwen3.5-moe-tiny": ("qwen3.5-tiny", "qwen3-next-tiny")}
TRAINED = [p for p in tiny_presets() if p not in COVERED_BY_PARTS]


def train_losses(preset: str, mode: str) -> np.ndarray:
  """Losses of STEPS real train steps (compiled once) for one preset under one shard mode."""
  cfg = load_config(f"model={preset}", *BASE, *shrink(preset), f"shard_mode={mode}")
  window = cfg.model.sliding_window
  assert window is None or window < SEQ_LEN, (preset, window)
  step = build_train_step(cfg)
  state = step.init_state(jax.random.key(0))
  losses = []
  for batch in _batches(cfg.model.vocab_size, step.global_batch):
    assert set(batch) == set(BATCH_KEYS)
    state, metrics = step(state, step.put_batch(batch))
    losses.append(float(metrics["loss"]))
  return np.asarray(losses)


def assert_parity(explicit: np.ndarray, auto: np.ndarray) -> None:
  assert explicit.shape == auto.shape == (STEPS,)
  assert np.all(np.isfinite(explicit)) and np.all(np.isfinite(auto))
  np.testing.assert_allclose(explicit, auto, rtol=0, atol=PARITY_ATOL)


@pytest.fixture(scope="module")
def losses():
  """losses(preset, mode): trained once per (preset, mode) for the whole module."""
  cache = {}
  def get(preset: str, mode: str) -> np.ndarray:
    if (preset, mode) not in cache:
      cache[preset, mode] = train_losses(preset, mode)
    return cache[preset, mode]
  return get


def test_every_tiny_preset_is_covered():
  presets = tiny_presets()
  assert {"llama2-tiny", "llama3-tiny", "mistral-tiny", "qwen3-tiny", "gemma-tiny", "gemma2-tiny",
          "gemma3-tiny"} <= set(presets)
  windows = [load_config(f"model={p}").model.sliding_window for p in presets]
  assert any(w is not None for w in windows) and all(w is None or w < SEQ_LEN for w in windows)


def _fn_id(f, m) -> tuple:
  """A function, or a functools.partial by its function and bound keywords; norm_topk=None reads the model
  config's norm_topk_prob (ffns/moe.py), so it is resolved against m."""
  kw = dict(getattr(f, "keywords", {}))
  if "norm_topk" in kw and kw["norm_topk"] is None:
    kw["norm_topk"] = m.norm_topk_prob
  return getattr(f, "func", f), tuple(sorted(kw.items()))


def _part_id(part, m) -> tuple:
  """What a Part computes in a model config m: its name, its parameters' spec and its apply function."""
  return part.name, part.key, _fn_id(part.spec, m), _fn_id(part.apply, m)


def test_a_preset_covered_by_its_parts_has_exactly_those_parts():
  from meshlm.models import registry
  model = lambda p: load_config(f"model={p}").model  # noqa: E731
  kinds_of = lambda p: registry.get(model(p).family).kinds  # noqa: E731
  part = lambda p, kind, half: _part_id(getattr(kinds_of(p)[kind], half), model(p))  # noqa: E731
  for preset, (mixers_of, ffns_of) in COVERED_BY_PARTS.items():
    kinds = kinds_of(preset)
    assert set(kinds) == set(kinds_of(mixers_of)) == set(kinds_of(ffns_of)), preset
    for kind in kinds:
      assert part(preset, kind, "mixer") == part(mixers_of, kind, "mixer"), (preset, kind)
      assert part(preset, kind, "ffn") == part(ffns_of, kind, "ffn"), (preset, kind)
      assert kinds[kind].plus_one and not kinds[kind].sandwich
      assert all(kinds_of(p)[kind].plus_one and not kinds_of(p)[kind].sandwich for p in (mixers_of, ffns_of))
    # The same layer pattern, so the same plan (one period of linear + full once shrunk).
    assert model(preset).full_attention_interval == model(mixers_of).full_attention_interval == \
        model(ffns_of).full_attention_interval
  # Control: the two GDN layouts and the two feed-forwards are told apart.
  assert part("qwen3-next-tiny", "linear_attn", "mixer") != part("qwen3.5-tiny", "linear_attn", "mixer")
  assert part("qwen3.5-tiny", "linear_attn", "ffn") != part("qwen3-next-tiny", "linear_attn", "ffn")


@pytest.mark.parametrize("preset", TRAINED)
def test_explicit_equals_auto(losses, preset):
  explicit, auto = losses(preset, "explicit"), losses(preset, "auto")
  print(f"{preset}: explicit vs auto, fsdp=4, float32, {STEPS} steps: "
        f"max |loss diff| = {np.max(np.abs(explicit - auto)):.3g}  (losses {np.round(explicit, 4).tolist()})")
  assert_parity(explicit, auto)
  # The steps really train: a frozen or skipped update would make the parity check trivially easy.
  assert len(set(explicit.tolist())) == STEPS


# --- negative control: an injected sharding bug ----------------------------------------------------

def _shard_on_the_wrong_device(real_reshard, calls: list):
  """jax.sharding.reshard with a bug: a batch-sharded value is resharded correctly, then each fsdp
  shard lands on the next device along the axis (what a wrong device order or a shard_map with a
  wrong permutation does). Only the explicit path calls reshard; auto uses a sharding constraint."""
  def reshard(x, spec):
    y = real_reshard(x, spec)
    spec = tuple(spec) if spec is not None else ()
    if spec and spec[0] == "fsdp":
      calls.append(x.shape)
      n = jax.sharding.get_abstract_mesh().shape["fsdp"]
      rotate = lambda b: jax.lax.ppermute(b, "fsdp", [(i, (i + 1) % n) for i in range(n)])
      y = jax.shard_map(rotate, in_specs=jax.sharding.PartitionSpec(*spec),
                        out_specs=jax.sharding.PartitionSpec(*spec))(y)
    return y
  return reshard


def test_an_injected_sharding_bug_fails_the_parity_check(losses, monkeypatch):
  preset = "llama2-tiny"
  calls = []
  monkeypatch.setattr(jax.sharding, "reshard", _shard_on_the_wrong_device(jax.sharding.reshard, calls))
  try:
    broken = train_losses(preset, "explicit")
  finally:
    # Nothing traced with the bug may be reused by a later test.
    monkeypatch.undo()
    jax.clear_caches()
  assert calls, "the injected bug was never traced: the seam (constrain -> jax.sharding.reshard) moved"
  auto = losses(preset, "auto")
  print(f"{preset} with a shard on the wrong device: max |loss diff| vs auto = {np.max(np.abs(broken - auto)):.3g}")
  with pytest.raises(AssertionError, match="Not equal to tolerance"):
    assert_parity(broken, auto)
