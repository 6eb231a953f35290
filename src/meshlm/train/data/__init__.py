"""Training data: documents from files, tokenized, shuffled per epoch, packed into rows, batched.

The pipeline is Grain throughout:

  documents (files, JSONL lines, Parquet rows or synthetic ids), all of them
  -> shuffle(data.seed), new order each epoch -> repeat
  -> read + tokenize (the post-processor's BOS, the text, EOS), lazily in a small thread pool
  -> count invalid UTF-8, in order (in the consumer thread, so the count does not depend on prefetch)
  -> ConcatThenSplit into rows of seq_len + 1 tokens -> global batch -> this process's rows
  -> inputs/targets/masks

Packing choice: documents are concatenated and cut into rows of seq_len + 1 tokens, so inputs and
targets come from the same row shifted by one and no token is padding. A document cut by a row
boundary continues in the next row with its `positions` restarting at 0 (Grain's convention; with
rotary embeddings only relative positions matter). Attention must stay within one segment id.

Processes: the sequence of global batches is a function of the data config, the global batch size and
seq_len only, never of the process count. Every process runs the same global stream and keeps the rows
of each global batch that its devices hold (process_rows), so 1 x 4 devices and 2 x 2 devices train on
the same batches, and the iterator state (identical on every process) resumes on any process count.
The price: every process reads and tokenizes every document (packing needs every document's token
count to know where a row starts); docs/multihost.md says when that matters.
Modules: tokenizers.py (byte and tokenizer.json tokenizers, UTF-8 handling), sources.py (the
document sources), and this file (examples, packing, batching, rows).
docs/data.md is the user-facing description of sources, tokenizers and errors.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Iterator

import grain
import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.train.data.sources import Doc, _jsonl_lines, _parquet_rows, _ParquetRead, _TextFiles, data_files, stdlib_files
from meshlm.train.data.chat import ChatTemplate, TemplateError, load_chat_template
from meshlm.train.data.formats import CONVERSATIONAL, encode_row, no_template_error, spans_mask
from meshlm.train.data.tokenizers import (ByteTokenizer, HFTokenizer, TRUNCATION_STATS, UTF8_STATS,  # noqa: F401
                                          decode_utf8, make_tokenizer, replace_invalid_utf8, tokenizer_path)

class EmptyBatchWarning(UserWarning):
  """A global batch of an SFT format has no trained token: its step trains on nothing."""


class EndOfTurnWarning(UserWarning):
  """data.assistant_only=true and the chat template leaves the tokenizer's EOS out of the assistant's tokens."""


# Enough synthetic documents (~1M tokens an epoch) that a small model cannot memorize their order.
SYNTHETIC_DOCS = 4096


def synthetic_doc(seed: int, index: int, vocab_size: int = 257) -> np.ndarray:
  """An arithmetic sequence mod M of random start, step and length, then EOS (id M), where
  M = min(256, vocab_size - 1): byte ids and the byte EOS for any vocabulary of 257 or more, and ids that
  fit a smaller one (an HF model with no tokenizer can still train on synthetic data).

  Every token after the second follows from the two before it, so a model's loss can fall far.
  """
  m = min(256, vocab_size - 1)
  rng = np.random.default_rng([seed, index])
  n = int(rng.integers(16, 512))
  start, step = rng.integers(0, 256), rng.integers(1, 256)
  doc = np.empty(n + 1, np.int32)  # [n + 1]
  doc[:n] = (start + step * np.arange(n)) % m
  doc[n] = ByteTokenizer.eos_id if m == 256 else m
  return doc


def _synthetic_example(seed: int, vocab_size: int, index: int) -> dict[str, np.ndarray]:
  return {"tokens": synthetic_doc(seed, index, vocab_size)}


class _Encode:
  """Doc -> ({"tokens": ids + [EOS]}, invalid UTF-8 as (where, byte offset) or None).

  Bytes go to an HF tokenizer as UTF-8 text. It runs in Grain's prefetch threads, ahead of need, so it
  only reports invalid UTF-8; _CountInvalidUtf8 counts it when the packer takes the document.
  """

  def __init__(self, tok: ByteTokenizer | HFTokenizer):
    self.tok = tok

  def __call__(self, doc: Doc) -> tuple[dict[str, np.ndarray], tuple[str, int] | None]:
    data, where, bad = doc.data, doc.where, doc.invalid_utf8_at
    if isinstance(data, bytes) and not self.tok.byte_level:
      data, bad = replace_invalid_utf8(data)
    ids = self.tok.encode(data)
    bos = self.tok.bos_ids  # what the tokenizer's post-processor puts first (Llama 3's BOS), or nothing
    tokens = np.empty(len(bos) + len(ids) + 1, np.int32)  # [b + n + 1]
    tokens[:len(bos)] = bos
    tokens[len(bos):-1] = ids
    tokens[-1] = self.tok.eos_id
    return {"tokens": tokens}, (None if bad is None else (where, bad))


class _EncodeRow:
  """(position in the repeated stream, Doc of an SFT row) -> ({"tokens", "mask"} of at most `length` tokens, or None
  when dropped; what happened: "cut", "dropped" or None; where the row is; invalid UTF-8 as _Encode reports it; the
  position). formats.py holds the rules."""

  def __init__(self, tok, fmt: str, template: ChatTemplate | None, data_cfg, length: int):
    self.tok, self.fmt, self.template, self.length = tok, fmt, template, length
    self.completion_only, self.assistant_only = data_cfg.completion_only, data_cfg.assistant_only
    self.truncation = data_cfg.truncation

  def __call__(self, index: int, doc: Doc):
    try:
      ids, mask = encode_row(doc.data, self.fmt, self.tok, self.template, self.completion_only,
                             self.assistant_only and self.fmt in CONVERSATIONAL)
    except TemplateError as e:
      raise ConfigError(f"{doc.where}: {e}") from None
    if self.assistant_only and self.fmt in CONVERSATIONAL and not mask.any():
      raise ConfigError(f"{doc.where}: data.assistant_only=true and the conversation has no assistant tokens")
    bad = None if doc.invalid_utf8_at is None else (str(doc.where), doc.invalid_utf8_at)
    what = None
    if len(ids) > self.length:
      what = "cut" if self.truncation == "cut" else "dropped"
      ids, mask = ids[:self.length], mask[:self.length]
    example = None if what == "dropped" else {"tokens": ids.astype(np.int32), "mask": mask.astype(np.int32)}
    return example, what, doc.where, bad, index


class _CountRows:
  """In the consumer's thread, in stream order (see _count_invalid_utf8): counts cut and dropped rows (the same on
  every run), and refuses a file of which a whole pass, each row once, left nothing to train: every row dropped
  (data.truncation=drop), or every kept row's trained tokens cut away. Without it the packer would wait forever for
  a row, or the run would train at loss 0. Only a pass watched from its first row counts (a resumed stream starts
  mid-pass)."""

  def __init__(self, num_rows: int, key: str, path: str, length: int):
    self.num_rows, self.key, self.path, self.length = num_rows, key, path, length
    self.pass_index, self.kept, self.trained = -1, 0, 0

  def __call__(self, encoded) -> dict[str, np.ndarray] | None:
    example, what, where, bad, index = encoded
    if what is not None:
      TRUNCATION_STATS.record(what, where)
    pass_index, position = divmod(index, self.num_rows)
    if position == 0:
      self.pass_index, self.kept, self.trained = pass_index, 0, 0
    if example is not None:
      self.kept += 1
      self.trained += int(example["mask"][1:].any())  # the first token is never a target
    if position == self.num_rows - 1 and pass_index == self.pass_index:
      self._check()
    return _count_invalid_utf8((example, bad))

  def _check(self) -> None:
    n, where, room = self.num_rows, f"{self.key}={self.path}", f"train.seq_len + 1 = {self.length} tokens"
    if not self.kept:
      raise ConfigError(f"{where}: data.truncation=drop dropped every one of its {n} rows, each longer than {room}; "
                        "raise train.seq_len, or data.truncation=cut keeps their start")
    if not self.trained:
      raise ConfigError(f"{where}: none of its {n} rows has a trained token within its first {room} (data.truncation="
                        "cut cuts the completion or the assistant's turns away); raise train.seq_len or shorten the "
                        "prompts")


def _kept(example) -> bool:
  return example is not None


class _CountDocuments:
  """Counts the documents the packer takes (a map in the consumer's thread, in stream order): after a whole pass of
  the validation set, every document once."""

  def __init__(self):
    self.n = 0

  def __call__(self, example):
    self.n += 1
    return example


def _count_invalid_utf8(encoded: tuple[dict[str, np.ndarray], tuple[str, int] | None]) -> dict[str, np.ndarray]:
  # An IterDataset map runs in the consumer's thread, once per document in stream order: the count
  # is a function of the documents packed so far, whatever the prefetch threads read ahead.
  example, bad = encoded
  if bad is not None:
    UTF8_STATS.record(*bad)
  return example


def _to_example(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed rows of T + 1 tokens -> the model's T inputs, targets and masks (any leading dims)."""
  tok, seg, pos = rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"]  # each [..., T + 1]
  # A target counts only inside its input's document; padding (segment 0) never counts.
  same_doc = (seg[..., :-1] == seg[..., 1:]) & (seg[..., 1:] != 0)  # [..., T]
  if "mask" in rows:  # the SFT formats: a target trains only where its row's mask says so
    same_doc &= rows["mask"][..., 1:] != 0
  out = {"inputs": tok[..., :-1], "targets": tok[..., 1:], "segment_ids": seg[..., :-1], "positions": pos[..., :-1],
         "loss_mask": same_doc.astype(np.float32)}
  return {k: np.ascontiguousarray(v) for k, v in out.items()}  # views of [..., T + 1] -> own [..., T]


def process_rows(sharding, shape: tuple[int, ...]) -> np.ndarray:
  """The rows of a global [B, ...] array that this process's devices hold under `sharding`, in the
  order jax.make_array_from_process_local_data expects its local data: each distinct block of rows
  once, by first row. Rows replicated over devices of several processes belong to each of them."""
  blocks = {}
  for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
    start, stop, _ = index[0].indices(shape[0])
    blocks[start] = stop
  return np.concatenate([np.arange(a, b) for a, b in sorted(blocks.items())])


def batch_rows(mesh, global_batch: int, seq_len: int) -> np.ndarray:
  """This process's rows of each global batch on `mesh`, under the train step's batch sharding."""
  from jax.sharding import NamedSharding
  from meshlm.parallel.sharding import logical_spec
  from meshlm.train.step import BATCH_AXES
  shape = (global_batch, seq_len)
  # The sharding of TrainStep.batch_sharding, which put_batch places these rows with.
  return process_rows(NamedSharding(mesh, logical_spec(BATCH_AXES, shape, mesh)), shape)


class DataIterator:
  """Iterator of this process's rows of each global batch, each value [len(rows), seq_len]: infinite, or one pass
  (make_dataset's once=True), whose last batch is padded to the global batch with empty rows (segment 0, no target).

  A thin wrapper over a Grain DatasetIterator of global batches: get_state() is a small dict (indices
  and offsets, no data), the same on every process, that set_state() on a fresh iterator from the same
  data config and global batch resumes exactly, whatever this iterator's rows.
  """

  def __init__(self, it: grain.DatasetIterator, tokenizer: ByteTokenizer | HFTokenizer, num_documents: int,
               rows: np.ndarray | slice, masked: bool = False, where: str = "data.path",
               global_batch: int | None = None, counter: _CountDocuments | None = None, fmt: str = "language_modeling",
               example=None):
    self.masked = masked  # an SFT format's mask decides which targets train (formats.py)
    self.format = fmt  # the rows' data format (formats.py)
    self._example = example
    self.global_batch, self._counter = global_batch, counter
    self._it = it
    self.tokenizer = tokenizer
    self.num_documents = num_documents  # in the corpus
    self.rows = rows
    self.where = where  # the files, as errors and warnings name them: data.path=GLOB
    self.trained_tokens = None  # the last global batch's trained targets (the masked formats), the same on each process

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._it)  # [global_batch, seq_len + 1] each; one pass's last batch may hold fewer rows
    short = self.global_batch - len(batch["tokens"]) if self.global_batch else 0
    if short > 0:  # rows of padding: segment 0, so no target counts
      batch = {k: np.concatenate([v, np.zeros((short, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    if self.masked:
      self.trained_tokens = int(_to_example(batch)["loss_mask"].sum())
      if not self.trained_tokens:
        warnings.warn(f"{self.where}: a batch of {len(batch['tokens'])} rows has no trained token (data.truncation=cut "
                      f"cut their completions or assistant turns away at train.seq_len + 1 = "
                      f"{batch['tokens'].shape[-1]} tokens): nothing in it counts in the loss (a training step on it trains on "
                      "nothing)", EmptyBatchWarning)
    return _to_example({k: v[self.rows] for k, v in batch.items()})

  def example(self):
    """One document of the stream (its first), for the end-of-run sample's prompt: a Doc, or None (synthetic)."""
    return None if self._example is None else self._example()

  @property
  def documents_read(self) -> int:
    """How many documents (rows of a file) the packer has taken so far: after a whole pass, all of them."""
    return self._counter.n

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


def _documents(cfg: Config, shuffle: bool = True, key: str = "data.path",
               once: bool = False) -> tuple[int, grain.MapDataset, str]:
  """The corpus size, its documents shuffled per epoch (shuffle) and repeated (or read once: once, in storage order):
  Docs, or synthetic ids, and the data format (formats.py) of its rows. Errors name the files' glob as `key`."""
  repeat = 1 if once else None
  source, seed = cfg.data.source, cfg.data.seed
  fmt = "language_modeling"
  if source == "parquet":
    rows = _parquet_rows(cfg, key)
    n = len(rows)
    if not shuffle:
      return n, grain.MapDataset.source(rows).repeat(repeat), rows.fmt
    # Locality-preserving shuffle (see _ParquetRows); Grain's global shuffle would decode a row
    # group per row.
    return n, grain.MapDataset.range(n).repeat(None).map_with_index(_ParquetRead(rows)), rows.fmt
  if source == "synthetic":
    docs = grain.MapDataset.range(SYNTHETIC_DOCS)
  elif source == "jsonl":
    lines = _jsonl_lines(cfg, key)
    docs, fmt = grain.MapDataset.source(lines), lines.fmt
  else:
    if cfg.data.format not in ("auto", fmt):
      raise ConfigError(f"data.format={cfg.data.format}: data.source={source} holds plain text (a file is a "
                        "document); rows in that format come from data.source=jsonl|parquet")
    # A file is a document.
    paths = stdlib_files() if source == "stdlib" else data_files(cfg.data.path, "text", key)
    docs = grain.MapDataset.source(_TextFiles(paths))
  n = len(docs)
  if not n:
    raise ConfigError(f"{key}={cfg.data.path!r} (data.source={source}) has no documents")
  if not shuffle:
    return n, docs.repeat(repeat), fmt
  # shuffle then repeat: Grain folds the epoch into the seed, so each epoch has a new order.
  return n, docs.shuffle(seed=seed).repeat(None), fmt


def chat_template(cfg: Config, fmt: str) -> ChatTemplate | None:
  """The chat template a format needs (None for the plain-text ones); a conversational format without one is refused,
  naming the key that gives one."""
  if fmt not in CONVERSATIONAL:
    return None
  name = cfg.data.tokenizer
  template = load_chat_template(cfg.data.chat_template, None if name == "byte" else tokenizer_path(name))
  if template is None:
    raise no_template_error(fmt, name)
  return template


# The conversation warn_untrained_eos renders: one user turn, one assistant turn.
_PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


def warn_untrained_eos(template: ChatTemplate, tok) -> bool:
  """Warns (EndOfTurnWarning) and returns True when data.assistant_only=true would never train the tokenizer's EOS:
  the template renders it (closing a turn, as ChatML's <|im_end|>) but outside every assistant span, e.g. after
  {% endgeneration %}. The model would then never learn to stop. A template that renders no EOS at all (its turns end
  with another token) or refuses the probe conversation is left to the rows."""
  try:
    text, spans = template.assistant_spans([dict(m) for m in _PROBE])
  except TemplateError:
    return False
  ids, starts, ends = tok.encode_offsets(text)
  eos = ids == tok.eos_id
  if not eos.any() or spans_mask(starts, ends, spans)[eos].any():
    return False
  name = getattr(tok, "eos_token", str(tok.eos_id))
  after = " (after {% endgeneration %})" if template.has_generation else ""
  warnings.warn(f"data.assistant_only=true: the chat template ({template.where}) renders the tokenizer's EOS {name} "
                f"outside the assistant's tokens{after}, so the model never learns to end its turn; "
                "put the EOS inside {% generation %} ... {% endgeneration %} (as TRL's *_training.jinja templates do) "
                "with data.chat_template=FILE", EndOfTurnWarning)
  return True


def make_dataset(cfg: Config, *, global_batch: int, seq_len: int, rows: np.ndarray | None = None,
                 shuffle: bool = True, key: str = "data.path", once: bool = False) -> DataIterator:
  """This process's training stream: dicts of inputs, targets, segment_ids, positions (int32) and
  loss_mask (float32), each [len(rows), seq_len]: rows `rows` (default all) of each global batch.

  The global batches depend only on the data config, global_batch and seq_len. The training loop
  passes batch_rows(mesh, ...), the rows this process's devices hold. shuffle=False reads the documents in
  storage order, repeated; once=True (with shuffle=False: the validation set) reads them once, the last batch padded
  to global_batch rows with empty ones, then stops. The SFT formats (formats.py) pack each row whole, first fit, and
  AND their per-token mask into loss_mask.

  Validates eagerly (raising ConfigError): the tokenizer against model.vocab_size, that the glob
  matches non-empty files, Parquet footers (column, type, rows) and the first JSONL line of each file.
  Later JSONL lines are parsed as they are read: a bad one raises ConfigError, naming file:line, from
  the next() that reaches it, as does a whole pass of an SFT file that left nothing to train (_CountRows). `key`:
  the name errors give data.path (eval.path for the validation set).
  """
  if not 0 <= cfg.data.seed < 2**32:
    raise ConfigError(f"data.seed={cfg.data.seed} must be in [0, 2**32) (it seeds Grain's shuffle)")
  if rows is not None and (len(rows) == 0 or min(rows) < 0 or max(rows) >= global_batch):
    raise ValueError(f"rows {rows} must be a non-empty subset of the global batch's {global_batch} rows")
  if cfg.data.source == "synthetic" and cfg.data.tokenizer != "byte":
    raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: data.source=synthetic makes byte ids; "
                      f"use data.tokenizer=byte or a file source")
  # Synthetic ids fit the model's vocabulary themselves; the byte tokenizer only decodes samples.
  tok = ByteTokenizer() if cfg.data.source == "synthetic" else make_tokenizer(cfg)
  if once and shuffle:
    raise ValueError("once=True reads the documents in storage order: pass shuffle=False")
  num_docs, ds, fmt = _documents(cfg, shuffle, key, once)
  counter = _CountDocuments()
  # Documents are read on demand a few ahead; Grain's defaults (16 threads, 500 reads) would hog the CPU.
  read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)
  # Partials and callables, not lambdas, so the tail of the pipeline stays picklable.
  if cfg.data.source == "synthetic":
    it_ds = ds.map(functools.partial(_synthetic_example, cfg.data.seed, cfg.model.vocab_size)).to_iter_dataset(read)
  elif fmt == "language_modeling":
    it_ds = ds.map(_Encode(tok)).to_iter_dataset(read).map(_count_invalid_utf8).map(counter)
  if fmt == "language_modeling":
    it_ds = grain.experimental.ConcatThenSplitIterDataset(it_ds, length_struct={"tokens": seq_len + 1})
  else:
    template = chat_template(cfg, fmt)
    if cfg.data.assistant_only and fmt in CONVERSATIONAL:
      warn_untrained_eos(template, tok)
    encode = _EncodeRow(tok, fmt, template, cfg.data, seq_len + 1)
    count = _CountRows(num_docs, key, cfg.data.path, seq_len + 1)
    it_ds = ds.map_with_index(encode).to_iter_dataset(read).map(count).filter(_kept).map(counter)
    # A row stays whole in one packed row (first fit over as many open rows as the global batch), padded at the end
    # (segment 0, never a target): a conversation cut across rows would train its second half without the first.
    it_ds = grain.experimental.FirstFitPackIterDataset(
        it_ds, length_struct={"tokens": seq_len + 1, "mask": seq_len + 1}, num_packing_bins=global_batch,
        shuffle_bins=False)
  it_ds = it_ds.batch(global_batch, drop_remainder=not once)
  if rows is None or np.array_equal(rows, np.arange(global_batch)):
    rows = slice(None)
  elif np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
    rows = slice(int(rows[0]), int(rows[0]) + len(rows))  # a view, not a copy
  example = None if cfg.data.source == "synthetic" else functools.partial(ds.__getitem__, 0)
  return DataIterator(iter(it_ds), tok, num_docs, rows, fmt != "language_modeling", f"{key}={cfg.data.path}",
                      global_batch, counter, fmt, example)
