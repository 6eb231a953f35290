"""Chat templates and the SFT formats' masks against transformers' own apply_chat_template and TRL's rules
(tests/fixtures/chat_templates: real Qwen3, Llama 3.1 and Gemma 3 templates and TRL's generation-marked variants,
recorded by scripts/make_chat_fixtures.py). No model, no JAX: rendering, token ids, masks and refusals."""
import json
import os
import re

import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.train.data import make_dataset
from meshlm.train.data.chat import ChatTemplate, TemplateError, load_chat_template
from meshlm.train.data.formats import encode_row, infer_format, spans_mask
from meshlm.train.data.tokenizers import HFTokenizer
from deadline import deadline

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
with open(os.path.join(HERE, "reference.json")) as f:
  REF = json.load(f)
TOK = HFTokenizer(os.path.join(HERE, "tokenizer.json"))
CASES = [(t, c) for t, recs in REF["renderings"].items() for c in recs]


def _template(name: str, strip_generation: bool = False) -> ChatTemplate:
  with open(os.path.join(HERE, name)) as f:
    source = f.read()
  if strip_generation:
    source = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", source)
  return ChatTemplate(source, name, REF["special_tokens"][name])


def _messages(conv: dict) -> tuple[list[dict], bool]:
  if "messages" in conv:
    return conv["messages"], conv.get("add_generation_prompt", False)
  return conv["prompt"] + conv["completion"], False


@pytest.mark.parametrize("name, conv", CASES)
def test_rendering_and_ids_equal_transformers(name, conv):
  """Our Jinja2 rendering and token ids equal transformers' apply_chat_template, for each template and conversation
  (multi-turn, system prompt, generation prompt, thinking)."""
  ref = REF["renderings"][name][conv]
  messages, gen = _messages(REF["conversations"][conv])
  if "error" in ref:
    with pytest.raises(TemplateError, match="refused the conversation"):
      _template(name).render(messages, add_generation_prompt=gen)
    return
  text, _ = _template(name).render(messages, add_generation_prompt=gen)
  assert text == ref["text"]
  assert TOK.encode_offsets(text)[0].tolist() == ref["input_ids"]


@pytest.mark.parametrize("name", ["llama3_1.jinja", "gemma3.jinja"])
def test_rendering_negative_control_without_the_special_tokens(name):
  """Rendered without the tokenizer's special tokens (the variables transformers passes), the text differs."""
  ref = REF["renderings"][name]["system_multi_turn"]
  messages, _ = _messages(REF["conversations"]["system_multi_turn"])
  with open(os.path.join(HERE, name)) as f:
    bare = ChatTemplate(f.read(), name, {})
  assert bare.render(messages)[0] != ref["text"]


def test_a_template_that_rewrites_earlier_turns_is_refused_by_the_prefix_rule():
  """Qwen3's own template renders an assistant turn with a <think> block while it is the last and without one once a
  user turn follows: the prefix rule cannot place it, and says to use generation markers."""
  messages, _ = _messages(REF["conversations"]["system_multi_turn"])
  with pytest.raises(TemplateError, match=r"renders assistant turn 2 differently .* \{% generation %\} markers"):
    _template("qwen3.jinja").assistant_spans(messages)
  assert len(_template("qwen3.jinja").assistant_spans(messages[:3])[1]) == 1  # one turn: nothing to rewrite


@pytest.mark.parametrize("name, conv", [(t, c) for t, c in CASES if "assistant_masks" in REF["renderings"][t][c]])
def test_assistant_masks_equal_transformers(name, conv):
  """The generation-marker rule gives transformers' return_assistant_tokens_mask (what TRL's assistant_only_loss
  trains on), token for token; the prefix rule on the same template without its markers gives the same mask where the
  template renders turns prefix-wise (Llama 3, Gemma 3; Qwen3 rewrites earlier turns and is refused)."""
  ref = REF["renderings"][name][conv]
  messages, gen = _messages(REF["conversations"][conv])
  if gen:
    return  # a generation prompt ends in no assistant turn: TRL trains on conversations, not prompts
  text, spans = _template(name).assistant_spans(messages)
  ids, starts, ends = TOK.encode_offsets(text)
  assert spans_mask(starts, ends, spans).tolist() == ref["assistant_masks"]
  stripped = _template(name, strip_generation=True)
  assert stripped.mask_rule == "prefix"
  if name.startswith("qwen3"):
    return  # its generation block starts after the <think> block, which the prefix rule counts as the turn's
  text2, spans2 = stripped.assistant_spans(messages)
  assert text2 == text
  assert spans_mask(starts, ends, spans2).tolist() == ref["assistant_masks"]


def test_assistant_masks_negative_control_a_shifted_span_differs():
  ref = REF["renderings"]["llama3_training.jinja"]["single_turn"]
  text, spans = _template("llama3_training.jinja").assistant_spans(REF["conversations"]["single_turn"]["messages"])
  _, starts, ends = TOK.encode_offsets(text)
  assert spans_mask(starts, ends, [(a - 1, b) for a, b in spans]).tolist() != ref["assistant_masks"]


@pytest.mark.parametrize("name", [t for t in REF["renderings"] if "completion_mask" in REF["renderings"][t].get(
    "prompt_completion", {})])
def test_conversational_prompt_completion_masks_equal_trl(name):
  """encode_row's conversational prompt-completion ids and masks: TRL's completion mask (common prefix of the prompt
  with its generation prompt and the whole), and with assistant_only also the assistant mask (a token trains when
  both say so, TRL's build_labels)."""
  ref = REF["renderings"][name]["prompt_completion"]
  row = {k: REF["conversations"]["prompt_completion"][k] for k in ("prompt", "completion")}
  t = _template(name)
  ids, mask = encode_row(row, "conversational_prompt_completion", TOK, t, True, False)
  assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["completion_mask"]
  if "assistant_masks" in ref:
    _, both = encode_row(row, "conversational_prompt_completion", TOK, t, True, True)
    assert both.tolist() == (np.array(ref["completion_mask"]) & np.array(ref["assistant_masks"])).tolist()
  _, off = encode_row(row, "conversational_prompt_completion", TOK, t, False, False)
  assert off.all()  # negative control: completion_only=false trains every token


def test_prompt_completion_mask_is_trls_rule():
  """Text prompt-completion: ids(prompt + completion) + EOS; the completion starts where ids(prompt) stops being a
  prefix, here inside a merged token (TRL's common_prefix_length), and the EOS trains."""
  row = {"prompt": "one, tw", "completion": "o, three"}
  ids, mask = encode_row(row, "prompt_completion", TOK, None, True, False)
  whole, prompt = TOK.encode(row["prompt"] + row["completion"]).tolist(), TOK.encode(row["prompt"]).tolist()
  n = next(i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b)
  assert n < len(prompt)  # the boundary merges: a naive len(prompt) split would be wrong
  assert ids.tolist() == whole + [TOK.eos_id] and mask.tolist() == [0] * n + [1] * (len(whole) + 1 - n)
  assert encode_row(row, "prompt_completion", TOK, None, False, False)[1].all()


@pytest.mark.parametrize("row, fmt", [({"text": "a"}, "language_modeling"), ({"prompt": "a", "completion": "b"},
                                      "prompt_completion"), ({"messages": []}, "conversational"),
                                      ({"prompt": [], "completion": []}, "conversational_prompt_completion"),
                                      ({"question": "a"}, None)])
def test_format_from_the_fields(row, fmt):
  assert infer_format(row, "text") == fmt


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _cfg(*overrides):
  return load_config("model=llama2-tiny", "model.vocab_size=512", f"data.tokenizer={HERE}/tokenizer.json",
                     "train.seq_len=32", *overrides)


def test_rows_are_refused_in_one_line_naming_file_and_line(tmp_path):
  conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
  bad = _jsonl(tmp_path / "bad.jsonl", [conv, {"prompt": "a", "completion": "b"}])
  it = make_dataset(_cfg(f"data.path={bad}", f"data.chat_template={HERE}/llama3_training.jinja"), global_batch=1,
                    seq_len=32)
  with pytest.raises(ConfigError, match=r"bad.jsonl:2: no field 'messages': a conversational row"):
    next(it)
  none = _jsonl(tmp_path / "none.jsonl", [{"question": "a"}])
  with pytest.raises(ConfigError, match=r"none.jsonl:1: no field 'text' \(data.field\); the line has keys: question; "
                     r"nor messages, or prompt and completion"):
    make_dataset(_cfg(f"data.path={none}"), global_batch=1, seq_len=32)
  msgs = _jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user"}]}])
  with pytest.raises(ConfigError, match=r"m.jsonl:1: messages\[0\] must be an object with a string role and a string "
                     "content"):
    make_dataset(_cfg(f"data.path={msgs}", f"data.chat_template={HERE}/gemma3.jinja"), global_batch=1, seq_len=32)


def test_conversational_data_without_a_template_names_the_key(tmp_path):
  conv = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
  with pytest.raises(ConfigError, match=r"data.format=conversational needs a chat template .* give one with "
                     r"data.chat_template=FILE"):
    make_dataset(_cfg(f"data.path={conv}"), global_batch=1, seq_len=32)


def test_template_from_the_tokenizer_directory(tmp_path):
  """chat_template.jinja beside the tokenizer wins over tokenizer_config.json's chat_template, whose special tokens
  the template sees."""
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "cfg {{ bos_token }}",
                                                              "bos_token": {"content": "<bos>"}}))
  t = load_chat_template(None, str(tmp_path / "tokenizer.json"))
  assert t.render([])[0] == "cfg <bos>"
  (tmp_path / "chat_template.jinja").write_text("file {{ bos_token }}")
  assert load_chat_template(None, str(tmp_path / "tokenizer.json")).render([])[0] == "file <bos>"
  assert load_chat_template(None, str(tmp_path / "none" / "tokenizer.json")) is None


def test_truncation_cuts_or_drops_and_counts(tmp_path):
  from meshlm.train.data import TRUNCATION_STATS
  long = {"prompt": "one, two, " * 20, "completion": "three"}
  short = {"prompt": "one", "completion": ", two"}
  path = _jsonl(tmp_path / "pc.jsonl", [long, short])
  before = (TRUNCATION_STATS.cut, TRUNCATION_STATS.dropped)
  cut = next(make_dataset(_cfg(f"data.path={path}", "data.seed=1"), global_batch=2, seq_len=32))
  assert TRUNCATION_STATS.cut > before[0]
  assert (cut["segment_ids"] != 0).sum(axis=1).max() == 32  # a cut row fills a whole packed row
  dropped = next(make_dataset(_cfg(f"data.path={path}", "data.truncation=drop"), global_batch=2, seq_len=32))
  assert TRUNCATION_STATS.dropped > before[1]
  short_len = len(TOK.encode("one, two")) + 1  # + EOS
  seg = dropped["segment_ids"]
  lengths = [int((row == s).sum()) for row in seg for s in np.unique(row[row != 0])[:-1]]  # whole segments
  assert lengths and set(lengths) == {short_len}  # only the short row is left


def test_parquet_rows_read_as_the_jsonl_rows(tmp_path):
  """A conversational Parquet file (messages as a list of structs) gives the batches of the same rows in JSONL."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
          for i in range(9)]
  pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "c.parquet"), row_group_size=4)
  jsonl = _jsonl(tmp_path / "c.jsonl", rows)
  over = (f"data.chat_template={HERE}/gemma3_training.jinja", "data.assistant_only=true")
  a = make_dataset(_cfg(f"data.path={tmp_path}/c.parquet", *over), global_batch=2, seq_len=32, shuffle=False)
  b = make_dataset(_cfg(f"data.path={jsonl}", *over), global_batch=2, seq_len=32, shuffle=False)
  for _ in range(3):
    x, y = next(a), next(b)
    assert all(np.array_equal(x[k], y[k]) for k in x)
    assert 0 < x["loss_mask"].sum() < (x["segment_ids"] != 0).sum()
  pq.write_table(pa.Table.from_pylist([{"prompt": "a"}]), str(tmp_path / "p.parquet"))
  with pytest.raises(ConfigError, match=r"p.parquet has no column 'completion' \(data.format=prompt_completion\)"):
    make_dataset(_cfg(f"data.path={tmp_path}/p.parquet", "data.format=prompt_completion"), global_batch=1, seq_len=32)


def test_a_format_for_plain_text_files_and_a_bad_eval_path_are_refused(tmp_path):
  from meshlm.train.validation import eval_config
  (tmp_path / "a.txt").write_text("hello")
  with pytest.raises(ConfigError, match=r"data.format=conversational: data.source=text holds plain text"):
    make_dataset(_cfg(f"data.path={tmp_path}/a.txt", "data.format=conversational"), global_batch=1, seq_len=32)
  with pytest.raises(ConfigError, match=r"eval.path=val.csv: name .jsonl, .parquet, .txt or .md files"):
    eval_config(_cfg("eval.path=val.csv"))
  from meshlm.train.validation import eval_dataset
  with pytest.raises(ConfigError, match=r"^eval.path='/nowhere/\*.jsonl' matches no files"):  # the key, not data.path
    eval_dataset(_cfg("eval.path=/nowhere/*.jsonl"), global_batch=1, seq_len=32)


def test_rl_prompts_as_conversations_are_rendered_with_the_generation_prompt(tmp_path):
  """meshlm rl's prompts in TRL's conversational form: the ids are the template's rendering with the generation
  prompt, the rewards' prompt is that text, the messages ride along and the row keeps its other columns; a plain prompt
  stays its own text (negative control), and a conversation without a template names data.chat_template. A file holds
  one form: a string among message lists (or the reverse, or an rl.eval_prompts file of the other form) is refused,
  naming both lines."""
  from meshlm.rl.rollout import eval_prompts, load_prompts
  user = [{"role": "user", "content": "What is 2 + 3?"}]
  path = _jsonl(tmp_path / "p.jsonl", [{"prompt": user, "answer": "5"}])
  plain_path = _jsonl(tmp_path / "plain.jsonl", [{"prompt": "2 + 3 =", "answer": "5"}])
  t = "llama3_training.jinja"
  cfg = _cfg(f"rl.prompts={path}", f"data.chat_template={HERE}/{t}")
  (chat,) = load_prompts(cfg, TOK)
  (plain,) = load_prompts(_cfg(f"rl.prompts={plain_path}"), TOK)
  text = ChatTemplate(open(os.path.join(HERE, t)).read(), t).render(user, add_generation_prompt=True)[0]
  assert chat.text == text and chat.ids == TOK.encode_offsets(text)[0].tolist() and chat.row["answer"] == "5"
  assert chat.messages == user and plain.messages is None
  assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert plain.text == "2 + 3 =" and plain.ids == TOK.encode("2 + 3 =").tolist()
  with pytest.raises(ConfigError, match=r"data.format=conversational needs a chat template .* data.chat_template"):
    load_prompts(_cfg(f"rl.prompts={path}"), TOK)
  bad = _jsonl(tmp_path / "b.jsonl", [{"prompt": [{"role": "user"}]}])
  with pytest.raises(ConfigError, match=r"b.jsonl: line 1: prompt\[0\] must be an object with a string role"):
    load_prompts(_cfg(f"rl.prompts={bad}", f"data.chat_template={HERE}/{t}"), TOK)
  for rows, msg in (([{"prompt": user}, {"prompt": "2 + 3 ="}], "line 2's prompt is a string but line 1's is a list "
                                                                  "of messages"),
                    ([{"prompt": "2 + 3 ="}, {"prompt": user}], "line 2's prompt is a list of messages but line 1's "
                                                                  "is a string")):
    mixed = _jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(ConfigError, match=rf"m.jsonl: {msg}; give every prompt of a file in one form"):
      load_prompts(_cfg(f"rl.prompts={mixed}", f"data.chat_template={HERE}/{t}"), TOK)
  with pytest.raises(ConfigError, match=r"rl.eval_prompts=.*plain.jsonl: its prompts are strings but rl.prompts' are "
                                        r"lists of messages"):
    eval_prompts(_cfg(f"rl.eval_prompts={plain_path}", f"data.chat_template={HERE}/{t}"), TOK, [chat])
  assert eval_prompts(_cfg(f"rl.eval_prompts={path}", f"data.chat_template={HERE}/{t}"), TOK, [chat])[0].text == text


def test_packed_sft_stream_resumes_exactly_from_its_state(tmp_path):
  """The first-fit packer's iterator state (through a JSON round trip, as checkpoints store it) resumes the stream at
  the same batch, masks included, across an epoch boundary."""
  rows = [{"prompt": f"p{i} " * (1 + i % 5), "completion": f"c{i}"} for i in range(7)]
  cfg = _cfg(f"data.path={_jsonl(tmp_path / 'pc.jsonl', rows)}")
  it = make_dataset(cfg, global_batch=2, seq_len=32)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(4)]
  again = make_dataset(cfg, global_batch=2, seq_len=32)
  again.set_state(state)
  for w in want:
    got = next(again)
    assert all(np.array_equal(w[k], got[k]) for k in w)
  fresh = next(make_dataset(cfg, global_batch=2, seq_len=32))  # negative control: no state, another batch
  assert not all(np.array_equal(want[0][k], fresh[k]) for k in fresh)


# One row per SFT format and the text its trained targets decode to (special tokens written out). The prompt-completion
# forms run with no data.* flag: their defaults (completion_only on) are what is checked.
TRAINED = [
    ("prompt_completion", {"prompt": "What is 2 + 2?", "completion": " It is 4."}, (),
     " It is 4.<|endoftext|>"),  # the completion and the EOS (this tokenizer's: no tokenizer_config.json beside it)
    # The generation prompt alone ends in one merged "\n\n" token, the whole rendering in two "\n": TRL's common prefix
    # stops there, so the completion's tokens start with them.
    ("conversational_prompt_completion", {"prompt": [{"role": "user", "content": "What is 3 + 3?"}],
                                          "completion": [{"role": "assistant", "content": "It is 6."}]}, (),
     "\n\nIt is 6.<|eot_id|>"),
    ("conversational", {"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                     {"role": "assistant", "content": "It is 2."}]}, ("data.assistant_only=true",),
     "It is 2.<|eot_id|>"),  # the generation block: the reply and its end of turn
]


@pytest.mark.parametrize("fmt, row, flags, want", TRAINED, ids=[t[0] for t in TRAINED])
def test_the_trained_targets_of_one_row_per_format_decode_to_the_expected_text(tmp_path, fmt, row, flags, want):
  """What trains, read off the batch make_dataset gives (targets where loss_mask is on, in the row's first segment),
  against the literal text: catches a loss mask aligned to the inputs instead of the targets (it trains "t is 4." and
  the next row's first token) and data.completion_only defaulting to false (the prompt would train too). Control: the
  whole segment's targets decode to more than the trained part."""
  path = _jsonl(tmp_path / f"{fmt}.jsonl", [row])
  b = next(make_dataset(_cfg(f"data.path={path}", f"data.chat_template={HERE}/llama3_training.jinja", *flags),
                        global_batch=1, seq_len=64))
  assert infer_format(row, "text") == fmt
  seg = b["segment_ids"][0]
  segment = (seg == 1) & (np.append(seg[1:], 0) == 1)  # the targets of the first row that are its own tokens
  decode = lambda ids: TOK._tok.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
  assert decode(b["targets"][0][segment & (b["loss_mask"][0] > 0)]) == want
  assert decode(b["targets"][0][segment]).endswith(want) and decode(b["targets"][0][segment]) != want


def test_a_pass_that_leaves_nothing_to_train_is_refused_naming_the_file(tmp_path):
  """data.truncation=drop with every row too long, and data.assistant_only=true with every assistant turn cut away:
  the stream refuses once a whole pass yielded nothing to train, naming the file, instead of waiting forever for a
  row (drop) or training at loss 0; a batch with no trained token warns first (EmptyBatchWarning). Control: one
  row that fits keeps the stream going."""
  from meshlm.train.data import EmptyBatchWarning
  long = {"prompt": "one, two, " * 20, "completion": "three"}
  path = _jsonl(tmp_path / "long.jsonl", [long] * 3)
  with deadline(60), pytest.raises(ConfigError, match=r"^data.path=.*long.jsonl: data.truncation=drop dropped every "
                                                        r"one of its 3 rows, each longer than train.seq_len \+ 1 = 33"):
    next(make_dataset(_cfg(f"data.path={path}", "data.truncation=drop"), global_batch=1, seq_len=32))
  conv = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "yes"}]}
  cut = _jsonl(tmp_path / "cut.jsonl", [conv] * 3)
  it = make_dataset(_cfg(f"data.path={cut}", f"data.chat_template={HERE}/llama3_training.jinja",
                         "data.assistant_only=true"), global_batch=1, seq_len=32)
  with deadline(60), pytest.warns(EmptyBatchWarning, match=r"cut.jsonl: a batch of 1 rows has no trained token"):
    with pytest.raises(ConfigError, match=r"^data.path=.*cut.jsonl: none of its 3 rows has a trained token within its "
                                          r"first train.seq_len \+ 1 = 33 tokens"):
      for _ in range(10):
        next(it)
  fits = _jsonl(tmp_path / "fits.jsonl", [long, long, {"prompt": "one", "completion": ", two"}])
  it = make_dataset(_cfg(f"data.path={fits}", "data.truncation=drop"), global_batch=1, seq_len=32)
  with deadline(60):
    assert all(next(it)["loss_mask"].sum() > 0 for _ in range(4))


def test_messages_name_the_row_and_where_the_format_came_from(tmp_path, caplog, monkeypatch):
  """A cut row's warning names its file:line; a row of another format names the line that set the format (auto);
  JSON errors read as one phrase ("starting at: column 5", not "at at")."""
  conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
  rows = [conv] * 15 + [{"prompt": "a", "completion": "b"}]
  path = _jsonl(tmp_path / "mixed.jsonl", rows)
  it = make_dataset(_cfg(f"data.path={path}", f"data.chat_template={HERE}/llama3_training.jinja"), global_batch=1,
                    seq_len=32, shuffle=False)
  with pytest.raises(ConfigError, match=r"mixed.jsonl:16: no field 'messages'.*; data.format=auto took conversational "
                                        r"from .*mixed.jsonl:1 \(data.format=NAME sets one\)"):
    for _ in range(20):
      next(it)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(conv) + '\n{"messages": "unterminated\n')
  it = make_dataset(_cfg(f"data.path={bad}", f"data.chat_template={HERE}/llama3_training.jinja"), global_batch=1,
                    seq_len=32, shuffle=False)
  with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON \(Unterminated string starting at: column 14\)"):
    for _ in range(5):
      next(it)
  long = _jsonl(tmp_path / "long.jsonl", [{"prompt": "x", "completion": "one, two, " * 20}])
  from meshlm.train.data import TRUNCATION_STATS
  for what in ("cut", "dropped"):  # the counts are the process's: start from 0, where every row warns
    monkeypatch.setattr(TRUNCATION_STATS, what, 0)
  with caplog.at_level("WARNING", logger="meshlm.data"):
    next(make_dataset(_cfg(f"data.path={long}"), global_batch=1, seq_len=32))
  assert any(re.search(r"long.jsonl:1: longer than train.seq_len \+ 1 tokens, cut", r.getMessage()) for r in caplog.records)


def _chatml(eos_inside: bool) -> str:
  end = "<|im_end|>\n"
  reply = ("{% generation %}{{ m.content }}" + end + "{% endgeneration %}" if eos_inside else
           "{% generation %}{{ m.content }}{% endgeneration %}" + end)
  return ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}" + reply +
          "{% else %}{{ m.content }}" + end + "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("eos_inside, assistant_only, warns", [(False, True, True), (True, True, False),
                                                               (False, False, False)])
def test_assistant_only_warns_when_the_eos_never_trains(tmp_path, eos_inside, assistant_only, warns):
  """A ChatML template that closes the reply's {% generation %} block before <|im_end|> (the tokenizer's EOS here)
  would train a model that never stops: make_dataset warns, naming the EOS and the fix. Controls: the EOS inside the
  block, and data.assistant_only=false (every token trains), do not warn."""
  import shutil
  import warnings
  from meshlm.train.data import EndOfTurnWarning
  shutil.copy(os.path.join(HERE, "tokenizer.json"), tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  (tmp_path / "chat_template.jinja").write_text(_chatml(eos_inside))
  conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
  path = _jsonl(tmp_path / "c.jsonl", [conv])
  cfg = load_config("model=llama2-tiny", "model.vocab_size=512", f"data.tokenizer={tmp_path}", f"data.path={path}",
                    f"data.assistant_only={str(assistant_only).lower()}")
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    b = next(make_dataset(cfg, global_batch=1, seq_len=32))
  ours = [str(w.message) for w in seen if issubclass(w.category, EndOfTurnWarning)]
  assert len(ours) == warns
  if warns:
    assert re.search(r"renders the tokenizer's EOS <\|im_end\|> outside the assistant's tokens.*put the EOS inside "
                     r"\{% generation %\}", ours[0])
  trained = b["targets"][0][b["loss_mask"][0] > 0]
  assert (HFTokenizer(str(tmp_path / "tokenizer.json")).eos_id in trained) == (not warns)  # what the warning means
