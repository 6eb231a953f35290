"""The README's Python lines work as written: every ```python block, in order, as one fresh script."""
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
  return FENCE.findall(text)


def test_block_extraction_finds_each_python_block_and_nothing_else():
  text = "a\n```python\nx = 1\n```\n```\nshell only\n```\n```python\ny = x\n```\n"
  assert python_blocks(text) == ["x = 1\n", "y = x\n"]


def test_every_python_block_of_the_readme_runs(tmp_path):
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 2, "the README's Python API section should hold Python blocks"
  script = tmp_path / "readme_blocks.py"
  script.write_text("\n".join(blocks))
  # A fresh interpreter: in this process other tests have imported meshlm.hf already, which would
  # hide an `import meshlm` that does not reach meshlm.hf. The cwd is a scratch dir for its files.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]


def test_import_meshlm_reaches_hf_lazily():
  code = ("import sys, meshlm\n"
          "assert 'meshlm.hf' not in sys.modules  # import meshlm stays cheap\n"
          "assert callable(meshlm.hf.load) and callable(meshlm.hf.save)\n"
          "assert 'hf' in dir(meshlm)\n"
          "try:\n  meshlm.no_such_name\nexcept AttributeError as e:\n  print(e)\n")
  p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "no attribute 'no_such_name'" in p.stdout


# The front pages stay short (issue 32): what meshlm is and links in the README, current figures in
# docs/performance.md; detail goes to docs/, history to docs/performance-log.md.
LINE_LIMITS = {"README.md": 250, "docs/performance.md": 400}


def too_long(root: Path, limits: dict[str, int]) -> list[str]:
  return [f"{name}: {n} lines (at most {limit})" for name, limit in limits.items()
          if (n := len((root / name).read_text().splitlines())) > limit]


def test_the_readme_and_the_performance_page_stay_short(tmp_path):
  assert too_long(README.parent, LINE_LIMITS) == []
  (tmp_path / "long.md").write_text("x\n" * 11)  # control: one line over its limit is named
  assert too_long(tmp_path, {"long.md": 10}) == ["long.md: 11 lines (at most 10)"]
