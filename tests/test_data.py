"""The data pipeline: packing invariants checked against the documents that went in."""
import functools
import glob
import hashlib
import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.train import data as D
from meshlm.train.data import sources as DS
from meshlm.train.data import ByteTokenizer, make_dataset

EOS = ByteTokenizer.eos_id
KEYS = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
        "loss_mask": np.float32}


def _write_docs(folder, n, length=None):
  """n files with distinct contents: doc i starts with its number, lengths vary unless given."""
  rng = np.random.default_rng(0)
  docs = []
  for i in range(n):
    body = f"<{i}>" + "".join(rng.choice(list("abcdefgh \n"), size=length or int(rng.integers(5, 90))))
    body = body[:length] if length else body
    (folder / f"d{i:02d}.txt").write_text(body)
    docs.append(body.encode())
  return docs


def _text_cfg(folder, **kw):
  return load_config("data.source=text", f"data.path={folder}/*.txt", *[f"{k}={v}" for k, v in kw.items()])


def _stream(it, num_batches):
  """The packed token stream: each row's inputs plus its last target, rows in order."""
  rows = []
  for _ in range(num_batches):
    b = next(it)
    rows += [np.append(b["inputs"][r], b["targets"][r, -1]) for r in range(len(b["inputs"]))]
  return np.concatenate(rows)


def _docs_of(stream):
  """Splits a stream on EOS into whole documents; the unfinished tail is dropped."""
  ends = np.flatnonzero(stream == EOS)
  return [bytes(d.astype(np.uint8)) for d in np.split(stream[:ends[-1]], ends[:-1] + 1)
          for d in [d[d != EOS]]]


def _check_batch(b, rows, seq_len):
  assert set(b) == set(KEYS)
  for k, dtype in KEYS.items():
    assert b[k].shape == (rows, seq_len) and b[k].dtype == dtype, k
  inp, tgt, seg, pos, mask = (b[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"))
  np.testing.assert_array_equal(inp[:, 1:], tgt[:, :-1])
  # Infinite stream: never padding, every row starts a segment at position 0.
  assert (seg >= 1).all() and (seg[:, 0] == 1).all() and (pos[:, 0] == 0).all()
  new_doc = seg[:, 1:] != seg[:, :-1]
  assert ((seg[:, 1:] - seg[:, :-1]) == new_doc).all()  # ids count up by one
  np.testing.assert_array_equal(pos[:, 1:] == 0, new_doc)  # restart exactly at a new segment
  np.testing.assert_array_equal(pos[:, 1:][~new_doc], pos[:, :-1][~new_doc] + 1)
  # Documents end in EOS, so a target crosses into the next document exactly after an EOS input.
  np.testing.assert_array_equal(mask, (inp != EOS).astype(np.float32))


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_batch_layout(source):
  cfg = load_config(f"data.source={source}")
  it = make_dataset(cfg, global_batch=4, seq_len=256)
  for _ in range(3):
    _check_batch(next(it), 4, 256)


def test_stdlib_is_real_text():
  b = next(make_dataset(load_config(), global_batch=2, seq_len=512))
  text = ByteTokenizer().decode(b["inputs"])
  assert "def " in text or "import " in text or "class " in text


def test_text_stream_is_shuffled_documents_each_epoch(tmp_path):
  docs = _write_docs(tmp_path, 8)
  it = make_dataset(_text_cfg(tmp_path), global_batch=2, seq_len=31)
  b = next(it)
  _check_batch(b, 2, 31)
  got = _docs_of(np.concatenate([np.append(b["inputs"][r], b["targets"][r, -1]) for r in range(2)]
                                + [_stream(it, 30)]))
  epoch1, epoch2 = got[:8], got[8:16]
  assert sorted(epoch1) == sorted(docs) and sorted(epoch2) == sorted(docs)
  assert epoch1 != docs and epoch1 != epoch2  # shuffled, and differently each epoch


def test_determinism():
  def first(seed):
    return next(make_dataset(load_config("data.source=synthetic", f"data.seed={seed}"), global_batch=4, seq_len=64))
  a, b, c = first(0), first(0), first(1)
  for k in KEYS:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["inputs"], c["inputs"])


def _digest(it, num_batches):
  h = hashlib.sha256()
  for _ in range(num_batches):
    b = next(it)
    for k in sorted(KEYS):
      h.update(b[k].tobytes())
  return h.hexdigest()


def _golden_cases(tmp_path):
  """(config, global batch, seq_len, batches): past an epoch's end for each file source."""
  (tmp_path / "t").mkdir()
  _write_docs(tmp_path / "t", 8)
  return {
      "synthetic": (load_config("data.source=synthetic"), 4, 64, 6),
      "text": (_text_cfg(tmp_path / "t"), 2, 31, 12),
      "jsonl": (load_config("data.source=jsonl", f"data.path={_write_jsonl(tmp_path / 'j', _docs_text(30))}"), 2, 63, 20),
      "parquet": (load_config("data.source=parquet", f"data.path={_write_parquet(tmp_path / 'p', _docs_text(25))}"),
                  2, 40, 12),
  }


# Computed from main at de1dd4e, before the data order became independent of the process count
# (issue 9): one process must keep that order and resume its checkpoints. Per source: the digest of
# all batches, the iterator state after 3 batches, and the digest of the 2 batches after it.
GOLDEN_ONE_PROCESS = {
    "synthetic": ("2dc5b5fa4e004f67febc41aa24c38956bf365008d92d71eb9761f7861f1e64c4",
                  {"parent_state": {"next_index": 4}, "remainder_slices": {"tokens": [12, 135]},
                   "elements_from_buffer_after_checkpoint": 1},
                  "96c3e5e6f033a71f3e4dac24cbedc497183085d3fa36ddd86fabef318a566438"),
    "text": ("d755e51c40cfab4af28e7e9201649e16e43501de08a80eec63af4812d8f3ff13",
             {"parent_state": {"next_index": 2}, "remainder_slices": {"tokens": [28, 88]},
              "elements_from_buffer_after_checkpoint": 1},
             "a91b075b461bd995dc674dd7590ec8948e1791abf631e087faa4f337644112f3"),
    "jsonl": ("a5a92b1b2e98dd9cc42abb221d0aeb750e9bcfa3c43445e1d97098d8d6e2ded4",
              {"parent_state": {"next_index": 8}, "remainder_slices": {"tokens": [38, 59]},
               "elements_from_buffer_after_checkpoint": 1},
              "09abac761f131ce1c412865f067fb7566f29a8b5ddc7738432abdf46ca4f71b0"),
    "parquet": ("fa66d1e3745c0e613699b005a1991055cfefd84e04a13846000cb90544b35737",
                {"parent_state": {"next_index": 6}, "remainder_slices": {"tokens": [9, 29]},
                 "elements_from_buffer_after_checkpoint": 1},
                "2c3c466366c5355c680eb9ab3f2230b002f3f5dd6773fa852edb14cb946af4db"),
}


def test_one_process_keeps_the_order_and_states_of_before(tmp_path):
  for name, (cfg, gb, seq_len, n) in _golden_cases(tmp_path).items():
    batches, state, after = GOLDEN_ONE_PROCESS[name]
    assert _digest(make_dataset(cfg, global_batch=gb, seq_len=seq_len), n) == batches, name
    it = make_dataset(cfg, global_batch=gb, seq_len=seq_len)
    for _ in range(3):
      next(it)
    assert json.loads(json.dumps(it.get_state())) == state, name
    # A checkpoint's state from before resumes where it was.
    fresh = make_dataset(cfg, global_batch=gb, seq_len=seq_len)
    fresh.set_state(state)
    assert _digest(fresh, 2) == after, name
  # Negative control: the digest tells another order apart (here the next seed).
  other = make_dataset(load_config("data.source=synthetic", "data.seed=1"), global_batch=4, seq_len=64)
  assert _digest(other, 6) != GOLDEN_ONE_PROCESS["synthetic"][0]


@pytest.mark.parametrize("source", ["text", "synthetic"])
def test_rows_are_those_of_the_global_batch(source, tmp_path):
  """Any split of the rows (2 x 2, 4 x 1, non-contiguous) sees the rows of the same global batches,
  with the same state, which resumes on any other split."""
  _write_docs(tmp_path, 10)
  cfg = _text_cfg(tmp_path) if source == "text" else load_config("data.source=synthetic")
  whole = make_dataset(cfg, global_batch=4, seq_len=15)
  splits = [[0, 1], [2, 3], [3], [0, 2]]
  parts = [make_dataset(cfg, global_batch=4, seq_len=15, rows=np.array(r)) for r in splits]
  for step in range(8):
    want = next(whole)
    _check_batch(want, 4, 15)
    for rows, it in zip(splits, parts):
      got = next(it)
      for k in KEYS:
        np.testing.assert_array_equal(got[k], want[k][rows], err_msg=f"{k} of rows {rows} at batch {step}")
      assert it.get_state() == whole.get_state()
  # Resume a 2-process position on 1 process, and the other way round.
  state = json.loads(json.dumps(parts[0].get_state()))
  want = [next(whole) for _ in range(3)]
  one, half = make_dataset(cfg, global_batch=4, seq_len=15), make_dataset(cfg, global_batch=4, seq_len=15,
                                                                          rows=np.array([2, 3]))
  one.set_state(state)
  half.set_state(json.loads(json.dumps(whole.get_state())))
  later = next(whole)
  for w in want:
    got = next(one)
    for k in KEYS:
      np.testing.assert_array_equal(got[k], w[k])
  np.testing.assert_array_equal(next(half)["inputs"], later["inputs"][2:])
  with pytest.raises(ValueError, match="rows"):
    make_dataset(cfg, global_batch=4, seq_len=15, rows=np.array([4]))


class _FakeSharding:
  """The one method process_rows reads: device -> index of the slices this process's devices hold."""

  def __init__(self, row_slices):
    self.row_slices = row_slices

  def addressable_devices_indices_map(self, shape):
    return {d: (s, slice(None)) for d, s in enumerate(self.row_slices)}


def test_process_rows_follow_the_sharding():
  # Two devices of this process hold rows 6-7 and 2-3 (listed out of order): local data is 2,3,6,7.
  np.testing.assert_array_equal(D.process_rows(_FakeSharding([slice(6, 8), slice(2, 4)]), (8, 5)), [2, 3, 6, 7])
  # Devices that replicate a block (a tensor axis) read it once.
  np.testing.assert_array_equal(D.process_rows(_FakeSharding([slice(0, 4), slice(0, 4)]), (8, 5)), [0, 1, 2, 3])
  # Rows replicated everywhere: every row.
  np.testing.assert_array_equal(D.process_rows(_FakeSharding([slice(None)]), (8, 5)), np.arange(8))
  # One process holds every device, so every row, on any mesh.
  import jax
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4])
  np.testing.assert_array_equal(D.batch_rows(mesh, 8, 16), np.arange(8))


def test_checkpoint_data_state_is_process_count_independent(monkeypatch):
  from meshlm.train import checkpoint as C
  state = {"parent_state": {"next_index": 4}}
  item = C._data_item(state)
  assert item == {"state": state, "process_count": 1}
  assert C._data_state(item, "ckpt/4") == state
  # Saved by 1 process before this format: its only state is the global stream's.
  assert C._data_state({"process_count": 1, "states": [state]}, "ckpt/4") == state
  # Saved by 2 processes before it: per-process shards that no stream of today continues.
  with pytest.raises(ConfigError, match=r"checkpoint ckpt/4 holds the per-process data positions of 2 processes"):
    C._data_state({"process_count": 2, "states": [state, state]}, "ckpt/4")
  # Processes that disagree (different data.* keys) are refused at save time.
  monkeypatch.setattr(C, "_gather_json", lambda s: [s, {"parent_state": {"next_index": 5}}])
  with pytest.raises(ConfigError, match="processes 0 and 1 are at different data positions"):
    C._data_item(state)


@pytest.mark.parametrize("source", ["stdlib", "synthetic", "aligned"])
def test_state_round_trip(source, tmp_path):
  if source == "aligned":
    # Every document fills exactly one row, so checkpoints fall where no document is half-read.
    _write_docs(tmp_path, 6, length=16)
    cfg, seq_len = _text_cfg(tmp_path), 16
  else:
    cfg, seq_len = load_config(f"data.source={source}"), 128
  it = make_dataset(cfg, global_batch=3, seq_len=seq_len)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # as a checkpoint would store it
  want = [next(it) for _ in range(2)]
  fresh = make_dataset(cfg, global_batch=3, seq_len=seq_len)
  fresh.set_state(state)
  for w in want:
    got = next(fresh)
    for k in KEYS:
      np.testing.assert_array_equal(got[k], w[k])


def test_text_errors(tmp_path):
  with pytest.raises(ConfigError, match="data.path"):
    make_dataset(_text_cfg(tmp_path), global_batch=2, seq_len=8)  # no *.txt yet
  with pytest.raises(ConfigError, match="data.path"):
    make_dataset(load_config("data.source=text"), global_batch=2, seq_len=8)
  (tmp_path / "a.txt").write_text("hello")
  (tmp_path / "b.txt").write_text("")
  with pytest.raises(ConfigError, match="b.txt"):
    make_dataset(_text_cfg(tmp_path), global_batch=2, seq_len=8)


def test_vocab_too_small():
  with pytest.raises(ConfigError, match="model.vocab_size"):
    make_dataset(load_config("model.vocab_size=256"), global_batch=2, seq_len=8)


def test_byte_tokenizer():
  tok = ByteTokenizer()
  assert tok.vocab_size == 257 and tok.eos_id == 256
  text = "héllo, wörld ✓\n"
  ids = tok.encode(text.encode())
  assert ids.dtype == np.int32 and len(ids) == len(text.encode())
  assert tok.decode(ids) == text
  assert tok.decode(np.append(ids, [EOS, 300])) == text  # EOS and out-of-range ids carry no text
  assert tok.decode(tok.encode(b"ok\xff\xfe")) == "ok\ufffd\ufffd"


# ---------------------------------------------------------------------------------------------
# JSONL, Parquet and Hugging Face tokenizers


def _docs_text(n, seed=0):
  rng = np.random.default_rng(seed)
  return [f"<{i}>" + "".join(rng.choice(list("abcdefgh \n"), size=int(rng.integers(0, 60)))) for i in range(n)]


def _write_jsonl(folder, texts, per_file=7, field="text"):
  """Several files; blank lines between some records and no final newline in the last file."""
  folder.mkdir(exist_ok=True)
  for f, k in enumerate(range(0, len(texts), per_file)):
    lines = [json.dumps({"id": i, field: t}) for i, t in enumerate(texts[k:k + per_file], k)]
    body = "\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])
    (folder / f"part{f}.jsonl").write_text(body + ("" if k + per_file >= len(texts) else "\n"))
  return f"{folder}/*.jsonl"


def _write_parquet(folder, texts, per_file=11, row_group=3, field="text"):
  folder.mkdir(exist_ok=True)
  for f, k in enumerate(range(0, len(texts), per_file)):
    pq.write_table(pa.table({"id": list(range(k, k + len(texts[k:k + per_file]))), field: texts[k:k + per_file]}),
                   folder / f"part{f}.parquet", row_group_size=row_group)
  return f"{folder}/*.parquet"


def _hf_tokenizer(folder, words="abcdefgh", eos="</s>"):
  """A word-level tokenizer.json: [UNK]=0, the letters, digits and '<', '>' and EOS last."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {"[UNK]": 0}
  for w in list(words) + [str(d) for d in range(10)] + ["<", ">"]:
    vocab.setdefault(w, len(vocab))
  vocab[eos] = len(vocab)
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
  tok.decoder = decoders.Fuse()  # ... and decoded without spaces between them
  tok.add_special_tokens([eos])
  path = folder / "tokenizer.json"
  tok.save(str(path))
  return str(path), vocab


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_sources_index_every_document(kind, tmp_path):
  texts = _docs_text(40)
  path = _write_jsonl(tmp_path / "j", texts) if kind == "jsonl" else _write_parquet(tmp_path / "p", texts)
  docs = (DS._jsonl_lines if kind == "jsonl" else DS._parquet_rows)(load_config(f"data.source={kind}", f"data.path={path}"))
  assert [docs[i].data for i in range(len(docs))] == texts  # storage order, nothing lost, blank lines skipped


class _ReadSpans:
  """A binary file that records the byte spans read from it."""

  def __init__(self, path, spans):
    self.f, self.spans = open(path, "rb"), spans

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.f.close()

  def seek(self, pos):
    return self.f.seek(pos)

  def read(self, n=-1):
    start = self.f.tell()
    out = self.f.read(n)
    self.spans.append((start, start + len(out)))
    return out


def test_jsonl_scan_reads_only_its_range(tmp_path, monkeypatch):
  (file,) = glob.glob(_write_jsonl(tmp_path / "j", _docs_text(60), per_file=60))
  size = os.path.getsize(file)
  spans = []
  monkeypatch.setattr(DS, "open", lambda p, mode="r": _ReadSpans(p, spans), raising=False)
  monkeypatch.setattr(DS, "_SCAN_CHUNK", 64)  # small chunks, so reading can stop soon after the range
  lo, hi = size // 2, 3 * size // 4
  starts, ends = DS._scan_lines(file, size, lo, hi)
  data = open(file, "rb").read()
  want = [i for i in range(lo, hi) if data[i - 1:i] == b"\n" and data[i:i + 1] != b"\n"]
  assert list(starts) == want and all(data[e:e + 1] in (b"\n", b"") for e in ends)
  # It reads from one byte before its range to the end of its last line, plus at most one chunk.
  assert min(a for a, _ in spans) == lo - 1
  assert max(b for _, b in spans) <= ends[-1] + 1 + 64


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_file_sources_stream_each_document_once_per_epoch(kind, tmp_path):
  texts = _docs_text(30)
  path = _write_jsonl(tmp_path / "j", texts) if kind == "jsonl" else _write_parquet(tmp_path / "p", texts)
  it = make_dataset(load_config(f"data.source={kind}", f"data.path={path}"), global_batch=2, seq_len=63)
  b = next(it)
  _check_batch(b, 2, 63)
  stream = np.concatenate([np.append(b["inputs"][r], b["targets"][r, -1]) for r in range(2)] + [_stream(it, 20)])
  got = _docs_of(stream)
  want = sorted(t.encode() for t in texts)
  epoch1, epoch2 = got[:30], got[30:60]
  assert sorted(epoch1) == want and sorted(epoch2) == want
  assert epoch1 != [t.encode() for t in texts] and epoch1 != epoch2


def test_parquet_state_round_trip(tmp_path):
  cfg = load_config("data.source=parquet", f"data.path={_write_parquet(tmp_path / 'p', _docs_text(25))}")
  it = make_dataset(cfg, global_batch=2, seq_len=40)
  for _ in range(7):  # past the end of the first epoch (~700 tokens)
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(6)]
  fresh = make_dataset(cfg, global_batch=2, seq_len=40)
  fresh.set_state(state)
  for w in want:
    got = next(fresh)
    for k in KEYS:
      np.testing.assert_array_equal(got[k], w[k])


def test_parquet_shuffle_is_local_and_deterministic(tmp_path):
  cfg = load_config("data.source=parquet", f"data.path={_write_parquet(tmp_path / 'p', _docs_text(60), row_group=4)}")
  shard = DS._parquet_rows(cfg)  # 6 files: row groups of 4, 4, 3 rows
  n = len(shard)
  order = [shard.storage_index(i) for i in range(2 * n)]
  assert sorted(order[:n]) == list(range(n)) and sorted(order[n:]) == list(range(n))
  assert order[:n] != order[n:] and order[:n] != list(range(n))
  assert order == [DS._parquet_rows(cfg).storage_index(i) for i in range(2 * n)]
  # Each window draws from at most PARQUET_WINDOW_GROUPS row groups.
  group = np.searchsorted(shard.block_starts, order[:n], side="right") - 1
  _, window_starts = shard._epoch(0)
  for a, b in zip(window_starts[:-1], window_starts[1:]):
    assert len(set(group[a:b])) == DS.PARQUET_WINDOW_GROUPS


def test_hf_tokenizer_stream(tmp_path):
  path, vocab = _hf_tokenizer(tmp_path)
  texts = ["abc", "hhh<1>", "ggg"]
  folder = tmp_path / "t"
  folder.mkdir()
  for i, t in enumerate(texts):
    (folder / f"{i}.txt").write_text(t)
  cfg = load_config("data.source=text", f"data.path={folder}/*.txt", f"data.tokenizer={path}")
  it = make_dataset(cfg, global_batch=1, seq_len=15)
  tok = it.tokenizer
  assert tok.eos_id == vocab["</s>"] and tok.vocab_size == len(vocab)
  row = next(it)["inputs"][0]
  eos = np.flatnonzero(row == tok.eos_id)
  docs = sorted(tok.decode(d) for d in np.split(row[:eos[2]], eos[:2] + 1))
  assert docs == sorted(texts)
  np.testing.assert_array_equal(tok.encode("hhh<1>"), [vocab[c] for c in "hhh<1>"])


def test_hf_eos_rule(tmp_path):
  path, vocab = _hf_tokenizer(tmp_path, eos="<|endoftext|>")
  assert D.HFTokenizer(path).eos_id == vocab["<|endoftext|>"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "h"}}))
  assert D.HFTokenizer(path).eos_id == vocab["h"]  # tokenizer_config.json wins
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
  with pytest.raises(ConfigError, match="eos_token '<nope>'"):
    D.HFTokenizer(path)
  other = tmp_path / "o"
  other.mkdir()
  path, _ = _hf_tokenizer(other, eos="<sep>")
  with pytest.raises(ConfigError, match=r"data.tokenizer=.*no EOS token"):
    D.HFTokenizer(path)


def test_invalid_utf8(tmp_path, caplog, monkeypatch):
  monkeypatch.setattr(D.UTF8_STATS, "documents", 0)  # warnings thin out after 10: start the count here
  folder = tmp_path / "t"
  folder.mkdir()
  (folder / "bad.txt").write_bytes(b"ab\xffc")
  # The byte tokenizer takes the bytes as they are: no warning.
  cfg = load_config("data.source=text", f"data.path={folder}/*.txt")
  with caplog.at_level(logging.WARNING, logger="meshlm.data"):
    row = next(make_dataset(cfg, global_batch=1, seq_len=9))["inputs"][0]
  np.testing.assert_array_equal(row[:5], [97, 98, 255, 99, EOS])
  assert not caplog.records
  # A tokenizer.json gets U+FFFD (here [UNK]) and a warning naming the file and byte offset, counted.
  path, vocab = _hf_tokenizer(tmp_path)
  cfg = load_config("data.source=text", f"data.path={folder}/*.txt", f"data.tokenizer={path}")
  it = make_dataset(cfg, global_batch=1, seq_len=9)
  counts = []
  with caplog.at_level(logging.WARNING, logger="meshlm.data"):
    for _ in range(6):
      row = next(it)["inputs"][0]
      counts.append(D.UTF8_STATS.documents)
  np.testing.assert_array_equal(row[:5], [vocab["a"], vocab["b"], vocab["[UNK]"], vocab["c"], vocab["</s>"]])
  # The count is of documents packed, whatever Grain's threads read ahead (16 documents here): the
  # 1-document corpus is 5 tokens (with EOS), a row of 10 takes 2 of them, and the packer holds one
  # more for the next row. Counted at read time it would be ahead by up to the prefetch buffer.
  assert counts == [2 * k + 1 for k in range(1, 7)]
  assert len(caplog.records) == 10  # then thinned out to 100, 1000, ...
  assert caplog.records[0].getMessage() == (f"{folder}/bad.txt: invalid UTF-8 at byte offset 2, replaced "
                                            f"with U+FFFD (1 document with invalid UTF-8 so far)")
  assert caplog.records[9].getMessage().endswith("(10 documents with invalid UTF-8 so far)")


def test_file_source_errors(tmp_path):
  j = tmp_path / "j"
  j.mkdir()
  cfg = load_config("data.source=jsonl", f"data.path={j}/*.jsonl")
  with pytest.raises(ConfigError, match=r"data.path=.* matches no files"):
    make_dataset(cfg, global_batch=1, seq_len=8)
  (j / "a.jsonl").write_text("")
  with pytest.raises(ConfigError, match=r"a.jsonl is empty"):
    make_dataset(cfg, global_batch=1, seq_len=8)
  (j / "a.jsonl").write_text('{"text": "x"}\n{"text": "y"}\n{"text": oops}\n')
  it = make_dataset(cfg, global_batch=1, seq_len=8)  # only each file's first line is parsed eagerly
  with pytest.raises(ConfigError, match=r"a.jsonl:3: not valid JSON"):
    for _ in range(3):
      next(it)
  (j / "a.jsonl").write_text('not json\n')
  with pytest.raises(ConfigError, match=r"a.jsonl:1: not valid JSON"):
    make_dataset(cfg, global_batch=1, seq_len=8)
  (j / "a.jsonl").write_text('\n{"content": "x"}\n')
  with pytest.raises(ConfigError, match=r"a.jsonl:2: no field 'text' \(data.field\); the line has keys: content"):
    make_dataset(cfg, global_batch=1, seq_len=8)
  (j / "a.jsonl").write_text('{"text": 3}\n')
  with pytest.raises(ConfigError, match=r"a.jsonl:1: field 'text' is int"):
    make_dataset(cfg, global_batch=1, seq_len=8)

  p = tmp_path / "p"
  p.mkdir()
  pq.write_table(pa.table({"body": ["x"]}), p / "a.parquet")
  cfg = load_config("data.source=parquet", f"data.path={p}/*.parquet")
  with pytest.raises(ConfigError, match=r"a.parquet has no column 'text' \(data.field\); its columns: body"):
    make_dataset(cfg, global_batch=1, seq_len=8)
  pq.write_table(pa.table({"text": pa.array([], pa.string())}), p / "a.parquet")
  with pytest.raises(ConfigError, match=r"a.parquet has no rows"):
    make_dataset(cfg, global_batch=1, seq_len=8)
  (p / "a.parquet").write_text("not parquet")
  with pytest.raises(ConfigError, match=r"a.parquet is not a readable Parquet file"):
    make_dataset(cfg, global_batch=1, seq_len=8)


def test_tokenizer_and_length_errors(tmp_path):
  path, vocab = _hf_tokenizer(tmp_path)
  with pytest.raises(ConfigError, match=rf"model.vocab_size=8 is too small for data.tokenizer=.*set model.vocab_size>={len(vocab)}"):
    make_dataset(load_config(f"data.tokenizer={path}", "model.vocab_size=8"), global_batch=1, seq_len=8)
  with pytest.raises(ConfigError, match=r"data.tokenizer=.*missing.json: no such file"):
    make_dataset(load_config(f"data.tokenizer={tmp_path}/missing.json"), global_batch=1, seq_len=8)
  (tmp_path / "junk.json").write_text("{not json")
  with pytest.raises(ConfigError, match=r"junk.json: not a Hugging Face tokenizer.json \(not a JSON file: "):
    make_dataset(load_config(f"data.tokenizer={tmp_path}/junk.json"), global_batch=1, seq_len=8)
  # Valid JSON, the wrong file (an HF config.json): said so, not the Rust parser's enum message.
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 32}))
  with pytest.raises(ConfigError, match=r"config.json: valid JSON but not a Hugging Face tokenizer.json "
                                        r"\(no \"model\" object; it has: architectures, vocab_size\)") as e:
    make_dataset(load_config(f"data.tokenizer={tmp_path}/config.json"), global_batch=1, seq_len=8)
  assert "\n" not in str(e.value) and "enum" not in str(e.value)
  with pytest.raises(ConfigError, match=r"train.seq_len=4096 is beyond model.max_position=2048"):
    load_config("train.seq_len=4096")


def test_tokenizer_directory(tmp_path):
  """data.tokenizer=DIR reads DIR/tokenizer.json (and its tokenizer_config.json, for EOS)."""
  path, vocab = _hf_tokenizer(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "h"}))
  (tmp_path / "t").mkdir()
  (tmp_path / "t" / "a.txt").write_text("abc")
  cfg = load_config("data.source=text", f"data.path={tmp_path}/t/*.txt", f"data.tokenizer={tmp_path}")
  it = make_dataset(cfg, global_batch=1, seq_len=7)
  assert it.tokenizer.path == path and it.tokenizer.eos_id == vocab["h"]
  np.testing.assert_array_equal(next(it)["inputs"][0, :4], [vocab[c] for c in "abc"] + [vocab["h"]])
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ConfigError, match=rf"data.tokenizer={empty}: the directory has no tokenizer.json"):
    make_dataset(load_config(f"data.tokenizer={empty}"), global_batch=1, seq_len=8)


def test_cli_refuses_a_tokenizer_past_the_vocab(tmp_path, capsys):
  """Ids >= model.vocab_size would index past the embedding table (NaN logits): exit 2, both sizes."""
  from meshlm.cli import main
  _hf_tokenizer(tmp_path)  # 22 ids
  rc = main(["train", "data.source=text", f"data.path={tmp_path}/*.json", f"data.tokenizer={tmp_path}",
             "model.vocab_size=16", f"run_dir={tmp_path}/run", "cpu_devices=1", "train.steps=1"])
  err = [l for l in capsys.readouterr().err.splitlines() if "error" in l or "Traceback" in l]
  assert rc == 2 and len(err) == 1, err
  assert err[0] == (f"meshlm: error: model.vocab_size=16 is too small for data.tokenizer={tmp_path}, which has 22 "
                    f"ids (0..21); give a data.tokenizer that fits, set model.vocab_size>=22, or use data.source=synthetic")


def test_cli_exits_2_on_bad_data(tmp_path, capsys):
  from meshlm.cli import main
  rc = main(["train", "data.source=jsonl", f"data.path={tmp_path}/none/*.jsonl", f"run_dir={tmp_path}/run",
             "cpu_devices=1", "train.steps=1"])
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("meshlm: error:")]
  assert rc == 2 and len(err) == 1 and "data.path=" in err[0] and "matches no files" in err[0]


# ---------------------------------------------------------------------------------------------
# Packing at the model: attention never crosses a document boundary


def _tiny_forward_cfg():
  return load_config("model.embed_dim=32", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
                     "model.mlp_dim=64", "model.num_layers=2", "train.compute_dtype=float32")


def test_packed_document_sees_only_itself(tmp_path):
  import jax
  import meshlm
  _write_docs(tmp_path, 6, length=20)
  b = next(make_dataset(_text_cfg(tmp_path), global_batch=1, seq_len=72))
  inp, seg, pos = b["inputs"], b["segment_ids"], b["positions"]  # [1, T]
  # Documents of 21 tokens (with EOS): document 2 is tokens 21..41 of the row, between 1 and 3.
  in2 = seg[0] == 2
  np.testing.assert_array_equal(np.flatnonzero(in2), np.arange(21, 42))
  np.testing.assert_array_equal(pos[0, in2], np.arange(21))
  cfg = _tiny_forward_cfg()
  # Random parameters straight from numpy: compiling the initializer would cost more than the test.
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: meshlm.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  forward = jax.jit(functools.partial(meshlm.forward, cfg))  # one compile per shape, not op by op
  packed = np.asarray(forward(params, inp, pos, seg))[0, in2]  # [n, V]
  doc = inp[:, in2]
  alone = np.asarray(forward(params, doc, np.arange(doc.shape[1])[None], np.ones_like(doc)))[0]
  np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
  # Without segment ids, document 2 attends to document 1 and its logits move far past the tolerance.
  leaky = np.asarray(forward(params, inp, pos, None))[0, in2]
  assert np.abs(leaky - alone).max() > 1e-2


@settings(max_examples=40, deadline=None)
@given(lines=st.lists(st.sampled_from(["", "a", "bc", "\r", "{}", "x" * 70]), max_size=30),
       final_newline=st.booleans(), cuts=st.lists(st.integers(0, 2000), max_size=5))
def test_scan_lines_partitions_any_file(lines, final_newline, cuts, tmp_path_factory):
  """Consecutive byte ranges, however cut, index every non-empty line exactly once, in order."""
  body = "\n".join(lines) + ("\n" if final_newline and lines else "")
  if not body:
    return
  path = tmp_path_factory.mktemp("scan") / "f.jsonl"
  path.write_text(body, newline="")
  size = len(body)
  want, pos = [], 0
  for line in body.split("\n"):
    if line:
      want.append((pos, pos + len(line)))
    pos += len(line) + 1
  bounds = [0] + sorted(min(c, size) for c in cuts) + [size]
  got = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    if lo < hi:
      s, e = DS._scan_lines(str(path), size, lo, hi)
      got += list(zip(s.tolist(), e.tolist()))
  assert got == want
