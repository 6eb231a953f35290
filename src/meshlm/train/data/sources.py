"""Document sources, each a sequence of Docs: the stdlib corpus and text files (a file is a document),
JSONL lines and Parquet rows. Every process reads the same sources (see the package docstring)."""
from __future__ import annotations

import glob
import json
import os
import sysconfig
import threading
from typing import Any, NamedTuple, Sequence

import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.train.data.formats import FIELDS, infer_format, row_problem
from meshlm.train.data.tokenizers import replace_invalid_utf8

# Directories of the stdlib that are tests, tools or installed packages rather than library code.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                          "__pycache__"})
# JSONL files are scanned for line starts in chunks of this many bytes (bounded memory).
_SCAN_CHUNK = 1 << 24
# Parquet rows are shuffled within windows of this many row groups (see _ParquetRows).
PARQUET_WINDOW_GROUPS = 4


class Doc(NamedTuple):
  """One document: bytes or str, where it comes from (for messages), and the byte offset of its first
  invalid UTF-8 when the source already replaced it (JSONL, which is text), else None."""
  data: bytes | str
  where: str
  invalid_utf8_at: int | None = None


def stdlib_files() -> list[str]:
  """Non-empty .py files of the running Python's standard library, sorted (~700 files, ~11 MB)."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for folder, dirs, files in os.walk(root):
    # Pruning in place keeps os.walk out of site-packages, which can be 10x the stdlib.
    dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
    paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
  return sorted(p for p in paths if os.path.getsize(p) > 0)


def data_files(pattern: str | None, source: str = "text", key: str = "data.path") -> list[str]:
  """Files matching the glob `key` gives (data.path, or eval.path for the validation set; `**` recurses), sorted;
  each must be non-empty."""
  if not pattern:
    example = {"text": "corpus/**/*.txt", "jsonl": "corpus/*.jsonl", "parquet": "corpus/*.parquet"}[source]
    raise ConfigError(f"{key} is required when data.source={source}: set it to a glob, e.g. "
                      f"{key}='{example}'")
  paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise ConfigError(f"{key}={pattern!r} matches no files; check the glob (use ** to recurse)")
  for p in paths:
    if os.path.getsize(p) == 0:
      raise ConfigError(f"{key}={pattern!r}: file {p} is empty; remove it or narrow the glob")
  return paths


class _TextFiles:
  """A text file is one document, read as bytes."""

  def __init__(self, paths: Sequence[str]):
    self.paths = list(paths)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i: int) -> Doc:
    with open(self.paths[i], "rb") as f:
      return Doc(f.read(), self.paths[i])


def _line_number(path: str, offset: int) -> int:
  """1-based line of a byte offset. Only error paths call it: it reads the file up to the offset."""
  count = 0
  with open(path, "rb") as f:
    while offset > 0:
      chunk = f.read(min(_SCAN_CHUNK, offset))
      if not chunk:
        break
      count += chunk.count(b"\n")
      offset -= len(chunk)
  return count + 1


def _scan_lines(path: str, size: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
  """Byte spans [start, end) of the non-empty lines that start in [lo, hi), without the newline.

  Reads from lo - 1 to the end of the last such line, nothing else of the file.
  """
  newlines = []
  pos = max(lo - 1, 0)
  with open(path, "rb") as f:
    f.seek(pos)
    while pos < size:
      chunk = f.read(_SCAN_CHUNK)
      if not chunk:
        break
      nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")) + pos
      newlines.append(nl)
      pos += len(chunk)
      # The newline at or after hi - 1 ends the last line that starts before hi.
      if len(nl) and nl[-1] >= hi - 1:
        break
  nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
  starts = nl + 1
  starts = starts[(starts >= lo) & (starts < hi) & (starts < size)]
  if lo == 0:
    starts = np.concatenate([[0], starts])
  idx = np.searchsorted(nl, starts)  # the first newline at or after each start
  ends = np.full(len(starts), size, np.int64)  # a last line without a newline ends the file
  ends[idx < len(nl)] = nl[idx[idx < len(nl)]]
  keep = ends > starts
  return starts[keep].astype(np.int64), ends[keep].astype(np.int64)


class LineRef:
  """Where a row is, as `file:line` when printed; the line is counted only then (error paths)."""

  def __init__(self, path: str, start: int):
    self.path, self.start = path, start

  def __str__(self) -> str:
    return f"{self.path}:{_line_number(self.path, self.start)}"


class _JsonlLines:
  """JSONL lines: one document per non-empty line: the text in data.field, or (the SFT formats) the whole row,
  checked against data.format."""

  def __init__(self, paths: list[str], file_ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, field: str,
               fmt: str = "language_modeling"):
    self.paths, self.file_ids, self.starts, self.ends, self.field = paths, file_ids, starts, ends, field
    self.fmt = fmt
    self.fmt_from: str | None = None  # `file:line` whose fields data.format=auto read the format from

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, i: int) -> Doc:
    path, start, end = self.paths[self.file_ids[i]], int(self.starts[i]), int(self.ends[i])
    with open(path, "rb") as f:
      f.seek(start)
      raw = f.read(end - start)
    where = lambda: f"{path}:{_line_number(path, start)}"
    # JSON is Unicode text, so this holds for every tokenizer; the offset is in the file.
    text, bad = replace_invalid_utf8(raw)
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{where()}: not valid JSON ({e.msg}: column {e.colno})") from None
    if self.fmt != "language_modeling":
      problem = row_problem(obj, self.fmt, self.field)
      if problem is not None:
        # A row of another format: say which row set the format (auto), not only the row that differs.
        origin = f"; data.format=auto took {self.fmt} from {self.fmt_from} (data.format=NAME sets one)" \
            if problem.startswith("no field") and self.fmt_from not in (None, where()) else ""
        raise ConfigError(f"{where()}: {problem}{origin}")
      return Doc(obj, LineRef(path, start), None if bad is None else start + bad)
    if not isinstance(obj, dict):
      raise ConfigError(f"{where()}: expected a JSON object with a {self.field!r} field, got {type(obj).__name__}")
    if self.field not in obj:
      keys = ", ".join(list(obj)[:8]) or "none"
      raise ConfigError(f"{where()}: no field {self.field!r} (data.field); the line has keys: {keys}")
    value = obj[self.field]
    if not isinstance(value, str):
      raise ConfigError(f"{where()}: field {self.field!r} is {type(value).__name__}, expected a string")
    return Doc(value, path, None if bad is None else start + bad)


def _jsonl_lines(cfg: Config, key: str = "data.path") -> _JsonlLines:
  """The non-empty lines of the data.path files (named `key` in errors), in storage order, indexed by a scan for
  newlines."""
  paths = data_files(cfg.data.path, "jsonl", key)
  file_ids, starts, ends, first_lines = [], [], [], []
  for fid, path in enumerate(paths):
    size = os.path.getsize(path)
    s, e = _scan_lines(path, size, 0, size)
    if len(s):
      first_lines.append(sum(len(x) for x in starts))
    file_ids.append(np.full(len(s), fid, np.int32))
    starts.append(s)
    ends.append(e)
  cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
  lines = _JsonlLines(paths, cat(file_ids, np.int32), cat(starts, np.int64), cat(ends, np.int64), cfg.data.field)
  if first_lines:
    lines.fmt = _jsonl_format(cfg, lines, first_lines[0])
    if cfg.data.format == "auto":
      path, start = lines.paths[lines.file_ids[first_lines[0]]], int(lines.starts[first_lines[0]])
      lines.fmt_from = f"{path}:{_line_number(path, start)}"
  # Parse each file's first line now: a wrong format or data.field fails before training.
  for i in first_lines:
    lines[i]
  return lines


def _jsonl_format(cfg: Config, lines: _JsonlLines, first: int) -> str:
  """data.format, or (auto) the format the first row's fields say; a first row that fits none is refused."""
  if cfg.data.format != "auto":
    return cfg.data.format
  path, start, end = lines.paths[lines.file_ids[first]], int(lines.starts[first]), int(lines.ends[first])
  with open(path, "rb") as f:
    f.seek(start)
    raw = f.read(end - start)
  try:
    row = json.loads(replace_invalid_utf8(raw)[0])
  except json.JSONDecodeError:
    return "language_modeling"  # reading the line reports it
  fmt = infer_format(row, cfg.data.field) if isinstance(row, dict) else "language_modeling"
  if fmt is None:
    raise ConfigError(f"{path}:{_line_number(path, start)}: no field {cfg.data.field!r} (data.field); the line has "
                      f"keys: {', '.join(list(row)[:8]) or 'none'}; nor messages, or prompt and completion (the "
                      "other data.format values)")
  return fmt


class _ParquetRows:
  """Parquet rows: one document per row, the text in column data.field.

  Rows are read a whole row group at a time, so the order is shuffled locally: each epoch visits
  the row groups in a new order, PARQUET_WINDOW_GROUPS at a time, and shuffles the rows of those
  groups together. A small cache keeps the decoded groups of the current window.
  """

  def __init__(self, blocks: list[tuple[str, int, int, int]], field: str, seed: int, fmt: str = "language_modeling"):
    # blocks: (path, row group, rows) in storage order.
    self.blocks, self.field, self.seed, self.fmt = blocks, field, seed, fmt
    sizes = np.array([b[2] for b in blocks], np.int64)
    self.block_starts = np.concatenate([[0], np.cumsum(sizes)])  # [num_blocks + 1]
    self._init_cache()

  def _init_cache(self):
    self._cache: dict[Any, Any] = {}
    self._lock = threading.Lock()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_lock")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_cache()

  def __len__(self) -> int:
    return int(self.block_starts[-1])

  def _cached(self, key, make, limit: int):
    with self._lock:
      if key in self._cache:
        return self._cache[key]
    value = make()
    with self._lock:
      self._cache[key] = value
      keys = [k for k in self._cache if k[0] == key[0]]
      for k in keys[:-limit]:  # dicts keep insertion order: drop the oldest of this kind
        del self._cache[k]
    return value

  def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The block order of an epoch and where each window starts in it."""
    def make():
      order = np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))
      sizes = np.diff(self.block_starts)[order]
      window_starts = np.concatenate([[0], np.cumsum(sizes)])[::PARQUET_WINDOW_GROUPS]
      return order, window_starts
    return self._cached(("epoch", epoch), make, 2)

  def _window(self, epoch: int, w: int) -> np.ndarray:
    """The shuffled storage indices of window w of an epoch."""
    def make():
      order, _ = self._epoch(epoch)
      blocks = order[w * PARQUET_WINDOW_GROUPS:(w + 1) * PARQUET_WINDOW_GROUPS]
      rows = np.concatenate([np.arange(self.block_starts[b], self.block_starts[b + 1]) for b in blocks])
      return np.random.default_rng([self.seed, epoch, w, 1]).permutation(rows)
    return self._cached(("window", epoch, w), make, 2)

  def storage_index(self, index: int) -> int:
    """The row (in storage order) at position `index` of the repeated, shuffled stream."""
    epoch, k = divmod(index, len(self))
    _, window_starts = self._epoch(epoch)
    w = int(np.searchsorted(window_starts, k, side="right")) - 1
    return int(self._window(epoch, w)[k - window_starts[w]])

  def _group(self, b: int) -> list:
    path, rg, _ = self.blocks[b]
    def make():
      import pyarrow.parquet as pq
      if self.fmt != "language_modeling":  # whole rows, as dicts of the format's columns
        return pq.ParquetFile(path).read_row_group(rg, columns=list(FIELDS[self.fmt])).to_pylist()
      return pq.ParquetFile(path).read_row_group(rg, columns=[self.field]).column(0).to_pylist()
    # Two windows' worth: prefetch threads straddle a window boundary for a few rows.
    return self._cached(("group", b), make, 2 * PARQUET_WINDOW_GROUPS)

  def __getitem__(self, i: int) -> Doc:
    b = int(np.searchsorted(self.block_starts, i, side="right")) - 1
    path, rg, _ = self.blocks[b]
    row = i - int(self.block_starts[b])  # in the row group
    value = self._group(b)[row]
    if self.fmt != "language_modeling":
      where = f"{path} (row group {rg}, row {row})"
      problem = row_problem(value, self.fmt, self.field)
      if problem is not None:
        raise ConfigError(f"{where}: {problem}")
      return Doc(value, where)
    if value is None:
      raise ConfigError(f"{path}: row group {rg}, row {row}: column {self.field!r} (data.field) is null")
    return Doc(value, f"{path} (row group {rg}, row {row})")


class _ParquetRead:
  """Position in the repeated stream -> Doc, through the rows' local shuffle."""

  def __init__(self, rows: _ParquetRows):
    self.rows = rows

  def __call__(self, index: int, _) -> Doc:
    return self.rows[self.rows.storage_index(index)]


def _parquet_rows(cfg: Config, key: str = "data.path") -> _ParquetRows:
  """The rows of the data.path files (named `key` in errors), in storage order, from the footers alone (checked
  here)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  field, fmt = cfg.data.field, cfg.data.format
  blocks = []  # (path, row group, rows)
  for path in data_files(cfg.data.path, "parquet", key):
    try:
      pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
      raise ConfigError(f"{key}: {path} is not a readable Parquet file ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    if fmt == "auto":
      fmt = _parquet_format(schema, field)
    if fmt != "language_modeling":
      missing = [c for c in FIELDS[fmt] if c not in schema.names]
      if missing:
        raise ConfigError(f"{key}: {path} has no column {missing[0]!r} (data.format={fmt}); "
                          f"its columns: {', '.join(schema.names[:8])}")
      if pf.metadata.num_rows == 0:
        raise ConfigError(f"{key}: {path} has no rows; remove it or narrow the glob")
      blocks += [(path, g, pf.metadata.row_group(g).num_rows) for g in range(pf.metadata.num_row_groups)]
      continue
    if field not in schema.names:
      raise ConfigError(f"{key}: {path} has no column {field!r} (data.field); "
                        f"its columns: {', '.join(schema.names[:8])}")
    t = schema.field(field).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_string_view(t) or pa.types.is_binary_view(t)):
      raise ConfigError(f"{key}: {path} column {field!r} (data.field) is {t}, expected string or binary")
    if pf.metadata.num_rows == 0:
      raise ConfigError(f"{key}: {path} has no rows; remove it or narrow the glob")
    blocks += [(path, g, pf.metadata.row_group(g).num_rows) for g in range(pf.metadata.num_row_groups)]
  return _ParquetRows(blocks, field, cfg.data.seed, fmt)


def _parquet_format(schema, field: str) -> str:
  """The format a Parquet file's columns say: data.field (language modeling, as before the formats), messages, or
  prompt and completion (strings, or lists of messages)."""
  import pyarrow as pa
  names = schema.names
  if field in names:
    return "language_modeling"
  if "messages" in names:
    return "conversational"
  if "prompt" in names and "completion" in names:
    t = schema.field("prompt").type
    return "conversational_prompt_completion" if pa.types.is_list(t) or pa.types.is_large_list(t) else "prompt_completion"
  return "language_modeling"  # refused next, naming data.field
