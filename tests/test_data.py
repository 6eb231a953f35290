"""The data pipeline: packing invariants checked against the documents that went in."""
import json

import numpy as np
import pytest

from meshlm.config import ConfigError, load_config
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


def test_process_shards_are_disjoint(tmp_path):
  docs = _write_docs(tmp_path, 10)
  cfg = _text_cfg(tmp_path)
  its = [make_dataset(cfg, global_batch=4, seq_len=15, process_index=p, process_count=2) for p in range(2)]
  assert all(next(make_dataset(cfg, global_batch=4, seq_len=15, process_index=p, process_count=2))
             ["inputs"].shape == (2, 15) for p in range(2))
  shards = [set(_docs_of(_stream(it, 20))) for it in its]
  assert not shards[0] & shards[1]
  assert shards[0] | shards[1] == set(docs)
  with pytest.raises(ConfigError, match="3 processes"):
    make_dataset(cfg, global_batch=4, seq_len=15, process_count=3)


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
