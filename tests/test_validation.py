"""The validation set over the whole file (issue 56): every row once, token-weighted, against the mean token loss
computed here from the model's forward on each row alone; eval.batches as a cap; `meshlm eval`. A tiny llama in
float32 on 2 devices, global batch 8, prompt-completion rows through the chat fixtures' tokenizer. One compiled
validation program for the module (the forward reference compiles once per file size)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm import hf
from meshlm.cli import main
from meshlm.models.params import merge_state
from meshlm.train.data import make_dataset
from meshlm.train.data.formats import encode_row
from meshlm.train.data.tokenizers import HFTokenizer
from meshlm.train.step import build_train_step
from meshlm.train.validation import Validation, eval_config

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
SEQ = 32
MODEL = ["model=llama2-tiny", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
         "model.mlp_dim=64", "model.num_layers=1"]
RUN = ["cpu_devices=2", "train.per_device_batch_size=4", f"train.seq_len={SEQ}", "train.compute_dtype=float32",
       f"data.tokenizer={FIX}/tokenizer.json"]


def _rows(n: int) -> list[dict]:
  # Rows of 22 to 28 tokens: one per packed row of 33, so 5 rows leave 3 of a batch of 8 to padding (the old
  # repeated stream filled them with rows 1-3 again).
  return [{"prompt": f"w{i % 37} plus w{i % 11}" + " and" * (3 + i % 4), "completion": f" is w{i % 7}."}
          for i in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("validation")
  out = {}
  for n in (5, 400):
    rows = _rows(n)
    (d / f"{n}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out[n] = (str(d / f"{n}.jsonl"), rows)
  return d, out


@pytest.fixture(scope="module")
def setup(files):
  """(cfg of the 5-row file, the train step, its initial state)."""
  cfg = meshlm.load_config(*MODEL, *RUN, f"eval.path={files[1][5][0]}")
  step = build_train_step(cfg)
  assert step.global_batch == 8
  return cfg, step, step.init_state(jax.random.key(0))


def reference(cfg, state, rows) -> tuple[float, int]:
  """(mean next-token loss over every trained target of the rows, their count), each row alone through forward:
  rows padded at the end to one length (causal: padding changes no earlier logit), in one call."""
  tok = HFTokenizer(f"{FIX}/tokenizer.json")
  encoded = [encode_row(r, "prompt_completion", tok, None, True, False) for r in rows]
  assert all(len(ids) <= SEQ + 1 for ids, _ in encoded)  # nothing cut: each row counts whole
  ids = np.zeros((len(rows), SEQ + 1), np.int32)
  mask = np.zeros((len(rows), SEQ + 1), np.float64)
  for i, (x, m) in enumerate(encoded):
    ids[i, :len(x)], mask[i, :len(m)] = x, m
  logits = meshlm.forward(cfg, merge_state(state.params, state.model_state), ids[:, :-1])  # [N, T, V]
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  nll = -np.asarray(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0], np.float64)  # [N, T]
  trained = mask[:, 1:]
  return float(np.sum(nll * trained) / np.sum(trained)), int(np.sum(trained))


def test_a_file_smaller_than_a_batch_counts_each_row_once(setup, files):
  """5 rows at global batch 8: val_loss is the file's mean token loss within 1e-6, over its 5 rows and all their
  trained tokens. Controls: the old stream (repeated, so the first batch wraps around the file) is off by more than
  that, and so is the mean with rows 1-3 counted twice."""
  cfg, step, state = setup
  rows = files[1][5][1]
  want, tokens = reference(cfg, state, rows)
  v = Validation(cfg, step)
  out = v(state)
  assert abs(out["val_loss"] - want) < 1e-6, (out["val_loss"], want)
  assert (out["val_tokens"], out["val_rows"]) == (tokens, 5) and (v.tokens, v.rows) == (tokens, 5)
  assert v.describe().endswith("5 rows, " + f"{tokens:,} trained tokens in 1 global batches (the whole file)")
  wrapped = make_dataset(eval_config(cfg), global_batch=8, seq_len=SEQ, shuffle=False)  # repeated, as before
  old = Validation(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"batches": 1})}), step, data=wrapped)
  assert old(state)["val_tokens"] > tokens and abs(old(state)["val_loss"] - want) > 1e-6
  twice, _ = reference(cfg, state, rows + rows[:3])
  assert abs(twice - want) > 1e-6


def test_a_400_row_file_is_covered_whole_and_eval_batches_caps_it(setup, files):
  """400 rows: one evaluation covers all of them (every trained token, val_loss equal to the per-row reference);
  eval.batches=2 (the control) covers fewer rows and tokens, and says so."""
  cfg, step, state = setup
  path, rows = files[1][400]
  cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"path": path})})
  want, tokens = reference(cfg, state, rows)
  v = Validation(cfg, step)
  out = v(state)
  assert (out["val_rows"], out["val_tokens"]) == (400, tokens) and len(v.batches) > 2
  assert abs(out["val_loss"] - want) < 1e-6, (out["val_loss"], want)
  capped = Validation(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"batches": 2})}), step)
  assert capped.rows < 400 and capped.tokens < tokens and len(capped.batches) == 2
  assert "the first 2 global batches (eval.batches)" in capped.describe()
  # The cap counts the rows in its batches: the 2 batches hold the first rows' tokens exactly.
  first, first_tokens = reference(cfg, state, rows[:capped.rows])
  assert capped.tokens == first_tokens and abs(capped(state)["val_loss"] - first) < 1e-6


def test_meshlm_eval_reports_the_loss_of_the_given_parameters(setup, files, tmp_path, capsys):
  """`meshlm eval`: a preset at its initialization reports what Validation reports on that state; model=DIR reports
  the loss of DIR's parameters (another draw: another loss, the control). Nothing is written; no eval.path is
  refused in one line."""
  cfg, step, state = setup
  path = files[1][5][0]
  assert main(["eval", *MODEL, *RUN, "model.vocab_size=512", f"eval.path={path}", "--json"]) == 0
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert got["val_loss"] == pytest.approx(Validation(cfg, step)(state)["val_loss"], abs=1e-6)
  assert got["val_rows"] == 5
  other = meshlm.load_config(*MODEL, "cpu_devices=2")
  params = meshlm.init_params(other, jax.random.key(7))
  hf.save(other, params, tmp_path / "m")
  before = sorted(os.listdir(tmp_path))
  assert main(["eval", f"model={tmp_path}/m", *RUN, f"eval.path={path}"]) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith("meshlm eval m: val_loss ") and "5 rows" in line and f"{tmp_path}/m" in line
  theirs = float(line.split()[4])
  want, _ = reference(other, type("S", (), {"params": params, "model_state": {}})(), files[1][5][1])
  assert abs(theirs - want) < 1e-5 and abs(theirs - got["val_loss"]) > 1e-3
  assert sorted(os.listdir(tmp_path)) == before
  assert main(["eval", *MODEL, *RUN]) == 2
  err = capsys.readouterr().err
  assert "eval.path is null" in err and len(err.strip().splitlines()) == 1
