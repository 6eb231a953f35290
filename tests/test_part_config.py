"""A mixer's own config section, on docs/adding-a-part.md's worked example (tests/doc_example.py registers it):
the part's knob is no schema field and changes the numbers; the family refuses a section none of its parts
declares and the section a bad or unknown knob, each naming the key; another family refuses the section; a model
without attention needs no head fields; a checkpoint compares the parts' knobs (but a COMPUTE one); a moved key
still sets its part's knob (mla's absorb; gdn's chunk_size, impl and conv_kernel_dim, a checkpoint resuming under
another chunk or rule but not another conv); the resolve cache follows the registry. Sampling from the mixer's
decode state against recomputing, and its negative control, are tests/test_adding_a_part.py's (run at the
preset's knob)."""
import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

import doc_example as E
import meshlm
from meshlm.config import ModelConfig, load_config
from meshlm.errors import ConfigError
from meshlm.models import model, registry
from meshlm.models.family import section
from meshlm.train.checkpoint import _model_mismatch

PRESET = E.preset()


@pytest.fixture(autouse=True)
def example():
  """The page's mixer and family registered for one test (undone after it, the caches dropped)."""
  with E.registered() as ex:
    yield ex


def test_the_knob_is_the_parts_own_not_a_schema_field(example):
  """No schema field or schema text names the part, its family or its knob; the section reads the preset's value,
  a dotted override and, with no section given, its default."""
  schema = Path(meshlm.config.schema.__file__).read_text()
  assert "scale" not in ModelConfig.model_fields
  assert [w for w in ("MeanConfig", "parts.mean", "mean_llama") if w in schema] == []
  part = example.mixer.PART
  assert section(registry.validate(E.config()).model, part).scale == 0.5  # the preset's
  assert section(E.config("model.parts.mean.scale=2").model, part).scale == 2.0  # a dotted key
  assert section(E.config("model.parts={}").model, part).scale == 1.0  # the section's default


def test_the_knob_changes_the_numbers():
  """The part reads its knob (a section read nowhere would leave the logits alone)."""
  cfg, other = E.config(), E.config("model.parts.mean.scale=2")
  params = meshlm.init_params(cfg, jax.random.key(0))
  tokens = np.arange(16, dtype=np.int32)[None] % cfg.model.vocab_size
  a, b = (np.asarray(meshlm.forward(c, params, tokens)) for c in (cfg, other))
  assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("override, msg", [
    ("model.parts.mean.scale=-1", r"model.parts.mean.scale: Input should be greater than 0 \(got -1\) \(the mean "
     r"part's knobs: scale\)"),
    ("model.parts.mean.scael=2", r"model.parts.mean.scael: unknown knob \(the mean part's knobs: scale\)"),
    ("model.parts.glu.scale=2", r"model.parts.glu: model family 'mean_llama' has no part 'glu' with knobs of its own "
     r"\(parts with knobs: mean\)"),
])
def test_a_bad_section_is_refused_naming_the_key(override, msg):
  with pytest.raises(ConfigError, match=msg):
    registry.validate(E.config(override))


def test_a_model_without_attention_needs_no_head_fields():
  """The preset sets no heads; attention's parts need them (Part.needs), so a family with attention refuses
  each one null, naming the key; the control: the same config with all three set resolves."""
  m = registry.validate(E.config()).model
  assert (m.num_heads, m.num_kv_heads, m.head_dim) == (None, None, None)
  llama = dict(PRESET, model=dict(PRESET["model"], family="llama", parts={}))
  heads = ["model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=32"]
  registry.validate(load_config(*heads, base=llama))
  for given in heads:
    key = given.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: required by model.family=llama \\(its gqa layers\\); "
                       f"set {key}=...$"):
      registry.validate(load_config(*(h for h in heads if h != given), base=llama))


def test_another_family_refuses_the_section():
  with pytest.raises(ConfigError, match="model.parts.mean: model family 'llama' has no part 'mean'"):
    registry.validate(load_config("model=llama2-tiny", "model.parts.mean.scale=2"))


# --- a knob that moved into its part's section: model.mla_absorb -> model.parts.mla.absorb -------------------

def before_the_moves(model: dict) -> dict:
  """A model config as a meshlm before the moves saved it: every moved knob under its old flat key (ModelConfig.MOVED),
  each at its old default unless model.parts set it (a saved config holds every field, the parts' or not)."""
  old = {(part, knob): key for key, (part, knob, _) in ModelConfig.MOVED.items()}
  out = {k: v for k, v in model.items() if k != "parts"}
  out.update({key: default for key, (_, _, default) in ModelConfig.MOVED.items()})
  # Knobs added after the moves (moe's ep_impl, ep_buffer_factor) have no old key: such a config never held them.
  out.update({old[part, knob]: v for part, knobs in model.get("parts", {}).items() for knob, v in knobs.items()
              if (part, knob) in old})
  return out


def test_a_moved_key_still_sets_the_parts_knob():
  from meshlm.models.mixers.mla import PART
  absorb = lambda *o: section(registry.validate(load_config("model=deepseek-v3-tiny", *o)).model, PART).absorb
  assert absorb() is True
  assert absorb("model.mla_absorb=false") is False  # the old key, as presets and saved run configs have it
  assert absorb("model.parts.mla.absorb=false") is False
  assert absorb("model.mla_absorb=true", "model.parts.mla.absorb=false") is False  # the new name wins
  assert "mla_absorb" not in ModelConfig.model_fields
  with pytest.raises(ConfigError, match="model.parts.mla: model family 'llama' has no part 'mla'"):
    registry.validate(load_config("model=llama2-tiny", "model.mla_absorb=false"))  # a knob llama has no part for


def test_a_checkpoint_compares_the_parts_knobs_but_a_compute_knob():
  """A checkpoint's saved model config against this run's: a part's knob that changes the numbers must match
  (model.parts.mean.scale), a knob its section names COMPUTE may differ (mla's absorb, also under its old key, as
  a checkpoint from before the move saved it)."""
  cfg = E.config()
  saved = cfg.model.model_dump(mode="json")
  assert _model_mismatch(saved, cfg) is None
  other = dict(saved, parts={"mean": {"scale": 2.0}})
  assert _model_mismatch(other, cfg) == "model.parts.mean.scale is 0.5 here but 2.0 in the checkpoint"
  dsv3 = load_config("model=deepseek-v3-tiny", "model.parts.mla.absorb=false")
  old = before_the_moves(load_config("model=deepseek-v3-tiny").model.model_dump(mode="json"))
  assert old["mla_absorb"] is True and _model_mismatch(old, dsv3) is None
  assert _model_mismatch(dict(old, parts={"gqa": {}}), dsv3).startswith("model.parts.gqa is None here")


def test_a_checkpoint_knob_the_section_no_longer_takes_is_a_mismatch():
  cfg = E.config()
  saved = dict(cfg.model.model_dump(mode="json"), parts={"mean": {"scale": 0.5, "gone": 1}})
  assert _model_mismatch(saved, cfg).startswith("model.parts.mean is {'scale': 0.5} here but")


def test_resolve_is_cached_and_follows_the_registry(monkeypatch):
  """The same config resolves to the same Model; a family swapped in the registry (as tests swap them)
  resolves anew rather than from the cache (control: without the swap it is the cached one)."""
  cfg = E.config()
  first = model.resolve(cfg)
  assert model.resolve(E.config()) is first and model.resolve(first) is first
  fam = registry.get("mean_llama")
  other = dataclasses.replace(fam, embed_scale=True)
  monkeypatch.setattr(registry, "get", lambda name: other if name == "mean_llama" else fam)
  assert model.resolve(cfg).family.embed_scale and model.resolve(cfg) is not first


# --- gdn's knobs, moved into its section: model.gdn_chunk_size, gdn_impl, linear_conv_kernel_dim -------------

def gdn_knobs(*overrides, base=None):
  from meshlm.models.mixers import gdn
  own = gdn.knobs(registry.validate(load_config("model=qwen3.5-tiny", *overrides, base=base)).model)
  return own.chunk_size, own.impl, own.conv_kernel_dim


def test_the_old_gdn_keys_still_set_its_knobs():
  """On the CLI the old key overrides what the preset sets under the new name (qwen3.5-tiny's parts.gdn.chunk_size:
  64); in a tree (a saved run config, a base dict) it sets the knob, and the new name given there too wins."""
  assert gdn_knobs() == (64, "chunked", 4)
  assert gdn_knobs("model.gdn_chunk_size=16", "model.gdn_impl=reference", "model.linear_conv_kernel_dim=3") == (
      16, "reference", 3)
  assert gdn_knobs("model.parts.gdn.chunk_size=16", "model.parts.gdn.impl=reference",
                   "model.parts.gdn.conv_kernel_dim=3") == (16, "reference", 3)
  assert gdn_knobs("model.gdn_chunk_size=16", "model.parts.gdn.chunk_size=32")[0] == 32  # in order: the last wins
  tree = load_config("model=qwen3.5-tiny").model_dump(mode="json")
  flat = dict(tree, model=dict(before_the_moves(tree["model"]), gdn_chunk_size=16, gdn_impl="reference",
                               linear_conv_kernel_dim=3))
  assert gdn_knobs(base=flat) == (16, "reference", 3)
  both = dict(flat, model=dict(flat["model"], parts={"gdn": {"chunk_size": 32}}))
  assert gdn_knobs(base=both) == (32, "reference", 3)
  assert not {"gdn_chunk_size", "gdn_impl", "linear_conv_kernel_dim"} & set(ModelConfig.model_fields)


def test_an_old_key_at_its_default_sets_nothing_for_a_family_without_the_part():
  """A model config saved before the move holds every field (llama's too, at the defaults): it loads; an old key
  off its default still is a knob llama has no part for (control)."""
  tree = load_config("model=llama2-tiny").model_dump(mode="json")
  old = dict(tree, model=before_the_moves(tree["model"]))
  assert {"gdn_chunk_size", "mla_absorb", "num_experts", "moe_mlp_dim"} <= set(old["model"])
  assert registry.validate(load_config(base=old)).model.parts == {}
  with pytest.raises(ConfigError, match="model.parts.gdn: model family 'llama' has no part 'gdn'"):
    registry.validate(load_config(base=dict(old, model=dict(old["model"], gdn_chunk_size=32))))


@pytest.mark.parametrize("key", ["model.parts.gdn.chunk_size", "model.gdn_chunk_size"])
def test_a_gdn_chunk_not_a_power_of_two_is_refused_naming_the_section_key(key):
  with pytest.raises(ConfigError, match=r"^model\.parts\.gdn\.chunk_size: 48 must be a power of two"):
    gdn_knobs(f"{key}=48")
  assert gdn_knobs(f"{key}=32")[0] == 32  # control


def test_a_checkpoint_resumes_under_another_gdn_chunk_or_rule_but_not_another_conv():
  """chunk_size and impl are COMPUTE knobs (the same parameters, computed in other pieces); conv_kernel_dim is a
  parameter's shape. A checkpoint saved before the move (the flat keys) compares as the new ones."""
  cfg = load_config("model=qwen3.5-tiny")
  saved = cfg.model.model_dump(mode="json")
  assert _model_mismatch(saved, cfg) is None
  gdn = saved["parts"]["gdn"]
  assert _model_mismatch(dict(saved, parts={"gdn": dict(gdn, chunk_size=16, impl="reference")}), cfg) is None
  assert _model_mismatch(dict(saved, parts={"gdn": dict(gdn, conv_kernel_dim=3)}), cfg) == (
      "model.parts.gdn.conv_kernel_dim is 4 here but 3 in the checkpoint")
  old = before_the_moves(saved)
  assert _model_mismatch(dict(old, gdn_chunk_size=32, gdn_impl="reference", linear_conv_kernel_dim=4), cfg) is None
  assert _model_mismatch(dict(old, linear_conv_kernel_dim=2), cfg) == (
      "model.parts.gdn.conv_kernel_dim is 4 here but 2 in the checkpoint")
  llama = load_config("model=llama2-tiny")
  assert _model_mismatch(before_the_moves(llama.model.model_dump(mode="json")), llama) is None


# --- moe's knobs, moved into its section: model.num_experts, moe_mlp_dim, moe_impl, ... -> model.parts.moe.* --------

def moe_knobs(*overrides, base=None, preset="qwen3-moe-tiny"):
  from meshlm.models.ffns import moe
  return moe.knobs(registry.validate(load_config(f"model={preset}", *overrides, base=base)).model)


def test_the_old_moe_keys_still_set_its_knobs():
  """Each old flat key sets its knob under the new name (moe_mlp_dim -> mlp_dim, moe_impl -> impl, ...); on the CLI
  it overrides the preset's section, in a tree it sets the knob, and the new name given there too wins. None of the
  old names is a schema field."""
  from meshlm.config.schema import ModelConfig as M
  moved = {old: knob for old, (part, knob, _) in M.MOVED.items() if part == "moe"}
  assert len(moved) == 17 and not set(moved) & set(M.model_fields)
  assert {k: v for k, v in moved.items() if k != v} == {"moe_mlp_dim": "mlp_dim", "moe_impl": "impl",
                                                        "moe_grouped_matmul": "grouped_matmul",
                                                        "moe_kernel_fsdp": "kernel_fsdp"}
  own = moe_knobs("model.moe_mlp_dim=32", "model.num_experts_per_tok=3", "model.moe_impl=reference",
                  "model.moe_grouped_matmul=blocks", "model.moe_kernel_fsdp=mlp", "model.router_z_loss_coef=0.01")
  assert (own.mlp_dim, own.num_experts_per_tok, own.impl, own.grouped_matmul, own.kernel_fsdp,
          own.router_z_loss_coef) == (32, 3, "reference", "blocks", "mlp", 0.01)
  assert moe_knobs().mlp_dim == 128 and moe_knobs("model.moe_mlp_dim=32", "model.parts.moe.mlp_dim=16").mlp_dim == 16
  tree = load_config("model=qwen3-moe-tiny").model_dump(mode="json")
  flat = dict(tree, model=before_the_moves(dict(tree["model"], parts={"moe": {"num_experts": 8, "mlp_dim": 32}})))
  assert flat["model"]["moe_mlp_dim"] == 32 and (moe_knobs(base=flat).mlp_dim, moe_knobs(base=flat).impl) == (
      32, "dropless")
  both = dict(flat, model=dict(flat["model"], parts={"moe": {"mlp_dim": 16}}))
  assert moe_knobs(base=both).mlp_dim == 16


def test_an_old_saved_moe_config_loads_and_resumes():
  """A qwen3-moe-tiny run config saved before the move (every field, the MoE ones flat, kernel_fsdp resolved) loads
  to the preset's knobs, and its checkpoint resumes under the preset's config; the control: one with another top-k
  is refused naming the new key."""
  cfg = registry.validate(load_config("model=qwen3-moe-tiny"))
  tree = cfg.model_dump(mode="json")
  old = dict(tree, model=before_the_moves(tree["model"]))
  assert old["model"]["moe_kernel_fsdp"] == "embed" and "parts" not in old["model"]
  assert moe_knobs(base=old) == moe_knobs()  # the old keys at their defaults set nothing: the section's defaults
  assert _model_mismatch(old["model"], cfg) is None
  assert _model_mismatch(dict(old["model"], num_experts_per_tok=3), cfg) == (
      "model.parts.moe.num_experts_per_tok is 2 here but 3 in the checkpoint")


def test_a_checkpoint_resumes_under_another_moe_layout_but_not_other_experts():
  """impl, grouped_matmul, megablox_tiling, kernel_fsdp, ep_impl, ep_buffer_factor, grad_reduce_barrier and
  decode_kernels are the section's COMPUTE knobs; the experts' count and width are parameters' shapes. A retired knob
  a saved config still holds (kernel_cast) resumes."""
  from meshlm.models.ffns.moe import MoEConfig
  assert MoEConfig.COMPUTE == ("impl", "grouped_matmul", "megablox_tiling", "kernel_fsdp", "ep_impl",
                               "ep_buffer_factor", "grad_reduce_barrier", "decode_kernels")
  cfg = load_config("model=mixtral-tiny")
  saved = cfg.model.model_dump(mode="json")
  moe = saved["parts"]["moe"]
  other = dict(moe, impl="reference", grouped_matmul="megablox", megablox_tiling=[256, 512, 512],
               kernel_fsdp="experts", ep_impl="compact", ep_buffer_factor=2.0, kernel_cast="bits",
               grad_reduce_barrier=True, decode_kernels="split")
  assert _model_mismatch(dict(saved, parts={"moe": other}), cfg) is None
  assert _model_mismatch(dict(saved, parts={"moe": dict(moe, mlp_dim=128)}), cfg) == (
      "model.parts.moe.mlp_dim is 256 here but 128 in the checkpoint")


@pytest.mark.parametrize("override, msg", [
    ("model.parts.moe.impl=capacity", r"^model\.parts\.moe\.impl: Input should be 'dropless' or 'reference' "
     r"\(got 'capacity'\) \(the moe part's knobs: num_experts, num_experts_per_tok, mlp_dim, "),
    ("model.parts.moe.moe_impl=reference", r"^model\.parts\.moe\.moe_impl: unknown knob \(the moe part's knobs: "),
    ("model.parts.moe.num_experts_per_tok=9", r"^model\.parts\.moe\.num_experts_per_tok: 9 is larger than "
     r"num_experts=8: each token can be routed to at most every expert"),
    ("model.num_experts_per_tok=9", r"^model\.parts\.moe\.num_experts_per_tok: 9 is larger"),  # the old key
    ("model.parts.moe.num_experts=0", r"^model\.parts\.moe\.num_experts: Input should be greater than 0 \(got 0\)"),
    ("model.parts.moe.router_dtype=float16", r"^model\.parts\.moe\.router_dtype: Input should be 'float32' or "
     r"'bfloat16'"),
    ("model.parts.moe.megablox_tiling=[100,1024,1024]", r"^model\.parts\.moe\.megablox_tiling: \[100, 1024, 1024\]: "
     r"tm must be a positive multiple of 8 and tk, tn of 128"),
])
def test_the_moe_section_refuses_a_bad_or_unknown_knob_naming_the_key(override, msg):
  with pytest.raises(ConfigError, match=msg):
    moe_knobs(override)
  assert moe_knobs("model.parts.moe.num_experts_per_tok=8").num_experts_per_tok == 8  # control: at most every expert


@pytest.mark.parametrize("knob", ["num_experts", "mlp_dim"])
def test_a_required_moe_knob_is_named_when_missing(knob):
  """A family with the moe part checks its section whether model.parts holds it or not: num_experts and mlp_dim
  have no default. Control: the same tree with the knob."""
  tree = load_config("model=mixtral-tiny").model_dump(mode="json")
  moe = tree["model"]["parts"]["moe"]
  for parts, named in (({"moe": {k: v for k, v in moe.items() if k != knob}}, knob), ({}, "num_experts")):
    with pytest.raises(ConfigError, match=f"^model.parts.moe.{named}: required by model.family=mixtral \\(its moe "
                       f"layers\\); set model.parts.moe.{named}=...$"):
      registry.validate(load_config(base=dict(tree, model=dict(tree["model"], parts=parts))))
  registry.validate(load_config(base=tree))


def test_a_family_without_the_moe_part_refuses_its_section_and_the_expert_axis():
  """qwen3_5 (dense) and llama refuse model.parts.moe, under its name and under an old key; only a model with the
  moe part may set mesh.expert above 1 (MeshRules.axes), and the moe part that it divides its experts."""
  for preset, family in (("qwen3.5-tiny", "qwen3_5"), ("llama2-tiny", "llama")):
    for key in ("model.parts.moe.num_experts=4", "model.num_experts=4"):
      with pytest.raises(ConfigError, match=f"^model.parts.moe: model family '{family}' has no part 'moe'"):
        registry.validate(load_config(f"model={preset}", key))
  with pytest.raises(ConfigError, match=r"^mesh.expert=2: llama2-tiny \(model.family=llama\) has no moe layers"):
    registry.validate(load_config("model=llama2-tiny", "mesh.expert=2"))
  with pytest.raises(ConfigError, match=r"^mesh.expert=3 does not divide model.parts.moe.num_experts=8"):
    registry.validate(load_config("model=qwen3-moe-tiny", "mesh.expert=3"))
  assert registry.validate(load_config("model=qwen3-moe-tiny", "mesh.expert=4")).mesh.expert == 4  # control


# --- mla's ranks and head dims, moved into its section: model.q_lora_rank, ... -> model.parts.mla.* ----------------

def mla_knobs(*overrides, base=None):
  from meshlm.models.mixers import mla
  return mla.knobs(registry.validate(load_config("model=deepseek-v3-tiny", *overrides, base=base)).model)


def test_the_old_mla_keys_still_set_its_knobs():
  """The old flat keys set the same names under model.parts.mla, on the CLI over the preset's section and in a saved
  tree; the query heads stay the model's (num_heads, Part.needs)."""
  from meshlm.models.mixers import mla
  moved = {old: knob for old, (part, knob, _) in ModelConfig.MOVED.items() if part == "mla"}
  assert moved == {k: k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                  "rope_interleave")} | {"mla_absorb": "absorb"}
  assert not set(moved) & set(ModelConfig.model_fields) and mla.NEEDS == ("num_heads",)
  own = mla_knobs("model.q_lora_rank=null", "model.kv_lora_rank=16", "model.rope_interleave=false")
  assert (own.q_lora_rank, own.kv_lora_rank, own.rope_interleave, own.qk_rope_head_dim) == (None, 16, False, 8)
  tree = load_config("model=deepseek-v3-tiny").model_dump(mode="json")
  old = dict(tree, model=before_the_moves(dict(tree["model"], parts={
      "moe": tree["model"]["parts"]["moe"], "mla": dict(tree["model"]["parts"]["mla"], kv_lora_rank=16)})))
  assert old["model"]["kv_lora_rank"] == 16 and "parts" not in old["model"]
  assert mla_knobs(base=old) == mla_knobs("model.parts.mla.kv_lora_rank=16")


@pytest.mark.parametrize("override, msg", [
    ("model.parts.mla.qk_rope_head_dim=7", r"^model\.parts\.mla\.qk_rope_head_dim: 7 must be even \(RoPE rotates "
     r"pairs\)"),
    ("model.qk_rope_head_dim=7", r"^model\.parts\.mla\.qk_rope_head_dim: 7 must be even"),  # the old key
    ("model.parts.mla.kv_rank=8", r"^model\.parts\.mla\.kv_rank: unknown knob \(the mla part's knobs: q_lora_rank, "),
    ("model.parts.mla.v_head_dim=0", r"^model\.parts\.mla\.v_head_dim: Input should be greater than 0 \(got 0\)"),
    ("model.parts.mla.kv_lora_rank=null", r"^model\.parts\.mla\.kv_lora_rank: required by model\.family=deepseek_v3 "
     r"\(its mla layers\); set model\.parts\.mla\.kv_lora_rank=\.\.\.$"),
])
def test_the_mla_section_refuses_a_bad_or_unknown_knob_naming_the_key(override, msg):
  with pytest.raises(ConfigError, match=msg):
    mla_knobs(override)
  assert mla_knobs("model.parts.mla.qk_rope_head_dim=6").qk_rope_head_dim == 6  # control: even


def test_an_mla_section_without_its_ranks_is_refused_naming_the_first():
  tree = load_config("model=deepseek-v3-tiny").model_dump(mode="json")
  parts = dict(tree["model"]["parts"], mla={"absorb": False})
  with pytest.raises(ConfigError, match=r"^model\.parts\.mla\.kv_lora_rank: required by model\.family=deepseek_v3"):
    registry.validate(load_config(base=dict(tree, model=dict(tree["model"], parts=parts))))


def test_a_checkpoint_compares_the_mla_shapes_but_not_absorb():
  cfg = load_config("model=deepseek-v3-tiny")
  saved = cfg.model.model_dump(mode="json")
  mla = saved["parts"]["mla"]
  assert _model_mismatch(dict(saved, parts=dict(saved["parts"], mla=dict(mla, absorb=False))), cfg) is None
  assert _model_mismatch(dict(saved, parts=dict(saved["parts"], mla=dict(mla, rope_interleave=False))), cfg) == (
      "model.parts.mla.rope_interleave is True here but False in the checkpoint")


# --- gdn's heads, moved into its section: model.linear_num_key_heads, ... -> model.parts.gdn.key_heads, ... --------

def test_the_old_gdn_head_keys_still_set_its_knobs():
  """linear_num_key_heads, linear_num_value_heads, linear_key_head_dim and linear_value_head_dim set key_heads,
  value_heads, key_head_dim and value_head_dim, on the CLI and in a saved tree; the layer plan's keys
  (hybrid_layer_types, full_attention_interval) stay the model's."""
  from meshlm.models.mixers import gdn
  moved = {old: knob for old, (part, knob, _) in ModelConfig.MOVED.items() if part == "gdn"}
  assert moved == {"linear_num_key_heads": "key_heads", "linear_num_value_heads": "value_heads",
                   "linear_key_head_dim": "key_head_dim", "linear_value_head_dim": "value_head_dim",
                   "gdn_chunk_size": "chunk_size", "gdn_impl": "impl", "linear_conv_kernel_dim": "conv_kernel_dim"}
  assert not set(moved) & set(ModelConfig.model_fields)
  assert {"hybrid_layer_types", "full_attention_interval"} <= set(ModelConfig.model_fields)
  heads = lambda *o, base=None: (lambda k: (k.key_heads, k.value_heads, k.key_head_dim, k.value_head_dim))(  # noqa
      gdn.knobs(registry.validate(load_config("model=qwen3.5-tiny", *o, base=base)).model))
  assert heads() == (2, 4, 32, 32)
  assert heads("model.linear_num_key_heads=1", "model.linear_num_value_heads=3", "model.linear_key_head_dim=16",
               "model.linear_value_head_dim=8") == (1, 3, 16, 8)
  tree = load_config("model=qwen3.5-tiny").model_dump(mode="json")
  old = dict(tree, model=dict(before_the_moves(tree["model"]), linear_num_value_heads=6))
  assert old["model"]["linear_num_key_heads"] == 2 and heads(base=old) == (2, 6, 32, 32)


@pytest.mark.parametrize("override, msg", [
    ("model.parts.gdn.value_heads=3", r"^model\.parts\.gdn\.value_heads: 3 must be a multiple of key_heads=2 \(value "
     r"head n reads key head n // \(N / K\)\); set model\.parts\.gdn\.value_heads to a multiple of 2"),
    ("model.linear_num_value_heads=3", r"^model\.parts\.gdn\.value_heads: 3 must be a multiple of key_heads=2"),
    ("model.parts.gdn.key_heads=null", r"^model\.parts\.gdn\.key_heads: required by model\.family=qwen3_5 \(its gdn "
     r"layers\); set model\.parts\.gdn\.key_heads=\.\.\.$"),
    ("model.parts.gdn.heads=2", r"^model\.parts\.gdn\.heads: unknown knob \(the gdn part's knobs: key_heads, "),
])
def test_the_gdn_section_refuses_bad_heads_naming_the_key(override, msg):
  from meshlm.models.mixers import gdn
  with pytest.raises(ConfigError, match=msg):
    registry.validate(load_config("model=qwen3.5-tiny", override))
  ok = registry.validate(load_config("model=qwen3.5-tiny", "model.parts.gdn.value_heads=6"))  # control: 3 x 2
  assert gdn.knobs(ok.model).value_heads == 6


def test_a_checkpoint_compares_the_gdn_heads():
  cfg = load_config("model=qwen3.5-tiny")
  saved = cfg.model.model_dump(mode="json")
  assert _model_mismatch(dict(saved, parts={"gdn": dict(saved["parts"]["gdn"], value_heads=2)}), cfg) == (
      "model.parts.gdn.value_heads is 4 here but 2 in the checkpoint")
  assert _model_mismatch(dict(before_the_moves(saved), linear_num_value_heads=2), cfg) == (
      "model.parts.gdn.value_heads is 4 here but 2 in the checkpoint")


def test_a_null_section_drops_it_so_another_family_can_be_set_over_a_preset():
  """model.parts.<part>=null removes the section: qwen3.5-moe-tiny as the dense qwen3_5 (a preset's part the family
  lacks); control: without the null, qwen3_5 refuses the moe section."""
  cfg = registry.validate(load_config("model=qwen3.5-moe-tiny", "model.family=qwen3_5", "model.parts.moe=null"))
  assert set(cfg.model.parts) == {"gdn"}
  with pytest.raises(ConfigError, match="^model.parts.moe: model family 'qwen3_5' has no part 'moe'"):
    registry.validate(load_config("model=qwen3.5-moe-tiny", "model.family=qwen3_5"))


def test_a_saved_gdn_section_with_the_retired_kernel_knob_resumes():
  """model.parts.gdn.kernel was a copy of the top-level gdn_impl: a run's saved config that holds it loads (the knob
  dropped) and resumes; the section's COMPUTE knobs are chunk_size, impl and inverse. Control: a shape knob still mismatches."""
  from meshlm.models.mixers.gdn import GDNConfig
  assert GDNConfig.COMPUTE == ("chunk_size", "impl", "inverse")
  cfg = load_config("model=qwen3.5-tiny")
  saved = cfg.model.model_dump(mode="json")
  gdn = saved["parts"]["gdn"]
  assert "kernel" not in GDNConfig.model_validate(dict(gdn, kernel="pallas")).model_dump()
  assert _model_mismatch(dict(saved, parts={"gdn": dict(gdn, kernel="pallas", chunk_size=32)}), cfg) is None
  assert _model_mismatch(dict(saved, parts={"gdn": dict(gdn, kernel="jax", key_heads=4)}), cfg) is not None
