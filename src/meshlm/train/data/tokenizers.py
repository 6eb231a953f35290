"""Tokenizers for the data pipeline: bytes (the default) or a Hugging Face tokenizer.json, and the
UTF-8 decoding rule for invalid input (replace, count, warn with file and byte offset)."""
from __future__ import annotations

import json
import logging
import os
import threading

import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError

log = logging.getLogger("meshlm.data")

# The EOS rule for a tokenizer.json: eos_token of a tokenizer_config.json beside it, else the first
# of these that the vocabulary has.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class ByteTokenizer:
  """One token per byte (ids 0..255) plus EOS = 256, which closes every document."""
  eos_id = 256
  byte_level = True
  bos_ids = np.zeros(0, np.int32)  # no BOS

  @property
  def vocab_size(self) -> int:
    return 257

  def encode(self, data: bytes | str) -> np.ndarray:
    if isinstance(data, str):
      data = data.encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, each token's first character, one past its last character): a byte belongs to its character."""
    lengths = np.array([len(c.encode("utf-8")) for c in text], np.int64)  # [chars]
    chars = np.repeat(np.arange(len(text)), lengths)  # [bytes]
    return self.encode(text), chars, chars + 1

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    # EOS and any id the model may sample past the bytes carry no text.
    return bytes(ids[(ids >= 0) & (ids < 256)].astype(np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face tokenizer.json through the `tokenizers` library.

  vocab_size is the largest id + 1 (added tokens included). eos_id follows EOS_CANDIDATES' rule. bos_ids: the special
  tokens its post-processor puts before a text (Llama 3's <|begin_of_text|>; none for GPT-2/Qwen's byte-level one),
  which a plain-text document and a prompt-completion row start with (TRL tokenizes those with the tokenizer's
  special tokens). encode itself adds no special token: chat templates write their own, and EOS closes each document.
  """
  byte_level = False

  def __init__(self, path: str):
    self.path = path
    self._tok = _load_hf_tokenizer(path)
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1
    self.eos_id = _hf_eos_id(path, vocab)
    self.bos_ids = _leading_special_ids(self._tok)

  # The Rust tokenizer is rebuilt from its file when Grain or a checkpoint pickles us.
  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])

  @property
  def eos_token(self) -> str:
    return self._tok.id_to_token(self.eos_id)

  def encode(self, text: str | bytes) -> np.ndarray:
    if isinstance(text, bytes):
      text = decode_utf8(text, "HFTokenizer.encode")
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, each token's first character, one past its last character), without special tokens added."""
    enc = self._tok.encode(text, add_special_tokens=False)
    offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)  # [tokens, 2]
    return np.asarray(enc.ids, np.int32), offsets[:, 0], offsets[:, 1]

  def token(self, i: int) -> str:
    """The token (its vocabulary string) of id i."""
    return self._tok.id_to_token(int(i))

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.vocab_size) & (ids != self.eos_id)]
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _leading_special_ids(tok) -> np.ndarray:
  """The ids the post-processor puts before a text: encode a probe with and without special tokens and take what
  comes before the plain ids (the ones after them, such as an EOS some processors append, are left to the EOS rule)."""
  plain = tok.encode("a", add_special_tokens=False).ids
  full = tok.encode("a", add_special_tokens=True).ids
  start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
  return np.asarray(full[:start], np.int32)


def tokenizer_path(name: str) -> str:
  """data.tokenizer as a file: a tokenizer.json, or a directory holding one (an HF model directory)."""
  path = os.path.expanduser(name)
  if os.path.isdir(path):
    inside = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(inside):
      raise ConfigError(f"data.tokenizer={name}: the directory has no tokenizer.json; use 'byte', a "
                        f"tokenizer.json or a directory holding one")
    return inside
  if not os.path.isfile(path):
    raise ConfigError(f"data.tokenizer={name}: no such file; use 'byte', a tokenizer.json or a directory "
                      f"holding one")
  return path


def _load_hf_tokenizer(path: str):
  from tokenizers import Tokenizer
  what = f"data.tokenizer={path}"
  try:
    with open(path, "rb") as f:
      obj = json.loads(f.read())
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise ConfigError(f"{what}: not a Hugging Face tokenizer.json (not a JSON file: {e})") from None
  # Every tokenizer.json has a "model" object (BPE, WordPiece, ...); a config.json or a
  # tokenizer_config.json does not, and the Rust parser's message for it names an enum, not the file.
  if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
    keys = ", ".join(list(obj)[:6]) if isinstance(obj, dict) else type(obj).__name__
    raise ConfigError(f"{what}: valid JSON but not a Hugging Face tokenizer.json (no \"model\" object; it has: "
                      f"{keys or 'nothing'}); point data.tokenizer at a tokenizer.json or its directory")
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises a bare Exception
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f"{what}: not a Hugging Face tokenizer.json ({first})") from None


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


def make_tokenizer(cfg: Config, otherwise: str = "or use data.source=synthetic") -> ByteTokenizer | HFTokenizer:
  """data.tokenizer: 'byte', a tokenizer.json or a directory holding one, checked against
  model.vocab_size: an id past the embedding table would give NaN logits, not an error. otherwise: the
  refusal's last way out (training: synthetic data; meshlm generate: a prompt of token ids)."""
  name = cfg.data.tokenizer
  tok = ByteTokenizer() if name == "byte" else HFTokenizer(tokenizer_path(name))
  if cfg.model.vocab_size < tok.vocab_size:
    what = ("the byte tokenizer, which has 257 ids (256 bytes + EOS)" if name == "byte"
            else f"data.tokenizer={name}, which has {tok.vocab_size} ids (0..{tok.vocab_size - 1})")
    # With loaded parameters (model=PATH) the vocabulary is fixed: the fix is a tokenizer that fits it.
    fixes = ["give data.tokenizer=PATH (the model's tokenizer.json)" if name == "byte" else
             "give a data.tokenizer that fits", otherwise]
    if cfg.checkpoint.load_params_from is None:
      fixes.insert(1, f"set model.vocab_size>={tok.vocab_size}")
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is too small for {what}; {', '.join(fixes[:-1])}, "
                      f"{fixes[-1]}")
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


class _TruncationStats:
  """Counts the SFT rows longer than a packed row (train.seq_len + 1 tokens), cut or dropped by data.truncation;
  warns for the first few, then at powers of 10 (as _Utf8Stats)."""

  def __init__(self):
    self.cut = self.dropped = 0
    self._lock = threading.Lock()

  def record(self, what: str, where="a row") -> None:
    """`where`: the row's file:line (or Parquet row), printed only when it warns."""
    with self._lock:
      setattr(self, what, getattr(self, what) + 1)
      n = self.cut + self.dropped
    if n <= 10 or str(n).rstrip("0") == "1":
      log.warning("%s: longer than train.seq_len + 1 tokens, %s (data.truncation); %d cut and %d dropped so far",
                  where, what, self.cut, self.dropped)


TRUNCATION_STATS = _TruncationStats()


def replace_invalid_utf8(data: bytes) -> tuple[str, int | None]:
  """(text with U+FFFD for each invalid sequence, byte offset of the first one or None)."""
  try:
    return data.decode("utf-8"), None
  except UnicodeDecodeError as e:
    return data.decode("utf-8", errors="replace"), e.start


def decode_utf8(data: bytes, where: str) -> str:
  """Strict UTF-8, else replacement characters and a counted warning naming where and the byte offset."""
  text, bad = replace_invalid_utf8(data)
  if bad is not None:
    UTF8_STATS.record(where, bad)
  return text
