"""The model FLOPs per token (analysis/aot.model_flops_per_token) from what the parts declare (Part.attention_width,
Part.active_fraction) equal, for every preset, the formula that named the parts (the copy below, as it was at
60149c0); a part that forgets its declaration changes the number."""
import dataclasses
import math

import jax
import pytest

from meshlm import spec as S
from meshlm.analysis.aot import model_flops_per_token
from meshlm.config import load_config, preset_names
from meshlm.models import decoder, registry
from meshlm.models.params import param_specs
from meshlm.models.ffns.moe import knobs as moe_knobs
from meshlm.models.mixers.mla import knobs as mla_knobs


def reference_flops_per_token(cfg) -> float:
  """The formula before the parts declared their widths and fractions: mixer names and the experts axis."""
  m = cfg.model
  specs = param_specs(cfg)
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=S.is_spec)[0]
  matmul = 0.0
  for path, s in flat:
    top = str(getattr(path[0], "key", path[0]))
    if top == "embed" and not m.tie_embeddings:
      continue
    if len([a for a in s.axes if a != "layers"]) < 2:
      continue
    n = float(math.prod(s.shape))
    if any(a and str(a).startswith("experts") for a in s.axes):
      own = moe_knobs(m)
      n *= own.num_experts_per_tok / own.num_experts
    matmul += n
  T = cfg.train.seq_len
  fam, lp = registry.family(cfg), decoder.plan(cfg)
  attention = 0.0
  for kind, context in zip(lp.kinds, lp.contexts):
    mixer = fam.kinds[kind].mixer.name
    if mixer in ("gqa", "gated_gqa"):
      width = 2 * m.num_heads * m.head_dim
    elif mixer == "mla":
      lat = mla_knobs(m)
      width = m.num_heads * (lat.qk_nope_head_dim + lat.qk_rope_head_dim + lat.v_head_dim)
    else:
      continue
    w = m.sliding_window if context == "local" and m.sliding_window else T
    keys = T / 2 if w >= T else (w * (w + 1) / 2 + (T - w) * w) / T
    attention += 6.0 * width * keys
  return 6.0 * matmul + attention


def test_the_presets_cover_every_family_and_part():
  families = {load_config(f"model={p}").model.family for p in preset_names()}
  assert families == set(registry.FAMILIES)
  used = {part.name for f in families for kind in registry.get(f).kinds.values() for part in kind.parts}
  assert used == set(registry.PARTS)


@pytest.mark.parametrize("preset", preset_names())
def test_the_declared_flops_equal_the_reference(preset):
  cfg = load_config(f"model={preset}")
  assert model_flops_per_token(cfg) == reference_flops_per_token(cfg)


@pytest.mark.parametrize("preset, over", [
    ("gemma2-tiny", ("train.seq_len=2048",)), ("mistral-tiny", ("model.sliding_window=16", "train.seq_len=64")),
    ("gemma3-tiny", ("model.sliding_window=500", "train.seq_len=1000")), ("deepseek-v3-tiny", ("train.seq_len=8",)),
    ("qwen3.5-moe-tiny", ("train.seq_len=8",))])
def test_the_window_and_length_follow_the_reference(preset, over):
  cfg = load_config(f"model={preset}", *over)
  assert model_flops_per_token(cfg) == reference_flops_per_token(cfg)


def swap_part(monkeypatch, family: str, **fields) -> None:
  """The registry's `family` with each kind's mixer or ffn given other Part fields (mixer={...}, ffn={...})."""
  fam = registry.get(family)
  kinds = {k: dataclasses.replace(v, **{half: dataclasses.replace(getattr(v, half), **f) for half, f in fields.items()})
           for k, v in fam.kinds.items()}
  swapped = dataclasses.replace(fam, kinds=kinds)
  get = registry.get
  monkeypatch.setattr(registry, "get", lambda name: swapped if name == family else get(name))


def test_a_mixer_that_forgets_its_attention_width_counts_no_attention(monkeypatch):
  """Negative control: llama's gqa without attention_width loses exactly the attention term."""
  cfg = load_config("model=llama2-tiny")
  m, T = cfg.model, cfg.train.seq_len
  want = reference_flops_per_token(cfg)
  swap_part(monkeypatch, "llama", mixer={"attention_width": None})
  got = model_flops_per_token(cfg)
  assert got < want
  assert got == pytest.approx(want - m.num_layers * 6.0 * 2 * m.num_heads * m.head_dim * T / 2)


def test_a_routed_ffn_that_forgets_its_active_fraction_counts_every_expert(monkeypatch):
  """Negative control: mixtral's experts without active_fraction count all E experts, E / k times more."""
  cfg = load_config("model=mixtral-tiny")
  want = model_flops_per_token(cfg)
  swap_part(monkeypatch, "mixtral", ffn={"active_fraction": lambda m, s: 1.0})
  assert model_flops_per_token(cfg) > want
