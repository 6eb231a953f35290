"""Files and directories that appear only when complete."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from meshlm.errors import ConfigError


def publish_permissions(tmp: Path) -> None:
  """mkdtemp makes a 0700 directory and some writers make 0600 files: give a finished directory the
  permissions a plain mkdir and open would have (under the process umask)."""
  mask = os.umask(0)
  os.umask(mask)
  for root, dirs, files in os.walk(tmp):
    os.chmod(root, 0o777 & ~mask)
    for f in files:
      os.chmod(os.path.join(root, f), 0o666 & ~mask)


@contextlib.contextmanager
def new_dir(path: str | os.PathLike, *, overwrite: bool = False, hint: str = "choose another directory") -> Iterator[Path]:
  """Yields a temporary sibling of `path` to fill; renames it to `path` when the block finishes, so a
  failed write leaves nothing behind. An existing `path` is replaced only with overwrite (renamed
  aside first, then removed), else refused in one line ending with `hint`."""
  path = Path(path).absolute()
  if path.exists() and not overwrite:
    raise ConfigError(f"{path}: already exists ({hint})")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
  try:
    yield tmp
    publish_permissions(tmp)
    if path.exists():
      old = path.with_name(f".{path.name}.old-{os.getpid()}")
      os.rename(path, old)
      os.rename(tmp, path)
      shutil.rmtree(old)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def write_text(path: str | os.PathLike, text: str) -> None:
  """Replaces a file's contents in one rename: readers see the old file or the new, never half."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)
