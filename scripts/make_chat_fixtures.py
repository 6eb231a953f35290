"""Regenerates tests/fixtures/chat_templates/{tokenizer.json,reference.json}: transformers' own renderings of real chat
templates, the token ids and assistant masks of its apply_chat_template, and TRL's completion masks.

transformers is not a meshlm dependency (meshlm renders templates with Jinja2 itself, train/data/chat.py); install it
in a separate venv (no torch needed for apply_chat_template):

  python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install transformers==5.25.0 jinja2==3.1.6 tokenizers
  /tmp/tfvenv/bin/python scripts/make_chat_fixtures.py

The templates (*.jinja beside the fixtures) are copied from trl 1.16.0's trl/chat_templates/ (SOURCES.md): the
originals as the models ship them (Qwen3, Llama 3.1, Gemma 3) and TRL's training variants, which add
{% generation %} markers for assistant_only_loss.

tokenizer.json: a byte-level BPE trained here on the conversations, with every special token the templates write, so
that special tokens, merges across a turn boundary and multi-byte characters all occur.

reference.json, per template and conversation: `text` (apply_chat_template(tokenize=False)), `input_ids`
(tokenize=True), `assistant_masks` (return_assistant_tokens_mask=True, templates with generation markers only), and
for the conversations with a prompt/completion split, TRL's `completion_mask` (sft_trainer.py's tokenize_fn:
[0] * common_prefix_length(ids(prompt, generation prompt), ids(prompt + completion)) + [1] * the rest).
"""
from __future__ import annotations

import json
import os
import re

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "chat_templates")

TEMPLATES = {  # file -> the special tokens its model's tokenizer_config.json gives
    "qwen3.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3_training.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3_1.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama3_training.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "gemma3.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "gemma3_training.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>", "<pad>", "<start_of_turn>",
           "<end_of_turn>"]

CONVERSATIONS = {
    "single_turn": {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                 {"role": "assistant", "content": "2 + 3 = 5."}]},
    "system_multi_turn": {"messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a prime above 10."},
        {"role": "assistant", "content": "11 is prime."},
        {"role": "user", "content": "And one above 20, with an é?"},
        {"role": "assistant", "content": "23, café."}]},
    "generation_prompt": {"messages": [{"role": "system", "content": "Be kind."},
                                       {"role": "user", "content": "Hello there!"}],
                          "add_generation_prompt": True},
    "thinking": {"messages": [{"role": "user", "content": "Is 91 prime?"},
                              {"role": "assistant", "content": "<think>\n91 = 7 * 13.\n</think>\n\nNo: 7 x 13."}]},
    "prompt_completion": {"prompt": [{"role": "system", "content": "Count."},
                                     {"role": "user", "content": "one, two,"}],
                          "completion": [{"role": "assistant", "content": "three, four."}]},
}


def train_tokenizer(path: str):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  corpus = [m["content"] for c in CONVERSATIONS.values() for k in ("messages", "prompt", "completion")
            for m in c.get(k, [])] * 20 + ["system user assistant model\n\n"] * 20
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus, trainer)
  tok.save(path)


def common_prefix_length(a, b) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def record(name: str, special: dict, tok_file: str) -> dict:
  from transformers import PreTrainedTokenizerFast
  with open(os.path.join(HERE, name)) as f:
    template = f.read()
  tok = PreTrainedTokenizerFast(tokenizer_file=tok_file, **special)
  tracks = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None  # transformers' own test
  out = {}
  for cname, conv in CONVERSATIONS.items():
    if "messages" in conv:
      messages, gen = conv["messages"], conv.get("add_generation_prompt", False)
    else:
      messages, gen = conv["prompt"] + conv["completion"], False
    kw = dict(chat_template=template, add_generation_prompt=gen)
    try:
      text = tok.apply_chat_template(messages, tokenize=False, **kw)
    except Exception as e:  # the template's raise_exception: recorded, and the tests expect the same refusal
      out[cname] = {"error": str(e)}
      continue
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=tracks, **kw)
    rec = {"text": text, "input_ids": list(enc["input_ids"])}
    if tracks:
      rec["assistant_masks"] = list(enc["assistant_masks"])
    if "prompt" in conv:
      prompt_ids = tok.apply_chat_template(conv["prompt"], tokenize=True, return_dict=True, chat_template=template,
                                           add_generation_prompt=True)["input_ids"]
      n = common_prefix_length(prompt_ids, rec["input_ids"])
      rec["completion_mask"] = [0] * n + [1] * (len(rec["input_ids"]) - n)
    out[cname] = rec
  return out


def main():
  import transformers
  tok_file = os.path.join(HERE, "tokenizer.json")
  train_tokenizer(tok_file)
  ref = {"transformers": transformers.__version__, "conversations": CONVERSATIONS, "special_tokens": TEMPLATES,
         "renderings": {name: record(name, special, tok_file) for name, special in TEMPLATES.items()}}
  with open(os.path.join(HERE, "reference.json"), "w") as f:
    json.dump(ref, f, indent=1, ensure_ascii=False)
    f.write("\n")
  print(f"wrote {HERE}/tokenizer.json and reference.json ({len(TEMPLATES)} templates x {len(CONVERSATIONS)} "
        f"conversations, transformers {transformers.__version__})")


if __name__ == "__main__":
  main()
