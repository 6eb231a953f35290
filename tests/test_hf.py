"""Hugging Face import/export against the fixtures of scripts/make_hf_fixtures.py (no torch here).

Relative error, everywhere in this file: rel(a, b) = max|a - b| / max|b| over the whole tensor, with
b the transformers reference; logits and each layer's hidden state are checked separately.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from meshlm import forward, hf
from meshlm.config import ConfigError
from meshlm.hf import convert
from meshlm.hf.io import families

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
TOL = 1e-5
# Explicit sharding on 3 devices: fsdp=3 divides embed 45, so loads really read slices.
SHARDED = ("train.compute_dtype=float32", "cpu_devices=3", "mesh.fsdp=3")


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def model_type(name: str) -> str:
  return json.loads((FIXTURES / name / "config.json").read_text())["model_type"]


def need_family(name: str) -> None:
  if model_type(name) not in families():
    pytest.skip(f"model_type={model_type(name)!r} has no family registered in decoder.FAMILIES yet")


def _re(text: str) -> str:
  return re.escape(text)


def mesh_of(params):
  return jax.tree.leaves(params)[0].sharding.mesh


def run_forward(cfg, params, ids):
  with jax.set_mesh(mesh_of(params)):
    return jax.jit(lambda p, x: forward(cfg, p, x, return_hidden=True))(params, ids)


def hf_tensors(path: Path) -> dict[str, np.ndarray]:
  out = {}
  for f in sorted(path.glob("*.safetensors")):
    out.update(load_file(f))
  return out


def test_own_families_have_fixtures_and_are_registered():
  # llama, mistral and qwen3 must never be skipped below.
  types = {model_type(n) for n in NAMES}
  assert {"llama", "mistral", "qwen3"} <= types
  assert {"llama", "mistral", "qwen3"} <= set(families())
  assert {"qwen3", "qwen3-tied"} <= set(NAMES)  # untied and tied heads


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_hidden_match_transformers(name):
  need_family(name)
  cfg, params = hf.load(FIXTURES / name, *SHARDED)
  ref = np.load(FIXTURES / name / "reference.npz")
  logits, hidden = run_forward(cfg, params, ref["input_ids"])
  assert logits.shape == ref["logits"].shape and hidden.shape == ref["hidden"].shape
  errs = [rel(hidden[i], ref["hidden"][i]) for i in range(hidden.shape[0])]
  assert max(errs) <= TOL, f"{name}: per-layer hidden rel errors {errs}"
  assert rel(logits, ref["logits"]) <= TOL


def test_llama_other_layouts_match():
  # auto mode, heads sharded on tensor=3, layers stacked on axis 1 and unrolled: same numbers.
  cfg, params = hf.load(FIXTURES / "llama", "train.compute_dtype=float32", "cpu_devices=3", "mesh.fsdp=1",
                        "mesh.tensor=3", "shard_mode=auto", "param_scan_axis=1", "scan_layers=false")
  assert params["layers"]["attn"]["q"].shape == (45, 2, 9, 8)  # [D, L, N, H]
  assert "tensor" in str(params["layers"]["attn"]["q"].sharding.spec)
  ref = np.load(FIXTURES / "llama" / "reference.npz")
  logits, hidden = run_forward(cfg, params, ref["input_ids"])
  assert rel(logits, ref["logits"]) <= TOL
  assert max(rel(hidden[i], ref["hidden"][i]) for i in range(2)) <= TOL


def test_llama3_rope_scaling_is_read():
  cfg, _ = hf.load(FIXTURES / "llama", "cpu_devices=1")
  assert cfg.model.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position": 64.0}
  assert cfg.model.rope_theta == 100.0


@pytest.mark.parametrize("name", NAMES)
def test_save_then_load_is_exact(name, tmp_path):
  need_family(name)
  cfg, params = hf.load(FIXTURES / name, *SHARDED)
  out = hf.save(cfg, params, tmp_path / "export")
  # The export holds the fixture's tensors bit for bit, under the same names.
  ours, theirs = hf_tensors(out), hf_tensors(FIXTURES / name)
  assert sorted(ours) == sorted(theirs)
  for k in theirs:
    assert np.array_equal(ours[k], theirs[k]), k
  cfg2, params2 = hf.load(out, *SHARDED)
  assert cfg2.model == cfg.model
  flat, flat2 = jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(params2)
  assert [p for p, _ in flat] == [p for p, _ in flat2]
  for (p, a), (_, b) in zip(flat, flat2):
    assert a.sharding == b.sharding, p
    assert np.array_equal(np.asarray(a), np.asarray(b)), p


def test_sharded_export_with_index(tmp_path):
  cfg, params = hf.load(FIXTURES / "qwen3", *SHARDED)
  out = hf.save(cfg, params, tmp_path / "export", max_shard_bytes=40_000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  files = sorted(p.name for p in out.glob("*.safetensors"))
  assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
  assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert sorted(index["weight_map"]) == sorted(hf_tensors(FIXTURES / "qwen3"))
  _, params2 = hf.load(out, *SHARDED)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_param_scan_axis_1_holds_the_same_values():
  _, p0 = hf.load(FIXTURES / "mistral", "cpu_devices=1")
  _, p1 = hf.load(FIXTURES / "mistral", "cpu_devices=1", "param_scan_axis=1")
  q0, q1 = np.asarray(p0["layers"]["attn"]["q"]), np.asarray(p1["layers"]["attn"]["q"])
  assert q0.shape == (2, 45, 9, 8) and np.array_equal(np.moveaxis(q1, 1, 0), q0)
  # HF q_proj [N*H, D] -> meshlm [D, N, H]
  w = load_file(FIXTURES / "mistral" / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
  assert np.array_equal(q0[1], w.reshape(9, 8, 45).transpose(2, 0, 1))


def test_bfloat16_checkpoint_loads(tmp_path):
  import ml_dtypes
  src = copy_fixture("mistral", tmp_path)
  tensors = load_file(src / "model.safetensors")
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(src / "model.safetensors"))
  _, params = hf.load(src, "cpu_devices=1")
  got = np.asarray(params["final_norm"])
  assert got.dtype == np.float32
  assert np.array_equal(got, tensors["model.norm.weight"].astype(ml_dtypes.bfloat16).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# Bad input: each error names the field or the tensor.

def copy_fixture(name: str, tmp_path: Path) -> Path:
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  return dst


def edit_config(path: Path, **changes) -> None:
  cfg = json.loads((path / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
  tensors = load_file(path / "model.safetensors")
  fn(tensors)
  save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="llamaa"), "model_type='llamaa' is not supported"),
    (dict(architectures=["LlamaForSequenceClassification"]), "architectures=['LlamaForSequenceClassification']"),
    (dict(hidden_size=None), "missing field 'hidden_size'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type='yarn' is not supported"),
    (dict(num_key_value_heads=9), "tensor model.layers.0.self_attn.k_proj.weight: shape [24, 45]"),
])
def test_bad_config(tmp_path, changes, message):
  src = copy_fixture("llama", tmp_path)
  edit_config(src, **changes)
  with pytest.raises(ConfigError, match=_re(message)):
    hf.load(src, "cpu_devices=1")


BAD_TENSORS = {
    "missing_tensor": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                       "missing tensor model.layers.1.mlp.up_proj.weight (expected shape [56, 45])"),
    "extra_tensor": (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((56, 45), np.float32)}),
                     "unexpected tensor model.layers.2.mlp.up_proj.weight in model.safetensors"),
    "shape_mismatch": (lambda t: t.update({"model.norm.weight": np.ones(44, np.float32)}),
                       "tensor model.norm.weight: shape [44] in model.safetensors, but config.json implies [45]"),
    "bad_dtype": (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].astype(np.int32)}),
                  "tensor lm_head.weight: dtype I32 cannot be loaded"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_name_the_tensor(case, tmp_path):
  edit, message = BAD_TENSORS[case]
  src = copy_fixture("llama", tmp_path)
  edit_tensors(src, edit)
  with pytest.raises(ConfigError, match=_re(message)):
    hf.load(src, "cpu_devices=1")


def test_tied_model_tolerates_a_stored_head_untied_does_not_lack_one(tmp_path):
  src = copy_fixture("qwen3-tied", tmp_path)
  edit_tensors(src, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  cfg, params = hf.load(src, "cpu_devices=1")
  assert cfg.model.tie_embeddings and "lm_head" not in params
  src = copy_fixture("qwen3", tmp_path)
  edit_tensors(src, lambda t: t.pop("lm_head.weight"))
  with pytest.raises(ConfigError, match=_re("missing tensor lm_head.weight")):
    hf.load(src, "cpu_devices=1")


def test_index_naming_a_missing_file(tmp_path):
  src = copy_fixture("llama", tmp_path)
  names = list(load_file(src / "model.safetensors"))
  index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
  (src / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ConfigError, match="model-00001-of-00002.safetensors, which does not exist"):
    hf.load(src, "cpu_devices=1")


def test_not_a_model_dir(tmp_path):
  with pytest.raises(ConfigError, match="no config.json"):
    hf.load(tmp_path, "cpu_devices=1")


# ---------------------------------------------------------------------------------------------
# Export writes to a temporary directory and renames: nothing half-written.

def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
  import safetensors.numpy
  cfg, params = hf.load(FIXTURES / "llama", "cpu_devices=1")
  real, calls = safetensors.numpy.save_file, []

  def flaky(*a, **k):
    calls.append(1)
    if len(calls) == 2:
      raise OSError("disk full")
    return real(*a, **k)

  monkeypatch.setattr(safetensors.numpy, "save_file", flaky)
  with pytest.raises(OSError, match="disk full"):
    hf.save(cfg, params, tmp_path / "export", max_shard_bytes=10_000)
  assert len(calls) == 2
  assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_existing_dir(tmp_path):
  cfg, params = hf.load(FIXTURES / "llama", "cpu_devices=1")
  (tmp_path / "export").mkdir()
  (tmp_path / "export" / "keep.txt").write_text("x")
  with pytest.raises(ConfigError, match="already exists"):
    hf.save(cfg, params, tmp_path / "export")
  assert [p.name for p in (tmp_path / "export").iterdir()] == ["keep.txt"]


def test_export_refuses_what_the_hf_class_cannot_hold(tmp_path):
  cfg, params = hf.load(FIXTURES / "llama", "cpu_devices=1", "model.sliding_window=8")
  with pytest.raises(ConfigError, match="model.sliding_window"):
    hf.save(cfg, params, tmp_path / "export")
  assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# meshlm convert

def test_convert_cli_round_trip(tmp_path):
  from meshlm.cli import main
  mid, out = tmp_path / "meshlm", tmp_path / "hf"
  assert main(["convert", "hf-to-meshlm", str(FIXTURES / "qwen3-tied"), str(mid), "cpu_devices=1"]) == 0
  assert (mid / "params").is_dir() and (mid / "config.yaml").is_file()
  assert json.loads((mid / "meta" / "metadata").read_text())["model"]["family"] == "qwen3"
  assert main(["convert", "meshlm-to-hf", str(mid), str(out), "cpu_devices=1"]) == 0
  ours, theirs = hf_tensors(out), hf_tensors(FIXTURES / "qwen3-tied")
  assert sorted(ours) == sorted(theirs)
  assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
  with safe_open(out / "model.safetensors", "numpy") as f:
    assert f.metadata() == {"format": "pt"}  # transformers refuses files without it
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is True
  # Exports are readable like any directory made under the umask (not mkdtemp's 0700).
  mask = os.umask(0)
  os.umask(mask)
  for d in (mid, out):
    assert d.stat().st_mode & 0o777 == 0o777 & ~mask
  assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("argv, message", [
    (["convert", "sideways", "a", "b"], "convert: expected a direction"),
    (["convert", "hf-to-meshlm", "only-one"], "expected SRC and DST, got 1 paths"),
    (["convert", "hf-to-meshlm", "/nonexistent/src", "/tmp/x"], "SRC /nonexistent/src is not a directory"),
])
def test_convert_cli_errors(argv, message, capsys):
  from meshlm.cli import main
  assert main(argv) == 2
  assert message in capsys.readouterr().err


def test_convert_cli_refuses_existing_dst(tmp_path, capsys):
  from meshlm.cli import main
  assert main(["convert", "hf-to-meshlm", str(FIXTURES / "llama"), str(tmp_path)]) == 2
  assert "already exists" in capsys.readouterr().err


def test_load_meshlm_shape_mismatch(tmp_path):
  mid = convert.save_meshlm(*hf.load(FIXTURES / "llama", "cpu_devices=1"), tmp_path / "m")
  with pytest.raises(ConfigError, match=r"params: cannot be read as this model's parameters"):
    convert.load_meshlm(mid, "cpu_devices=1", "model.mlp_dim=64")


def test_mistral_window_follows_transformers_defaults(tmp_path):
  src = copy_fixture("mistral", tmp_path)
  assert hf.load(src, "cpu_devices=1")[0].model.sliding_window == 8
  edit_config(src, sliding_window=None)  # absent: MistralConfig's default
  assert hf.load(src, "cpu_devices=1")[0].model.sliding_window == 4096
  cfg = json.loads((src / "config.json").read_text())
  cfg["sliding_window"] = None  # explicit null: no window (Mistral v0.3)
  (src / "config.json").write_text(json.dumps(cfg))
  assert hf.load(src, "cpu_devices=1")[0].model.sliding_window is None


def test_qwen3_sliding_layers_are_refused(tmp_path):
  src = copy_fixture("qwen3", tmp_path)
  edit_config(src, use_sliding_window=True)
  with pytest.raises(ConfigError, match=_re("use_sliding_window=True is not supported")):
    hf.load(src, "cpu_devices=1")
