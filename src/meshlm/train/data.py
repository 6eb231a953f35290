"""Training data: documents from files, tokenized, shuffled per epoch, packed into rows, batched per process.

The pipeline is Grain throughout:

  documents (files, JSONL lines, Parquet rows or synthetic ids) -> this process's shard
  -> shuffle(data.seed), new order each epoch -> repeat
  -> read + tokenize (+EOS), lazily in a small thread pool
  -> ConcatThenSplit into rows of seq_len + 1 tokens -> inputs/targets/masks -> batch

Packing choice: documents are concatenated and cut into rows of seq_len + 1 tokens, so inputs and
targets come from the same row shifted by one and no token is padding. A document cut by a row
boundary continues in the next row with its `positions` restarting at 0 (Grain's convention; with
rotary embeddings only relative positions matter). Attention must stay within one segment id.

Sharding: each process builds only its own shard, from file names, sizes and Parquet footers, and
reads only its own documents (see _jsonl_shard and _parquet_shard for the exact granularity).
docs/data.md is the user-facing description of sources, tokenizers and errors.
"""
from __future__ import annotations

import functools
import glob
import json
import logging
import os
import sysconfig
import threading
from typing import Any, Iterator, Sequence

import grain
import numpy as np

from meshlm.config import Config, ConfigError

log = logging.getLogger("meshlm.data")

# Enough synthetic documents (~1M tokens an epoch) that a small model cannot memorize their order.
SYNTHETIC_DOCS = 4096
# Directories of the stdlib that are tests, tools or installed packages rather than library code.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                          "__pycache__"})
# The EOS rule for a tokenizer.json: eos_token of a tokenizer_config.json beside it, else the first
# of these that the vocabulary has.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
# JSONL files are scanned for line starts in chunks of this many bytes (bounded memory).
_SCAN_CHUNK = 1 << 24
# Parquet rows are shuffled within windows of this many row groups (see _ParquetShard).
PARQUET_WINDOW_GROUPS = 4


# ---------------------------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
  """One token per byte (ids 0..255) plus EOS = 256, which closes every document."""
  eos_id = 256
  byte_level = True

  @property
  def vocab_size(self) -> int:
    return 257

  def encode(self, data: bytes | str) -> np.ndarray:
    if isinstance(data, str):
      data = data.encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    # EOS and any id the model may sample past the bytes carry no text.
    return bytes(ids[(ids >= 0) & (ids < 256)].astype(np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face tokenizer.json through the `tokenizers` library.

  vocab_size is the largest id + 1 (added tokens included). eos_id follows EOS_CANDIDATES' rule.
  Documents are encoded without the tokenizer's own special tokens (no BOS); EOS closes each one.
  """
  byte_level = False

  def __init__(self, path: str):
    self.path = path
    self._tok = _load_hf_tokenizer(path)
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1
    self.eos_id = _hf_eos_id(path, vocab)

  # The Rust tokenizer is rebuilt from its file when Grain or a checkpoint pickles us.
  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])

  def encode(self, text: str | bytes) -> np.ndarray:
    if isinstance(text, bytes):
      text = decode_utf8(text, "HFTokenizer.encode")
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.vocab_size) & (ids != self.eos_id)]
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _load_hf_tokenizer(path: str):
  from tokenizers import Tokenizer
  if not os.path.isfile(path):
    raise ConfigError(f"data.tokenizer={path}: no such file; use 'byte' or a path to a tokenizer.json")
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises a bare Exception
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f"data.tokenizer={path}: not a Hugging Face tokenizer.json ({first})") from None


def _hf_eos_id(path: str, vocab: dict[str, int]) -> int:
  side = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  if os.path.isfile(side):
    try:
      with open(side) as f:
        eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError) as e:
      raise ConfigError(f"data.tokenizer={path}: cannot read {side} ({e})") from None
    if isinstance(eos, dict):
      eos = eos.get("content")
    if isinstance(eos, str):
      if eos not in vocab:
        raise ConfigError(f"data.tokenizer={path}: eos_token {eos!r} of {side} is not in the vocabulary")
      return vocab[eos]
  for name in EOS_CANDIDATES:
    if name in vocab:
      return vocab[name]
  raise ConfigError(f"data.tokenizer={path}: no EOS token; add one of {', '.join(EOS_CANDIDATES)} to it, "
                    f"or an eos_token to a tokenizer_config.json beside it")


def make_tokenizer(cfg: Config) -> ByteTokenizer | HFTokenizer:
  """data.tokenizer: 'byte' or a tokenizer.json path, checked against model.vocab_size."""
  name = cfg.data.tokenizer
  tok = ByteTokenizer() if name == "byte" else HFTokenizer(os.path.expanduser(name))
  if cfg.model.vocab_size < tok.vocab_size:
    what = ("the byte tokenizer, which needs 257 ids (256 bytes + EOS)" if name == "byte"
            else f"data.tokenizer={name}, whose ids go up to {tok.vocab_size - 1}")
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is too small for {what}; "
                      f"set model.vocab_size>={tok.vocab_size}")
  return tok


class _Utf8Stats:
  """Counts documents whose invalid UTF-8 was replaced; warns for the first few, then at powers of 10."""

  def __init__(self):
    self.documents = 0
    self._lock = threading.Lock()

  def record(self, where: str, offset: int) -> None:
    with self._lock:
      self.documents += 1
      n = self.documents
    if n <= 10 or str(n).rstrip("0") == "1":  # then at 100, 1000, ...
      log.warning("%s: invalid UTF-8 at byte offset %d, replaced with U+FFFD (%d document%s with invalid "
                  "UTF-8 so far)", where, offset, n, "" if n == 1 else "s")


UTF8_STATS = _Utf8Stats()


def decode_utf8(data: bytes, where: str) -> str:
  """Strict UTF-8, else replacement characters and a counted warning naming where and the byte offset."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    UTF8_STATS.record(where, e.start)
    return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Sources: each is a sequence of (document, where) for this process, where document is bytes or
# str and where names its file for warnings.


def stdlib_files() -> list[str]:
  """Non-empty .py files of the running Python's standard library, sorted (~700 files, ~11 MB)."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for folder, dirs, files in os.walk(root):
    # Pruning in place keeps os.walk out of site-packages, which can be 10x the stdlib.
    dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
    paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
  return sorted(p for p in paths if os.path.getsize(p) > 0)


def data_files(pattern: str | None, source: str = "text") -> list[str]:
  """Files matching the data.path glob (`**` recurses), sorted; each must be non-empty."""
  if not pattern:
    example = {"text": "corpus/**/*.txt", "jsonl": "corpus/*.jsonl", "parquet": "corpus/*.parquet"}[source]
    raise ConfigError(f"data.path is required when data.source={source}: set it to a glob, e.g. "
                      f"data.path='{example}'")
  paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise ConfigError(f"data.path={pattern!r} matches no files; check the glob (use ** to recurse)")
  for p in paths:
    if os.path.getsize(p) == 0:
      raise ConfigError(f"data.path={pattern!r}: file {p} is empty; remove it or narrow the glob")
  return paths


class _TextFiles:
  """A text file is one document, read as bytes."""

  def __init__(self, paths: Sequence[str]):
    self.paths = list(paths)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i: int) -> tuple[bytes, str]:
    with open(self.paths[i], "rb") as f:
      return f.read(), self.paths[i]


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


class _JsonlShard:
  """This process's JSONL lines: one document per non-empty line, the text in data.field."""

  def __init__(self, paths: list[str], file_ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, field: str):
    self.paths, self.file_ids, self.starts, self.ends, self.field = paths, file_ids, starts, ends, field

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, i: int) -> tuple[str, str]:
    path, start, end = self.paths[self.file_ids[i]], int(self.starts[i]), int(self.ends[i])
    with open(path, "rb") as f:
      f.seek(start)
      raw = f.read(end - start)
    where = lambda: f"{path}:{_line_number(path, start)}"
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      # JSON is Unicode text, so this holds for every tokenizer; the offset is in the file.
      UTF8_STATS.record(path, start + e.start)
      text = raw.decode("utf-8", errors="replace")
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{where()}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
      raise ConfigError(f"{where()}: expected a JSON object with a {self.field!r} field, got {type(obj).__name__}")
    if self.field not in obj:
      keys = ", ".join(list(obj)[:8]) or "none"
      raise ConfigError(f"{where()}: no field {self.field!r} (data.field); the line has keys: {keys}")
    value = obj[self.field]
    if not isinstance(value, str):
      raise ConfigError(f"{where()}: field {self.field!r} is {type(value).__name__}, expected a string")
    return value, path


def _process_range(total: int, process_index: int, process_count: int) -> tuple[int, int]:
  return total * process_index // process_count, total * (process_index + 1) // process_count


def _jsonl_shard(cfg: Config, process_index: int, process_count: int) -> _JsonlShard:
  """Splits the files' concatenated bytes into process_count equal ranges; a line belongs to the range
  where it starts. Granularity: one line (document); a process reads its range plus the rest of its
  last line and one byte before its range."""
  paths = data_files(cfg.data.path, "jsonl")
  sizes = [os.path.getsize(p) for p in paths]
  lo, hi = _process_range(sum(sizes), process_index, process_count)
  file_ids, starts, ends, first_lines = [], [], [], []
  offset = 0
  for fid, (path, size) in enumerate(zip(paths, sizes)):
    a, b = min(max(lo - offset, 0), size), min(max(hi - offset, 0), size)
    offset += size
    if a >= b:
      continue
    s, e = _scan_lines(path, size, a, b)
    if len(s):
      first_lines.append(sum(len(x) for x in starts))
    file_ids.append(np.full(len(s), fid, np.int32))
    starts.append(s)
    ends.append(e)
  cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
  shard = _JsonlShard(paths, cat(file_ids, np.int32), cat(starts, np.int64), cat(ends, np.int64), cfg.data.field)
  # Parse each file's first line of this shard now: a wrong format or data.field fails before training.
  for i in first_lines:
    shard[i]
  return shard


class _ParquetShard:
  """This process's Parquet rows: one document per row, the text in column data.field.

  Rows are read a whole row group at a time, so the order is shuffled locally: each epoch visits
  the row groups in a new order, PARQUET_WINDOW_GROUPS at a time, and shuffles the rows of those
  groups together. A small cache keeps the decoded groups of the current window.
  """

  def __init__(self, blocks: list[tuple[str, int, int, int]], field: str, seed: int):
    # blocks: (path, row group, first row in the group, rows) in storage order.
    self.blocks, self.field, self.seed = blocks, field, seed
    sizes = np.array([b[3] for b in blocks], np.int64)
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
    path, rg, first, n = self.blocks[b]
    def make():
      import pyarrow.parquet as pq
      column = pq.ParquetFile(path).read_row_group(rg, columns=[self.field]).column(0)
      return column.slice(first, n).to_pylist()
    # Two windows' worth: prefetch threads straddle a window boundary for a few rows.
    return self._cached(("group", b), make, 2 * PARQUET_WINDOW_GROUPS)

  def __getitem__(self, i: int) -> tuple[str | bytes, str]:
    b = int(np.searchsorted(self.block_starts, i, side="right")) - 1
    path, rg, first, _ = self.blocks[b]
    row = first + i - int(self.block_starts[b])  # in the row group
    value = self._group(b)[i - self.block_starts[b]]
    if value is None:
      raise ConfigError(f"{path}: row group {rg}, row {row}: column {self.field!r} (data.field) is null")
    return value, f"{path} (row group {rg}, row {row})"


class _ParquetRead:
  """Position in the repeated stream -> (document, where), through the shard's local shuffle."""

  def __init__(self, shard: _ParquetShard):
    self.shard = shard

  def __call__(self, index: int, _) -> tuple[str | bytes, str]:
    return self.shard[self.shard.storage_index(index)]


def _parquet_shard(cfg: Config, process_index: int, process_count: int) -> _ParquetShard:
  """Splits the files' concatenated rows into process_count equal ranges, from the footers alone.
  Granularity: one row; a process decodes only the row groups that hold its rows, which it shares with
  a neighbour only at the two ends of its range."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  field = cfg.data.field
  groups = []  # (path, row group, rows)
  for path in data_files(cfg.data.path, "parquet"):
    try:
      pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
      raise ConfigError(f"data.path: {path} is not a readable Parquet file ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
      raise ConfigError(f"data.path: {path} has no column {field!r} (data.field); "
                        f"its columns: {', '.join(schema.names[:8])}")
    t = schema.field(field).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_string_view(t) or pa.types.is_binary_view(t)):
      raise ConfigError(f"data.path: {path} column {field!r} (data.field) is {t}, expected string or binary")
    if pf.metadata.num_rows == 0:
      raise ConfigError(f"data.path: {path} has no rows; remove it or narrow the glob")
    groups += [(path, g, pf.metadata.row_group(g).num_rows) for g in range(pf.metadata.num_row_groups)]
  lo, hi = _process_range(sum(n for *_, n in groups), process_index, process_count)
  blocks, offset = [], 0
  for path, g, n in groups:
    a, b = max(lo - offset, 0), min(hi - offset, n)
    offset += n
    if a < b:
      blocks.append((path, g, a, b - a))
  return _ParquetShard(blocks, field, cfg.data.seed)


# ---------------------------------------------------------------------------------------------
# Examples


def synthetic_doc(seed: int, index: int) -> np.ndarray:
  """An arithmetic sequence mod 256 of random start, step and length, then EOS.

  Every token after the second follows from the two before it, so a model's loss can fall far.
  """
  rng = np.random.default_rng([seed, index])
  n = int(rng.integers(16, 512))
  start, step = rng.integers(0, 256), rng.integers(1, 256)
  doc = np.empty(n + 1, np.int32)  # [n + 1]
  doc[:n] = (start + step * np.arange(n)) % 256
  doc[n] = ByteTokenizer.eos_id
  return doc


def _synthetic_example(seed: int, index: int) -> dict[str, np.ndarray]:
  return {"tokens": synthetic_doc(seed, index)}


class _Encode:
  """(document, where) -> {"tokens": ids + [EOS]}. Bytes go to an HF tokenizer as UTF-8 text."""

  def __init__(self, tok: ByteTokenizer | HFTokenizer):
    self.tok = tok

  def __call__(self, doc: tuple[bytes | str, str]) -> dict[str, np.ndarray]:
    data, where = doc
    if isinstance(data, bytes) and not self.tok.byte_level:
      data = decode_utf8(data, where)
    ids = self.tok.encode(data)
    tokens = np.empty(len(ids) + 1, np.int32)  # [n + 1]
    tokens[:-1] = ids
    tokens[-1] = self.tok.eos_id
    return {"tokens": tokens}


def _to_example(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A packed row of T + 1 tokens -> the model's T inputs, targets and masks."""
  tok, seg, pos = row["tokens"], row["tokens_segment_ids"], row["tokens_positions"]  # each [T + 1]
  # A target counts only inside its input's document; padding (segment 0) never counts.
  same_doc = (seg[:-1] == seg[1:]) & (seg[1:] != 0)  # [T]
  return {"inputs": tok[:-1], "targets": tok[1:], "segment_ids": seg[:-1], "positions": pos[:-1],
          "loss_mask": same_doc.astype(np.float32)}


class DataIterator:
  """Infinite iterator of local batches, each value [global_batch // process_count, seq_len].

  A thin wrapper over a Grain DatasetIterator: get_state() is a small dict (indices and offsets,
  no data) that set_state() on a fresh iterator from the same config resumes exactly.
  """

  def __init__(self, it: grain.DatasetIterator, tokenizer: ByteTokenizer | HFTokenizer, num_documents: int):
    self._it = it
    self.tokenizer = tokenizer
    self.num_documents = num_documents  # in this process's shard

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def get_state(self) -> dict[str, Any]:
    return self._it.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    # Grain's packer keeps slices as tuples and tests `slice != (-1, -1)`; a JSON round trip turns
    # them into lists, which would read as a remainder that is not there.
    self._it.set_state(_lists_to_tuples(state))


def _lists_to_tuples(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _lists_to_tuples(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return tuple(_lists_to_tuples(v) for v in x)
  return x


def _shard_documents(cfg: Config, process_index: int, process_count: int) -> tuple[int, grain.MapDataset]:
  """The size of this process's shard, and its documents shuffled per epoch and repeated:
  (document, where) pairs, or synthetic ids."""
  source, seed = cfg.data.source, cfg.data.seed
  if source == "parquet":
    shard = _parquet_shard(cfg, process_index, process_count)
    n = len(shard)
    if n:
      # Locality-preserving shuffle (see _ParquetShard); Grain's global shuffle would decode a row
      # group per row.
      return n, grain.MapDataset.range(n).repeat(None).map_with_index(_ParquetRead(shard))
  else:
    if source == "synthetic":
      docs = grain.MapDataset.range(SYNTHETIC_DOCS)[process_index::process_count]
    elif source == "jsonl":
      docs = grain.MapDataset.source(_jsonl_shard(cfg, process_index, process_count))
    else:
      # A file is a document: files are dealt round robin, so no process opens another's files.
      paths = stdlib_files() if source == "stdlib" else data_files(cfg.data.path, "text")
      docs = grain.MapDataset.source(_TextFiles(paths))[process_index::process_count]
    n = len(docs)
    if n:
      # shuffle then repeat: Grain folds the epoch into the seed, so each epoch has a new order.
      return n, docs.shuffle(seed=seed).repeat(None)
  if process_count == 1:
    raise ConfigError(f"data.path={cfg.data.path!r} (data.source={source}) has no documents")
  raise ConfigError(f"data.path={cfg.data.path!r} (data.source={source}) has too few documents for "
                    f"{process_count} processes: process {process_index} got none; add data")


def make_dataset(cfg: Config, *, global_batch: int, seq_len: int, process_index: int = 0,
                 process_count: int = 1) -> DataIterator:
  """The training stream of this process: dicts of inputs, targets, segment_ids, positions (int32)
  and loss_mask (float32), each [global_batch // process_count, seq_len].

  Validates eagerly (raising ConfigError): the tokenizer against model.vocab_size, that the glob
  matches non-empty files, Parquet footers (column, type, rows) and the first JSONL line of each file
  in this shard. Later JSONL lines are parsed as they are read: a bad one raises ConfigError, naming
  file:line, from the next() that reaches it.
  """
  if global_batch % process_count:
    raise ConfigError(f"the global batch ({global_batch}, from train.per_device_batch_size) must split "
                      f"evenly over {process_count} processes")
  if not 0 <= cfg.data.seed < 2**32:
    raise ConfigError(f"data.seed={cfg.data.seed} must be in [0, 2**32) (it seeds Grain's shuffle)")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is outside [0, {process_count})")
  if cfg.data.source == "synthetic" and cfg.data.tokenizer != "byte":
    raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: data.source=synthetic makes byte ids; "
                      f"use data.tokenizer=byte or a file source")
  tok = make_tokenizer(cfg)
  num_docs, ds = _shard_documents(cfg, process_index, process_count)
  # Partials and callables, not lambdas, so the tail of the pipeline stays picklable.
  ds = ds.map(functools.partial(_synthetic_example, cfg.data.seed) if cfg.data.source == "synthetic"
              else _Encode(tok))
  # Documents are read on demand a few ahead; Grain's defaults (16 threads, 500 reads) would hog the CPU.
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
  it_ds = grain.experimental.ConcatThenSplitIterDataset(it_ds, length_struct={"tokens": seq_len + 1})
  it_ds = it_ds.map(_to_example).batch(global_batch // process_count, drop_remainder=True)
  return DataIterator(iter(it_ds), tok, num_docs)
