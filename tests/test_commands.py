"""The commands layer (src/meshlm/commands/): what `meshlm generate`, `convert` and model=PATH compose."""
from __future__ import annotations

from meshlm.cli import main


def _one_error_line(capsys) -> str:
  err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln or "Traceback" in ln]
  assert len(err) == 1, err
  return err[0]


def test_generate_names_a_preset_as_a_preset(capsys, tmp_path, monkeypatch):
  """Rough edge 11: `meshlm generate llama2-tiny` said "nor a preset" about a preset."""
  monkeypatch.chdir(tmp_path)
  assert main(["generate", "llama2-tiny", "prompt=x"]) == 2
  msg = _one_error_line(capsys)
  assert msg.startswith("meshlm: error: generate llama2-tiny: a preset, which has no trained weights"), msg
  assert "meshlm train model=llama2-tiny" in msg
  # Negative control: a directory of that name is read as a directory (and refused as one, for lack of a model).
  (tmp_path / "llama2-tiny").mkdir()
  assert main(["generate", "llama2-tiny", "prompt=x"]) == 2
  assert "a preset" not in _one_error_line(capsys)


def test_a_run_directory_carries_its_tokenizer_and_converts(tmp_path, capsys):
  """Rough edges 2 and 7: a run trained with a tokenizer.json holds a copy, so model=RUN_DIR (generate,
  fine-tune) reads it; `convert meshlm-to-hf RUN_DIR` takes the newest checkpoint and copies it along, and so does
  `convert meshlm-to-hf RUN_DIR/checkpoints/N` (item 8). model=RUN_DIR carries the run's train.compute_dtype.
  Negative control: a byte-tokenizer run has no tokenizer.json and model=RUN_DIR stays on bytes."""
  import shutil
  from test_hf import FIXTURES, add_tokenizer
  from meshlm import load_config
  src = tmp_path / "llama-hf"
  shutil.copytree(FIXTURES / "llama", src)
  add_tokenizer(src)
  tok = tmp_path / "tok"
  tok.mkdir()
  shutil.move(src / "tokenizer.json", tok / "tokenizer.json")  # the HF dir has none: data.tokenizer names it
  small = ["cpu_devices=1", "train.seq_len=8", "train.per_device_batch_size=2", "train.sample_tokens=0",
           "train.compute_dtype=float32", "train.steps=2"]
  (tmp_path / "a.txt").write_text(" ".join(f"w{j % 40}" for j in range(200)))
  run = tmp_path / "run"
  assert main(["train", f"model={src}", *small, f"data.path={tmp_path}/a.txt", f"data.tokenizer={tok}",
               f"run_dir={run}"]) == 0
  assert (run / "tokenizer.json").read_text() == (tok / "tokenizer.json").read_text()
  assert load_config(f"model={run}").data.tokenizer == str(run / "tokenizer.json")
  # model=RUN_DIR (or a step of it) computes as the run trained, in float32, not the schema's bfloat16; an override
  # wins, and an HF directory (no meshlm record) keeps the default: the controls.
  for where in (run, run / "checkpoints" / "2"):
    assert load_config(f"model={where}").train.compute_dtype == "float32"
  assert load_config(f"model={run}", "train.compute_dtype=bfloat16").train.compute_dtype == "bfloat16"
  assert load_config(f"model={src}").train.compute_dtype == "bfloat16"
  out = tmp_path / "hf-out"
  capsys.readouterr()
  assert main(["convert", "meshlm-to-hf", str(run), str(out), "cpu_devices=1"]) == 0
  assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
  assert f"{run} -> {out}" in capsys.readouterr().out
  # docs/hf.md's form, a step directory (which holds no tokenizer), writes the run's tokenizer too.
  step_out = tmp_path / "hf-step-out"
  assert main(["convert", "meshlm-to-hf", str(run / "checkpoints" / "2"), str(step_out), "cpu_devices=1"]) == 0
  assert (step_out / "tokenizer.json").read_text() == (tok / "tokenizer.json").read_text()
  # Rough edge 1: an HF dir (vocab 151) with no tokenizer names the real fixes; synthetic data needs none.
  capsys.readouterr()
  assert main(["train", f"model={src}", *small, f"run_dir={tmp_path / 'refused'}"]) == 2
  msg = _one_error_line(capsys)
  assert msg == ("meshlm: error: model.vocab_size=151 is too small for the byte tokenizer, which has 257 ids (256 "
                 "bytes + EOS); give data.tokenizer=PATH (the model's tokenizer.json), or use data.source=synthetic")
  bare = tmp_path / "bare"
  assert main(["train", f"model={src}", *small, "data.source=synthetic", f"run_dir={bare}"]) == 0
  assert not (bare / "tokenizer.json").exists()
  assert load_config(f"model={bare}").data.tokenizer == "byte"
