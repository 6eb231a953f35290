"""Training data: byte-tokenized documents, shuffled per epoch, packed into rows, batched per process.

The pipeline is Grain throughout:

  documents (file paths or synthetic ids) -> process shard -> shuffle(data.seed) -> repeat
  -> read + encode (+EOS), lazily in a small thread pool
  -> ConcatThenSplit into rows of seq_len + 1 tokens -> inputs/targets/masks -> batch

Packing choice: documents are concatenated and cut into rows of seq_len + 1 tokens, so inputs and
targets come from the same row shifted by one and no token is padding. A document cut by a row
boundary continues in the next row with its `positions` restarting at 0 (Grain's convention; with
rotary embeddings only relative positions matter). Attention must stay within one segment id.
"""
from __future__ import annotations

import functools
import glob
import os
import sysconfig
from typing import Any, Iterator

import grain
import numpy as np

from meshlm.config import Config, ConfigError

# Enough synthetic documents (~1M tokens an epoch) that a small model cannot memorize their order.
SYNTHETIC_DOCS = 4096
# Directories of the stdlib that are tests, tools or installed packages rather than library code.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                          "__pycache__"})


class ByteTokenizer:
  """One token per byte (ids 0..255) plus EOS = 256, which closes every document."""
  eos_id = 256

  @property
  def vocab_size(self) -> int:
    return 257

  def encode(self, data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    # EOS and any id the model may sample past the bytes carry no text.
    return bytes(ids[(ids >= 0) & (ids < 256)].astype(np.uint8)).decode("utf-8", errors="replace")


def stdlib_files() -> list[str]:
  """Non-empty .py files of the running Python's standard library, sorted (~700 files, ~11 MB)."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for folder, dirs, files in os.walk(root):
    # Pruning in place keeps os.walk out of site-packages, which can be 10x the stdlib.
    dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
    paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
  return sorted(p for p in paths if os.path.getsize(p) > 0)


def text_files(pattern: str | None) -> list[str]:
  """Files matching the data.path glob (`**` recurses), sorted; each must be non-empty."""
  if not pattern:
    raise ConfigError("data.path is required when data.source=text: set it to a glob, e.g. "
                      "data.path='corpus/**/*.txt'")
  paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise ConfigError(f"data.path={pattern!r} matches no files; check the glob (use ** to recurse)")
  for p in paths:
    if os.path.getsize(p) == 0:
      raise ConfigError(f"data.path={pattern!r}: file {p} is empty; remove it or narrow the glob")
  return paths


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


def _read_doc(path: str) -> dict[str, np.ndarray]:
  with open(path, "rb") as f:
    data = f.read()
  tokens = np.empty(len(data) + 1, np.int32)  # [n + 1]
  tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
  tokens[-1] = ByteTokenizer.eos_id
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

  def __init__(self, it: grain.DatasetIterator):
    self._it = it

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


def _documents(cfg: Config) -> grain.MapDataset:
  """Per-document sources before reading: file paths, or synthetic document ids."""
  if cfg.data.source == "synthetic":
    return grain.MapDataset.range(SYNTHETIC_DOCS)
  if cfg.data.source == "stdlib":
    return grain.MapDataset.source(stdlib_files())
  return grain.MapDataset.source(text_files(cfg.data.path))


def make_dataset(cfg: Config, *, global_batch: int, seq_len: int, process_index: int = 0,
                 process_count: int = 1) -> DataIterator:
  """The training stream of this process: dicts of inputs, targets, segment_ids, positions (int32)
  and loss_mask (float32), each [global_batch // process_count, seq_len]."""
  tok = ByteTokenizer()
  if cfg.model.vocab_size < tok.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is too small for the byte tokenizer, "
                      f"which needs {tok.vocab_size} ids (256 bytes + EOS); set model.vocab_size>={tok.vocab_size}")
  if global_batch % process_count:
    raise ConfigError(f"the global batch ({global_batch}, from train.per_device_batch_size) must split "
                      f"evenly over {process_count} processes")
  if not 0 <= cfg.data.seed < 2**32:
    raise ConfigError(f"data.seed={cfg.data.seed} must be in [0, 2**32) (it seeds Grain's shuffle)")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is outside [0, {process_count})")

  docs = _documents(cfg)
  # Shard before shuffling so each process owns a fixed, disjoint set of documents.
  shard = docs[process_index::process_count]
  if len(shard) == 0:
    raise ConfigError(f"data.source={cfg.data.source} has {len(docs)} documents, fewer than the "
                      f"{process_count} processes; add files to data.path")
  # shuffle then repeat: Grain folds the epoch into the seed, so each epoch has a new order.
  ds = shard.shuffle(seed=cfg.data.seed).repeat(None)
  # A partial, not a lambda, so the pipeline stays picklable for Grain's multiprocess prefetch.
  ds = ds.map(functools.partial(_synthetic_example, cfg.data.seed) if cfg.data.source == "synthetic"
              else _read_doc)
  # Files are read on demand a few ahead; Grain's defaults (16 threads, 500 files) would hog the CPU.
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
  it_ds = grain.experimental.ConcatThenSplitIterDataset(it_ds, length_struct={"tokens": seq_len + 1})
  it_ds = it_ds.map(_to_example).batch(global_batch // process_count, drop_remainder=True)
  return DataIterator(iter(it_ds))
