"""HF import of the Gated DeltaNet hybrids (qwen3_next, qwen3_5, qwen3_5_moe) beyond tests/test_hf.py's parity,
export and config tests, which cover their fixtures too: the multimodal and fused-expert layouts give the same
parameters as the text layout, the vision tower and the mtp head are skipped with one notice, layout mistakes
fail parity, and bad config.json files fail in one line naming the field or tensor.

rel(a, b) = max|a - b| / max|b| over the whole tensor, as in tests/test_hf.py.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlm import forward, hf
from meshlm.errors import ConfigError
from meshlm.models.mixers import gdn as gdn_mixer

from hf_layouts import copy_fused, copy_multimodal, read_tensors, reference_forms, text_layout, write_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ONE = ("train.compute_dtype=float32", "cpu_devices=1")
GDN_TOL = 1e-5  # tests/test_hf.py's bound for these fixtures (measured errors there)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


_forwards: dict = {}


def parity_error(cfg, params, name: str, *, reuse: bool = False) -> float:
  """The largest rel error over the logits and every layer's hidden state against the fixture's reference.
  reuse=True takes the jitted forward of an equal config from earlier calls (a control that changes only the
  parameters runs the correct config's compiled program); without it every call traces its own (a patched rule
  must be traced)."""
  ref = np.load(FIXTURES / name / "reference.npz")
  key = cfg.model_dump_json()
  fn = _forwards.get(key) if reuse else None
  if fn is None:
    fn = jax.jit(lambda p, x: forward(cfg, p, x, return_hidden=True))
    if reuse:
      _forwards[key] = fn
  with jax.set_mesh(jax.tree.leaves(params)[0].sharding.mesh):
    logits, hidden = fn(params, ref["input_ids"])
  return max([rel(logits, ref["logits"])] + [rel(hidden[i], ref["hidden"][i]) for i in range(hidden.shape[0])])


def assert_same_params(a: dict, b: dict) -> None:
  fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in fa] == [p for p, _ in fb]
  for (p, x), (_, y) in zip(fa, fb):
    assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(p)


def skip_notices(err: str) -> list[str]:
  return [line for line in err.splitlines() if "skipped" in line]


# ---------------------------------------------------------------------------------------------
# The chunked gated delta rule against transformers (test_hf.py runs the model's default rule)

SHARDED = ("train.compute_dtype=float32", "cpu_devices=3", "mesh.fsdp=3")


GDN_FIXTURES = ("qwen3-next", "qwen3.5", "qwen3.5-moe", "qwen3.5-moe-vl")


def test_hf_parity_runs_the_chunked_rule_in_chunks_of_64():
  """tests/test_hf.py's test_logits_and_hidden_match_transformers loads each GDN fixture as it comes (fsdp=3), so
  it checks the chunked rule in chunks of 64 against transformers (T = 150 is two whole chunks and a partial one;
  measured, JAX 0.12.0.1: at most 4.4e-6, qwen3.5's layer 5) on qwen3-next, qwen3.5 and qwen3.5-moe-vl, and
  tests/test_conformance.py on qwen3.5-moe's logits; so this file does not run those programs again; it checks
  another chunk size."""
  for name in GDN_FIXTURES:
    own = gdn_mixer.knobs(hf.load(FIXTURES / name, "cpu_devices=1")[0].model)
    assert (own.impl, own.chunk_size, own.conv_kernel_dim) == ("chunked", 64, 4), name


def test_an_imported_model_takes_the_gdn_knobs_under_either_key_but_keeps_its_conv():
  """config.json's linear_conv_kernel_dim is the gdn part's conv_kernel_dim; the chunk and the rule may be set under
  the new key or the old one, another conv is a shape change of the loaded parameters, refused naming the key."""
  import meshlm
  path = f"model={FIXTURES / 'qwen3.5'}"
  for chunk in ("model.gdn_chunk_size=16", "model.parts.gdn.chunk_size=16"):
    own = gdn_mixer.knobs(meshlm.load_config(path, chunk, "model.gdn_impl=reference").model)
    assert (own.chunk_size, own.impl, own.conv_kernel_dim) == (16, "reference", 4), chunk
  for key in ("model.linear_conv_kernel_dim", "model.parts.gdn.conv_kernel_dim"):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=3: would change the shape of parameters loaded"):
      meshlm.load_config(path, f"{key}=3")


# The reference recurrence against transformers is this chain, each link tested: the chunked rule (chunks of 64) against
# transformers on all four fixtures (tests/test_hf.py, per-layer hidden states, GDN_TOL), and the chunked rule against
# the reference inside the fused mixer (tests/test_qwen3_next.py, T = 150 in chunks of 64, documents and padding,
# outputs and every gradient) and alone (tests/test_gdn.py, odd lengths, outputs, final state and every gradient); the
# rule runs after the projections, so the layout does not reach it. (Two fsdp=3 parity compiles were here for it.)
@pytest.mark.parametrize("name, impl, chunk", [("qwen3-next", "chunked", 16)])
def test_other_rules_match_transformers(name, impl, chunk):
  """The chunked rule in nine chunks of 16 (and a partial one) on fsdp=3, the fused layout."""
  cfg, params = hf.load(FIXTURES / name, *SHARDED, f"model.parts.gdn.impl={impl}",
                        f"model.parts.gdn.chunk_size={chunk}")
  assert parity_error(cfg, params, name) <= GDN_TOL


def test_fixtures_depend_on_the_state_carried_across_a_chunk(monkeypatch):
  """A rule that drops the state at position 64 (a chunked rule that does not carry it) fails parity by far: the
  fixtures' decay rates keep some heads' memory beyond a chunk (scripts/make_hf_fixtures.py)."""
  from meshlm.nn import gdn as rule
  real = rule.gated_delta_rule_reference

  def forgets_at_64(q, k, v, g, beta, *, segment_ids_BT=None, initial_state_BNHJ=None):
    o1, _ = real(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], initial_state_BNHJ=initial_state_BNHJ)
    o2, state = real(q[:, 64:], k[:, 64:], v[:, 64:], g[:, 64:], beta[:, 64:])
    return jax.numpy.concatenate([o1, o2], axis=1), state

  for name in ("qwen3-next", "qwen3.5"):
    cfg, params = hf.load(FIXTURES / name, *ONE, *reference_forms(FIXTURES / name))
    monkeypatch.setattr(rule, "gated_delta_rule_reference", forgets_at_64)
    err = parity_error(cfg, params, name)
    monkeypatch.setattr(rule, "gated_delta_rule_reference", real)
    assert err > 100 * GDN_TOL, f"{name}: dropping the state at 64 moves the outputs by only {err:.2e}"


# ---------------------------------------------------------------------------------------------
# Layouts: multimodal, fused experts

@pytest.mark.parametrize("name, model_type, arch, fused", [
    ("qwen3.5", "qwen3_5", "Qwen3_5ForConditionalGeneration", False),
    ("qwen3.5-moe", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", True),
])
def test_multimodal_layout_reads_the_text_model(name, model_type, arch, fused, tmp_path, capsys):
  """The published layout (text_config, model.language_model., model.visual.*, mtp.*, fused experts for the MoE)
  gives the text fixture's config and parameters bit for bit, with one line naming what was skipped."""
  cfg, params = hf.load(FIXTURES / name, *ONE)
  capsys.readouterr()
  src = copy_multimodal(FIXTURES / name, tmp_path / name, model_type, arch, fused=fused)
  assert any(k.startswith("model.language_model.layers.") for k in read_tensors(src))
  cfg2, params2 = hf.load(src, *ONE)
  notices = skip_notices(capsys.readouterr().err)
  assert notices == [f"meshlm: {src}: skipped 2 under mtp.* and 2 under model.visual.* (not part of the text "
                     "model)"], notices
  assert cfg2.model == cfg.model
  assert_same_params(params2, params)
  # Its export is the text model's own layout: the fixture's tensors, names and config.
  out = hf.save(cfg2, params2, tmp_path / "export")
  ours, theirs = read_tensors(out), read_tensors(FIXTURES / name)
  assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in theirs)
  assert json.loads((out / "config.json").read_text())["architectures"] == \
      json.loads((FIXTURES / name / "config.json").read_text())["architectures"]


@pytest.mark.parametrize("name", ["qwen3-next", "qwen3.5-moe"])
def test_fused_experts_give_the_per_expert_params(name, tmp_path, capsys):
  """mlp.experts.gate_up_proj [E, 2F, D] and mlp.experts.down_proj [E, D, F] read as the per-expert tensors; the
  export writes one tensor per expert again, the fixture's bit for bit."""
  _, params = hf.load(FIXTURES / name, *ONE)
  src = copy_fused(FIXTURES / name, tmp_path / name)
  names = read_tensors(src)
  assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in k for k in names)
  cfg2, params2 = hf.load(src, *ONE)
  assert skip_notices(capsys.readouterr().err) == []
  assert_same_params(params2, params)
  ours = read_tensors(hf.save(cfg2, params2, tmp_path / "export"))
  theirs = read_tensors(FIXTURES / name)
  assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in theirs)


def test_fused_experts_load_sharded_over_experts():
  """Under mesh.expert=5 each device reads its own expert's rows of the fused tensors: the same values."""
  _, params = hf.load(FIXTURES / "qwen3.5-moe-vl", "cpu_devices=1")
  _, sharded = hf.load(FIXTURES / "qwen3.5-moe-vl", "cpu_devices=5", "mesh.expert=5", "mesh.fsdp=1")
  assert "expert" in str(sharded["layers"]["full_attn"]["moe"]["gate"].sharding.spec)
  assert_same_params(sharded, params)


def test_multimodal_fixture_skips_its_vision_tower_and_mtp_once(capsys):
  """qwen3.5-moe-vl as transformers wrote it (plus the mtp.* tensors of the Hub checkpoints): one notice line
  per load, counting every tensor not read; its fused experts equal their per-expert reading."""
  src = FIXTURES / "qwen3.5-moe-vl"
  tensors = read_tensors(src)
  n_visual = sum(k.startswith("model.visual.") for k in tensors)
  n_mtp = sum(k.startswith("mtp.") for k in tensors)
  assert n_visual > 10 and n_mtp > 0
  cfg, params = hf.load(src, *ONE)
  assert skip_notices(capsys.readouterr().err) == [
      f"meshlm: {src}: skipped {n_mtp} under mtp.* and {n_visual} under model.visual.* (not part of the text model)"]
  assert cfg.model.family == "qwen3_5_moe" and cfg.model.hybrid_layer_types == ["linear_attention", "full_attention"]
  # The gate rows of expert 3 of layer 1, as stored fused, are meshlm's gate kernel transposed.
  fused = tensors["model.language_model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, D]
  gate = np.asarray(params["layers"]["full_attn"]["moe"]["gate"])[0, 3]  # [D, F]
  assert np.array_equal(gate, fused[3, :gate.shape[1]].T)
  assert text_layout(tensors)["model.layers.1.mlp.experts.3.up_proj.weight"].shape == (22, 45)


# ---------------------------------------------------------------------------------------------
# Negative controls: layout mistakes the parity check must catch

def swap_halves(x, axis=-1):
  a, b = np.split(np.asarray(x), 2, axis=axis)
  return jax.device_put(np.concatenate([b, a], axis=axis), x.sharding)


def shifted_layers(cfg, params):
  """The layer pattern rotated by one: the same number of linear and full layers (the stacks still fit), run in
  the wrong places."""
  types = list(cfg.model.hybrid_types())
  m = cfg.model.model_copy(update={"hybrid_layer_types": types[1:] + types[:1], "full_attention_interval": None})
  return cfg.model_copy(update={"model": m}), params


def swapped_b_a(cfg, params):
  """beta's and the decay's projections exchanged: qwen3-next's per-key-head b | a halves, qwen3.5's in_proj_b
  and in_proj_a."""
  gdn = dict(params["layers"]["linear_attn"]["linear_attn"])
  if "in_proj_ba" in gdn:
    gdn["in_proj_ba"] = swap_halves(gdn["in_proj_ba"])
  else:
    gdn["in_proj_b"], gdn["in_proj_a"] = gdn["in_proj_a"], gdn["in_proj_b"]
  layers = {**params["layers"], "linear_attn": {**params["layers"]["linear_attn"], "linear_attn": gdn}}
  return cfg, {**params, "layers": layers}


def swapped_q_gate(cfg, params):
  """Each full-attention head's q | gate read the other way round."""
  attn = {**params["layers"]["full_attn"]["attn"]}
  attn["q"] = swap_halves(attn["q"])
  layers = {**params["layers"], "full_attn": {**params["layers"]["full_attn"], "attn": attn}}
  return cfg, {**params, "layers": layers}


CONTROLS = {"shifted_layers": shifted_layers, "swapped_b_a": swapped_b_a, "swapped_q_gate": swapped_q_gate}


@functools.cache
def loaded(name: str):
  """(cfg, params, parity error) of a fixture on one device in its reference forms (reference_forms), once per
  module: the three controls share it, and the two that change only parameters run its compiled forward."""
  cfg, params = hf.load(FIXTURES / name, *ONE, *reference_forms(FIXTURES / name))
  return cfg, params, parity_error(cfg, params, name, reuse=True)


# The fused layout (qwen3-next) and the separate one (qwen3.5); qwen3.5-moe's adapter reads its GDN and attention
# layers through the same hybrid_layer_map and separate projections as qwen3.5 (its parity test above still runs).
@pytest.mark.parametrize("control", list(CONTROLS))
@pytest.mark.parametrize("name", ["qwen3-next", "qwen3.5"])
def test_layout_mistakes_fail_parity(name, control):
  cfg, params, ok = loaded(name)
  assert ok <= GDN_TOL
  err = parity_error(*CONTROLS[control](cfg, params), name, reuse=True)
  assert err > 10 * GDN_TOL, f"{name} with {control}: rel error {err:.2e} would pass (or nearly)"


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the field or the tensor

def copy_with_config(name: str, tmp_path: Path, **changes) -> Path:
  import shutil
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  cfg = json.loads((dst / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  (dst / "config.json").write_text(json.dumps(cfg))
  return dst


@pytest.mark.parametrize("name, changes, message", [
    ("qwen3.5", dict(layer_types=["linear_attention", "sliding_attention"] * 3),
     "config.json: layer_types has 'sliding_attention'; meshlm's qwen3_5 reads only linear_attention and "
     "full_attention"),
    ("qwen3.5", dict(layer_types=["linear_attention", "full_attention"]),
     "must list one type per layer (num_hidden_layers=6)"),
    ("qwen3.5", dict(num_experts=4), "config.json: num_experts=4: Qwen3_5ForCausalLM is dense"),
    ("qwen3.5", dict(linear_num_value_heads=None), "config.json: missing field 'linear_num_value_heads'"),
    ("qwen3.5", dict(linear_num_value_heads=5), "model.parts.gdn.value_heads: 5 must be a multiple of key_heads=2"),
    ("qwen3.5", dict(attn_output_gate=False), "attn_output_gate=False is not supported"),
    ("qwen3-next", dict(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported (every layer of these families "
                                              "is MoE)"),
    ("qwen3-next", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    ("qwen3.5-moe", dict(architectures=["Qwen3_5MoeForConditionalGeneration"]),
     "architectures=['Qwen3_5MoeForConditionalGeneration'] is not supported for model_type='qwen3_5_moe_text'"),
    ("qwen3.5-moe-vl", dict(text_config=None), "model_type='qwen3_5_moe' needs the text model's fields under "
                                               "'text_config'"),
    ("qwen3.5-moe-vl", dict(architectures=["Qwen3_5MoeForCausalLM"]),
     "architectures=['Qwen3_5MoeForCausalLM'] is not supported for model_type='qwen3_5_moe'; expected "
     "Qwen3_5MoeForConditionalGeneration"),
])
def test_bad_config(name, changes, message, tmp_path):
  src = copy_with_config(name, tmp_path, **changes)
  with pytest.raises(ConfigError, match=re.escape(message)):
    hf.load(src, "cpu_devices=1")


def test_bad_fused_and_missing_experts_name_the_tensor(tmp_path):
  src = copy_fused(FIXTURES / "qwen3.5-moe", tmp_path / "fused")
  tensors = read_tensors(src)
  name = "model.layers.2.mlp.experts.gate_up_proj"
  tensors[name] = tensors[name][:, 1:]  # [5, 43, 45]
  write_tensors(src, tensors)
  with pytest.raises(ConfigError, match=re.escape(f"tensor {name}: shape [5, 43, 45], but config.json implies "
                                                  "[5, 44, 45] (5 on the {e} axis, fused)")):
    hf.load(src, "cpu_devices=1")
  del tensors[name]
  write_tensors(src, tensors)
  with pytest.raises(ConfigError, match=re.escape("missing tensor model.layers.2.mlp.experts.0.gate_proj.weight "
                                                  "(expected shape [22, 45])")):
    hf.load(src, "cpu_devices=1")
  # Outside the skipped prefixes an unknown tensor is still refused.
  tensors = read_tensors(FIXTURES / "qwen3.5")
  tensors["model.visual2.w"] = np.zeros(3, np.float32)
  write_tensors(src, tensors)
  (src / "config.json").write_text((FIXTURES / "qwen3.5" / "config.json").read_text())
  with pytest.raises(ConfigError, match=re.escape("unexpected tensor model.visual2.w in model.safetensors")):
    hf.load(src, "cpu_devices=1")


# ---------------------------------------------------------------------------------------------
# Other spellings of the same config, and exports of models that never came from Hugging Face

def test_transformers_4_and_mrope_spellings_read_the_same_model(tmp_path):
  """transformers 4's config.json (rope_theta and partial_rotary_factor at the top level, no rope_parameters, the
  pattern as full_attention_interval without layer_types) and qwen3.5's MRoPE fields (mrope_section,
  mrope_interleaved: plain RoPE for text) give the same model and the same numbers."""
  # The reference forms, as loaded("qwen3-next") runs them: the same program, compiled once per run (the
  # compilation cache).
  cfg, params = hf.load(FIXTURES / "qwen3-next", *ONE, *reference_forms(FIXTURES / "qwen3-next"))
  src = copy_with_config("qwen3-next", tmp_path, rope_parameters=None, layer_types=None, rope_theta=1000.0,
                         partial_rotary_factor=0.25, full_attention_interval=2)
  cfg4, params4 = hf.load(src, *ONE, *reference_forms(FIXTURES / "qwen3-next"))
  assert cfg4.model.full_attention_interval == 2 and cfg4.model.hybrid_layer_types is None
  assert cfg4.model.hybrid_types() == cfg.model.hybrid_types()
  assert cfg4.model.model_copy(update={"full_attention_interval": None,
                                       "hybrid_layer_types": cfg.model.hybrid_layer_types}) == cfg.model
  assert_same_params(params4, params)
  assert parity_error(cfg4, params4, "qwen3-next") <= GDN_TOL
  rope = json.loads((FIXTURES / "qwen3.5" / "config.json").read_text())["rope_parameters"]
  src = copy_with_config("qwen3.5", tmp_path, rope_parameters={**rope, "mrope_section": [1, 1, 0],
                                                               "mrope_interleaved": True})
  assert hf.load(src, *ONE)[0].model == hf.load(FIXTURES / "qwen3.5", *ONE)[0].model


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_preset_export_round_trips(preset, tmp_path):
  """A model initialized from a preset exports (config from full_attention_interval) and loads back bit for bit."""
  from meshlm import load_config
  from meshlm.models.params import init_params
  cfg = load_config(f"model={preset}", "cpu_devices=1")
  params = init_params(cfg, jax.random.key(0))
  out = hf.save(cfg, params, tmp_path / "export")
  written = json.loads((out / "config.json").read_text())
  assert written["layer_types"] == list(cfg.model.hybrid_types())
  cfg2, params2 = hf.load(out, "cpu_devices=1")
  assert cfg2.model.hybrid_types() == cfg.model.hybrid_types()
  assert_same_params(params2, params)
