"""What `meshlm train` adds around train.loop.train: the run directory carries its tokenizer and chat template (copied
once the loop returns, whatever its stop reason, so that a config the loop refuses leaves nothing behind)."""
from __future__ import annotations

import os
from pathlib import Path

from meshlm.config import Config
from meshlm.fsutil import write_text


def tokenizer_file(cfg: Config) -> Path | None:
  """The tokenizer.json data.tokenizer names (the file, or the one in the directory it names); None for byte."""
  t = cfg.data.tokenizer
  if t == "byte":
    return None
  p = Path(t)
  p = p / "tokenizer.json" if p.is_dir() else p
  return p if p.is_file() else None


def carry_tokenizer(cfg: Config) -> None:
  """Copies the run's tokenizer.json into run_dir, so that model=RUN_DIR (generate, a fine-tune, convert)
  reads text with the tokenizer the run trained with, as it does from a model directory. Process 0 only."""
  import jax
  src = tokenizer_file(cfg)
  dst = Path(cfg.run_dir) / "tokenizer.json"
  if src is None or jax.process_index() != 0 or src.resolve() == dst.resolve():
    return
  _write_once(dst, src.read_text())
  from meshlm.train.data.chat import load_chat_template
  template = load_chat_template(cfg.data.chat_template, str(src))
  if template is not None:
    # model=RUN_DIR finds it beside the tokenizer (meshlm generate chat=true renders with it).
    _write_once(Path(cfg.run_dir) / "chat_template.jinja", template.source)


def _write_once(dst: Path, text: str) -> None:
  if not (dst.is_file() and dst.read_text() == text):
    os.makedirs(dst.parent, exist_ok=True)
    write_text(dst, text)
