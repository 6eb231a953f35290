"""The commands layer (src/meshlm/commands/): what `meshlm generate`, `convert` and model=PATH compose."""
from __future__ import annotations

from meshlm.cli import main


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err.strip().splitlines()
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
