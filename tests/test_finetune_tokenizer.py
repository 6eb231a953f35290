"""Fine-tuning a model whose tokenizer_config.json names its special tokens (issue 56): a tiny Hugging Face llama
directory with Llama 3's tokenizer files (bos <|begin_of_text|>, eos <|eot_id|>, Llama 3.1's template, which starts
with {{- bos_token }}, and a post-processor that puts the BOS before a text). The run directory and its export keep
those files, so a chat prompt renders as from the model directory, a fine-tune of the run ends completions with
<|eot_id|>, and transformers reads the export with the same tokens. One `meshlm train` (2 steps) for the module."""
import contextlib
import io
import json
import os
import shutil

import jax
import numpy as np
import pytest

import meshlm
from meshlm import hf
from meshlm.cli import main
from meshlm.train.data import make_dataset
from meshlm.train.data.chat import ChatTemplate, load_chat_template
from meshlm.train.data.tokenizers import HFTokenizer

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
BOS, EOT, FALLBACK_EOS = 5, 8, 0  # <|begin_of_text|>, <|eot_id|>, <|endoftext|> (the first EOS_CANDIDATES it has)
USER = [{"role": "user", "content": "What is 3 + 3?"}]
SMALL = ["cpu_devices=1", "train.seq_len=128", "train.per_device_batch_size=2", "train.compute_dtype=float32",
         "train.warmup_steps=0"]


def llama3_tokenizer(folder) -> None:
  """The chat fixtures' tokenizer.json with Llama 3's post-processor (BOS before a text), and Llama 3's
  tokenizer_config.json: its bos/eos tokens and Llama 3.1's chat template."""
  from tokenizers import Tokenizer, processors
  tok = Tokenizer.from_file(os.path.join(FIX, "tokenizer.json"))
  tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                     special_tokens=[("<|begin_of_text|>", BOS)])
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(FIX, "llama3_1.jinja")) as f:
    template = f.read()
  config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A tiny HF llama directory with Llama 3's tokenizer files, fine-tuned 2 steps on conversations by
  `meshlm train model=DIR`, then exported by `meshlm convert meshlm-to-hf RUN`."""
  tmp = tmp_path_factory.mktemp("llama3")
  cfg = meshlm.load_config("model=llama2-tiny", "model.vocab_size=384", "model.embed_dim=32", "model.num_heads=2",
                           "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=64", "model.num_layers=1",
                           f"model.bos_token_id={BOS}", f"model.eos_token_id={EOT}", "cpu_devices=1")
  model = tmp / "model"
  hf.save(cfg, meshlm.init_params(cfg, jax.random.key(0)), model)
  llama3_tokenizer(model)
  rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(8)]
  (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  run, export = tmp / "run", tmp / "export"
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    rc = main(["train", f"model={model}", "train.steps=2", "train.sample_tokens=4", "train.sample_temperature=0",
               *SMALL, f"data.path={tmp}/chat.jsonl", f"run_dir={run}"])
  rc_export = main(["convert", "meshlm-to-hf", str(run), str(export), "cpu_devices=1"])
  return dict(tmp=tmp, model=model, run=run, export=export, rc=rc, rc_export=rc_export, out=out.getvalue())


def _chat_ids(folder) -> list[int]:
  template = load_chat_template(None, os.path.join(folder, "tokenizer.json"))
  return HFTokenizer(os.path.join(folder, "tokenizer.json")).encode_offsets(
      template.render(USER, add_generation_prompt=True)[0])[0].tolist()


def test_the_run_dir_renders_the_chat_prompt_as_the_model_dir(runs):
  """The run directory's chat rendering is the model directory's, BOS first; the same template without the
  tokenizer_config.json's special tokens (what the run directory held before it carried the file) drops the BOS."""
  assert runs["rc"] == 0
  want = _chat_ids(runs["model"])
  assert want[0] == BOS and _chat_ids(runs["run"]) == want
  assert json.loads((runs["run"] / "tokenizer_config.json").read_text()) == \
      json.loads((runs["model"] / "tokenizer_config.json").read_text())
  bare = ChatTemplate((runs["run"] / "chat_template.jinja").read_text(), "bare", {})
  tok = HFTokenizer(str(runs["run"] / "tokenizer.json"))
  assert tok.encode_offsets(bare.render(USER, add_generation_prompt=True)[0])[0].tolist() == want[1:]


def test_a_fine_tune_of_the_run_ends_completions_with_its_eos(runs, tmp_path):
  """`meshlm train model=RUN` on prompt-completion rows: every completion's trained tokens end with <|eot_id|>;
  from a copy of the run without tokenizer_config.json (the control) they would end with <|endoftext|>."""
  rows = [{"prompt": f"w{i} plus", "completion": f" w{i}"} for i in range(6)]
  (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  def trained_eos(run) -> tuple[int, int, int]:
    """(the tokenizer's eos id, how many trained targets are <|eot_id|>, how many rows the batch holds)"""
    cfg = meshlm.load_config(f"model={run}", *SMALL, f"data.path={tmp_path}/pc.jsonl", "train.seq_len=32")
    b = next(make_dataset(cfg, global_batch=2, seq_len=32))
    trained = b["targets"][b["loss_mask"] > 0]
    seg = b["segment_ids"]
    docs = len({(r, seg[r, c]) for r, c in zip(*np.nonzero(seg))})
    return HFTokenizer(cfg.data.tokenizer).eos_id, int(np.sum(trained == EOT)), docs

  eos, ends, docs = trained_eos(runs["run"])
  assert eos == EOT and ends == docs > 0
  bare = tmp_path / "bare"
  shutil.copytree(runs["run"], bare)
  os.remove(bare / "tokenizer_config.json")
  eos, ends, _ = trained_eos(bare)
  assert eos == FALLBACK_EOS and ends == 0


def test_the_export_keeps_the_tokenizer_config(runs):
  """The export has the model directory's tokenizer_config.json (the same bos/eos) and renders the chat prompt as
  the model directory does, without transformers."""
  assert runs["rc_export"] == 0
  ours = json.loads((runs["export"] / "tokenizer_config.json").read_text())
  theirs = json.loads((runs["model"] / "tokenizer_config.json").read_text())
  assert (ours["bos_token"], ours["eos_token"]) == (theirs["bos_token"], theirs["eos_token"]) == \
      ("<|begin_of_text|>", "<|eot_id|>")
  assert _chat_ids(runs["export"]) == _chat_ids(runs["model"])


def test_transformers_reads_the_export_with_the_model_dirs_tokens(runs):
  """Where transformers is installed: AutoTokenizer on the export has the model directory's bos/eos and renders the
  chat prompt to the ids meshlm renders (BOS first)."""
  transformers = pytest.importorskip("transformers")
  tok = transformers.AutoTokenizer.from_pretrained(str(runs["export"]))
  assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
  ids = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)
  ids = ids["input_ids"] if isinstance(ids, dict) else ids
  assert list(ids) == _chat_ids(runs["model"])


def test_the_end_of_run_sample_of_a_chat_fine_tune_is_a_user_turn(runs):
  """The run's closing sample prompts with a row's user turn rendered by the chat template (BOS, headers, the
  generation prompt), not with "The "; a plain-text run (the control) still starts from "The "."""
  from meshlm.train.loop import sample_prompt
  assert runs["rc"] == 0
  shown = runs["out"][runs["out"].index("sample (greedy):"):]
  assert "[user] What is " in shown and "\n[assistant] " in shown and "The " not in shown
  cfg = meshlm.load_config(f"model={runs['model']}", *SMALL, f"data.path={runs['tmp']}/chat.jsonl")
  data = make_dataset(cfg, global_batch=2, seq_len=128)
  ids, text, stops = sample_prompt(cfg, data, data.tokenizer)
  user = [m for m in data.example().data["messages"] if m["role"] == "user"]
  template = load_chat_template(None, cfg.data.tokenizer)
  want = data.tokenizer.encode_offsets(template.render(user, add_generation_prompt=True)[0])[0].tolist()
  assert ids == want and ids[0] == BOS and text == f"[user] {user[0]['content']}\n[assistant] " and EOT in stops
  (runs["tmp"] / "plain.jsonl").write_text(json.dumps({"text": "w1 w2"}) + "\n")
  plain = make_dataset(cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": f"{runs['tmp']}/plain.jsonl"})}),
                       global_batch=2, seq_len=128)
  ids, text, stops = sample_prompt(cfg, plain, plain.tokenizer)
  assert text == "The " and ids == [BOS] + plain.tokenizer.encode("The ").tolist() and stops is None


@pytest.mark.parametrize("fmt", ["language_modeling", "prompt_completion"])
def test_plain_text_rows_start_with_the_post_processors_bos(runs, tmp_path, fmt):
  """Plain-text and prompt-completion rows are the tokenizer's own encoding with its special tokens (its
  post-processor's BOS first, as TRL tokenizes them) and EOS; the chat fixtures' tokenizer, which has no
  post-processor (the control), puts nothing before the text."""
  from tokenizers import Tokenizer
  texts = ["w1 w2 w3", "w4 plus w5"]
  rows = ([{"text": t} for t in texts] if fmt == "language_modeling" else
          [{"prompt": t, "completion": " w6"} for t in texts])
  (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  def first_tokens(tokenizer: str) -> tuple[list[int], list[int]]:
    """(the packed row's tokens, what the tokenizer itself makes of the rows: encode with special tokens + EOS)"""
    cfg = meshlm.load_config("model=llama2-tiny", f"data.tokenizer={tokenizer}", f"data.path={tmp_path}/rows.jsonl",
                             "data.seed=0")
    b = next(make_dataset(cfg, global_batch=1, seq_len=64, shuffle=False))
    row = np.concatenate([b["inputs"][0], b["targets"][0, -1:]]).tolist()
    tok = Tokenizer.from_file(tokenizer)
    eos = HFTokenizer(tokenizer).eos_id
    whole = [t + (r["completion"] if fmt == "prompt_completion" else "") for t, r in zip(texts, rows)]
    return row, sum((tok.encode(w).ids + [eos] for w in whole), [])

  row, want = first_tokens(str(runs["model"] / "tokenizer.json"))
  assert row[:len(want)] == want and want[0] == BOS and want.count(BOS) == 2
  row, want = first_tokens(os.path.join(FIX, "tokenizer.json"))
  assert row[:len(want)] == want and BOS not in want


def test_generate_starts_a_plain_prompt_as_a_plain_text_row(runs, monkeypatch):
  """`meshlm generate RUN prompt=TEXT` samples after the post-processor's BOS and the text, the ids a plain-text row
  starts with; chat=true after the template's rendering alone (its own BOS, not a second one)."""
  from meshlm.commands import generate as G
  seen = []
  monkeypatch.setattr(G, "_completion", lambda cfg, params, ids, *a: seen.append(ids) or [])
  assert main(["generate", str(runs["run"]), "cpu_devices=1", "prompt=w1 w2"]) == 0
  tok = HFTokenizer(str(runs["run"] / "tokenizer.json"))
  assert seen[-1] == [BOS] + tok.encode("w1 w2").tolist()
  assert main(["generate", str(runs["run"]), "cpu_devices=1", "prompt=What is 3 + 3?", "chat=true"]) == 0
  assert seen[-1] == _chat_ids(runs["run"]) and seen[-1].count(BOS) == 1


def test_meshlm_eval_reads_a_run_dir(runs, capsys):
  """`meshlm eval model=RUN` on the conversations: the run's latest checkpoint, its tokenizer and template; every row
  once. A wrong path is refused in one line (exit 2)."""
  assert main(["eval", f"model={runs['run']}", *SMALL, f"eval.path={runs['tmp']}/chat.jsonl", "--json"]) == 0
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert got["val_rows"] == 8 and got["val_tokens"] > 0 and np.isfinite(got["val_loss"])
  assert got["params"] == str(runs["run"])
  assert main(["eval", f"model={runs['run']}", *SMALL, "eval.path=/nowhere/*.jsonl"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "eval.path=" in err[0] and "/nowhere/*.jsonl" in err[0]


def test_a_tokenizer_without_a_config_gets_one_naming_the_runs_eos(tmp_path):
  """A tokenizer.json alone (no tokenizer_config.json beside it): the run directory gets one naming the EOS the run
  ended its rows with (the EOS rule's <|endoftext|>; the BOS where the post-processor adds one), which model=RUN_DIR
  then reads back to the same ids; a tokenizer that has its own config keeps it, copied unchanged (the control)."""
  from meshlm.commands.train import carry_tokenizer
  for post_processor in (False, True):
    src = tmp_path / f"tok{int(post_processor)}"
    src.mkdir()
    if post_processor:
      llama3_tokenizer(src)
      os.remove(src / "tokenizer_config.json")
    else:
      shutil.copy(os.path.join(FIX, "tokenizer.json"), src)
    run = tmp_path / f"run{int(post_processor)}"
    carry_tokenizer(meshlm.load_config("model=llama2-tiny", f"data.tokenizer={src}/tokenizer.json", f"run_dir={run}"))
    config = json.loads((run / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config.get("bos_token") == (
        "<|begin_of_text|>" if post_processor else None)
    assert HFTokenizer(str(run / "tokenizer.json")).eos_id == HFTokenizer(str(src / "tokenizer.json")).eos_id
  run = tmp_path / "run-with-config"
  carry_tokenizer(meshlm.load_config("model=llama2-tiny", f"data.tokenizer={tmp_path}/tok1/tokenizer.json",
                                     f"run_dir={run}"))
  llama3_tokenizer(tmp_path / "tok1")
  carry_tokenizer(meshlm.load_config("model=llama2-tiny", f"data.tokenizer={tmp_path}/tok1/tokenizer.json",
                                     f"run_dir={run}"))
  assert json.loads((run / "tokenizer_config.json").read_text())["eos_token"] == "<|eot_id|>"


def test_a_tokenizer_without_a_config_renders_chats_from_the_run_as_it_trained(tmp_path):
  """A model directory with a tokenizer.json alone (its post-processor puts <|begin_of_text|> before a text) and Llama
  3.1's template, which writes {{- bos_token }}: the run trains its conversations without a BOS (no
  tokenizer_config.json names one; transformers renders them so), and its run directory and export render the same
  conversation to the ids it trained on. Their tokenizer_config.json names the EOS, and not the BOS the template reads.
  Controls: the BOS named (what they held before) renders a BOS first; a template that reads no special token (Qwen3's)
  leaves the BOS named."""
  from meshlm.commands.convert import tokenizer_files
  from meshlm.commands.train import carry_tokenizer
  model, run, export = tmp_path / "model", tmp_path / "run", tmp_path / "export"
  model.mkdir()
  llama3_tokenizer(model)
  os.remove(model / "tokenizer_config.json")
  shutil.copy(os.path.join(FIX, "llama3_1.jinja"), model / "chat_template.jinja")
  chat = USER + [{"role": "assistant", "content": "It is 6."}]
  (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
  cfg = meshlm.load_config("model=llama2-tiny", "model.vocab_size=384", "model.embed_dim=32", "model.num_heads=2",
                           "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=64", "model.num_layers=1",
                           "cpu_devices=1", f"data.tokenizer={model}/tokenizer.json",
                           f"data.path={tmp_path}/chat.jsonl", f"run_dir={run}")
  b = next(make_dataset(cfg, global_batch=1, seq_len=128, shuffle=False))
  row = np.concatenate([b["inputs"][0], b["targets"][0, -1:]]).tolist()  # the packed row the run trains on
  carry_tokenizer(cfg)
  hf.save(cfg, meshlm.init_params(cfg, jax.random.key(0)), export, files=tokenizer_files(run))

  def rendered(folder, special=None):
    template = load_chat_template(None, os.path.join(folder, "tokenizer.json"))
    if special is not None:
      template = ChatTemplate(template.source, "named", special)
    return HFTokenizer(os.path.join(folder, "tokenizer.json")).encode_offsets(template.render(chat)[0])[0].tolist()
  trained = rendered(model)
  assert trained[0] != BOS and row[:len(trained)] == trained and BOS not in row
  for d in (run, export):
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "bos_token" not in config
    assert rendered(d) == trained
  named = rendered(run, {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"})
  assert named == [BOS] + trained
  qwen = meshlm.load_config("model=llama2-tiny", f"data.tokenizer={model}/tokenizer.json",
                            f"data.chat_template={FIX}/qwen3.jinja", f"run_dir={tmp_path}/qwen")
  carry_tokenizer(qwen)
  assert json.loads((tmp_path / "qwen" / "tokenizer_config.json").read_text())["bos_token"] == "<|begin_of_text|>"
