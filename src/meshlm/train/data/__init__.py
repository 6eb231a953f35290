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
Modules: tokenizers.py (byte and tokenizer.json tokenizers, UTF-8 handling), sources.py (the
document sources and their per-process shards), and this file (examples, packing, batching).
docs/data.md is the user-facing description of sources, tokenizers and errors.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

import grain
import numpy as np

from meshlm.config import Config, ConfigError
from meshlm.train.data.sources import (_jsonl_shard, _parquet_shard, _ParquetRead, _TextFiles, data_files,
                                       stdlib_files)
from meshlm.train.data.tokenizers import (ByteTokenizer, HFTokenizer, UTF8_STATS, decode_utf8,  # noqa: F401
                                          make_tokenizer)

# Enough synthetic documents (~1M tokens an epoch) that a small model cannot memorize their order.
SYNTHETIC_DOCS = 4096


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
