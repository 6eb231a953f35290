"""TRL's four dataset formats, a row's tokens and which of them train.

  language_modeling                 {"text": "..."} (the field is data.field)
  prompt_completion                 {"prompt": "...", "completion": "..."}
  conversational                    {"messages": [{"role": "user", "content": "..."}, ...]}
  conversational_prompt_completion  {"prompt": [messages], "completion": [messages]}

data.format=auto infers the format from the first row of the first file (TRL reads the first example); every row must
then fit it, or is refused naming its file and line (row), never skipped.

The rules, TRL's SFTTrainer's (transcribed from trl 1.16's sft_trainer.py; docs/data.md "Coming from TRL"):
  - prompt_completion: [BOS] + ids(prompt + completion) + [EOS], the BOS where the tokenizer's post-processor puts one
    (TRL tokenizes these rows with the tokenizer's special tokens); the completion starts where ids(prompt) and
    ids(prompt + completion) first differ (TRL's common_prefix_length). data.completion_only (default on, as TRL's
    completion_only_loss) trains only the completion and the EOS.
  - conversational: the chat template's rendering, tokenized as one text without the tokenizer's own special tokens
    (the template writes them), and no EOS added (the template closes each turn). data.assistant_only trains only the
    assistant's tokens: every token that overlaps an assistant span (transformers' return_assistant_tokens_mask rule;
    chat.py says how the spans are found).
  - conversational_prompt_completion: the prompt rendered with the generation prompt, prompt + completion rendered
    whole; the completion mask as for prompt_completion, and with data.assistant_only the assistant mask too: a token
    trains when every mask that is on says so.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from meshlm.errors import ConfigError

FORMATS = ("language_modeling", "prompt_completion", "conversational", "conversational_prompt_completion")
# The fields each SFT format reads (language_modeling reads data.field).
FIELDS = {"prompt_completion": ("prompt", "completion"), "conversational": ("messages",),
          "conversational_prompt_completion": ("prompt", "completion")}
CONVERSATIONAL = ("conversational", "conversational_prompt_completion")


def infer_format(row: dict, field: str) -> str | None:
  """The format a row's fields say, or None when they fit none."""
  if field in row:  # a non-string there is refused by the language-modeling reader, naming data.field
    return "language_modeling"
  if isinstance(row.get("messages"), list):
    return "conversational"
  prompt, completion = row.get("prompt"), row.get("completion")
  if isinstance(prompt, str) and isinstance(completion, str):
    return "prompt_completion"
  if isinstance(prompt, list) and isinstance(completion, list):
    return "conversational_prompt_completion"
  return None


def describe_fields(row: dict) -> str:
  return ", ".join(f"{k} ({type(v).__name__})" for k, v in list(row.items())[:8]) or "none"


def _check_messages(messages: Any, name: str) -> str | None:
  if not isinstance(messages, list) or not messages:
    return f"{name} must be a non-empty list of messages"
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      return f"{name}[{i}] must be an object with a string role and a string content"
  return None


def row_problem(row: Any, fmt: str, field: str) -> str | None:
  """Why a row does not fit the format (None: it fits)."""
  if not isinstance(row, dict):
    return f"expected a JSON object, got {type(row).__name__}"
  if fmt == "language_modeling":
    if field not in row:
      return f"no field {field!r} (data.field); the line has keys: {', '.join(list(row)[:8]) or 'none'}"
    if not isinstance(row[field], str):
      return f"field {field!r} is {type(row[field]).__name__}, expected a string"
    return None
  missing = [k for k in FIELDS[fmt] if k not in row]
  if missing:
    return (f"no field {missing[0]!r}: a {fmt} row (data.format) has {' and '.join(FIELDS[fmt])}; "
            f"the row has: {describe_fields(row)}")
  if fmt == "prompt_completion":
    bad = next((k for k in FIELDS[fmt] if not isinstance(row[k], str)), None)
    return None if bad is None else f"field {bad!r} is {type(row[bad]).__name__}, expected a string ({fmt})"
  return next((p for k in FIELDS[fmt] if (p := _check_messages(row[k], k)) is not None), None)


def common_prefix_length(a, b) -> int:
  """TRL's common_prefix_length: how many leading ids a and b share."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
  return int(diff[0]) if len(diff) else n


def spans_mask(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
  """1 for each token (character offsets [start, end)) that overlaps one of the spans (transformers' rule)."""
  mask = np.zeros(len(starts), np.int32)
  for a, b in spans:
    mask |= ((ends > a) & (starts < b)).astype(np.int32)
  return mask


def encode_row(row: dict, fmt: str, tok, template, completion_only: bool, assistant_only: bool
               ) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, 1 where the token is trained as a target) of one SFT row, by the module docstring's rules."""
  if fmt == "prompt_completion":
    prompt_ids = np.concatenate([tok.bos_ids, tok.encode(row["prompt"])])
    ids = np.concatenate([tok.bos_ids, tok.encode(row["prompt"] + row["completion"]), [tok.eos_id]]).astype(np.int32)
    mask = np.ones(len(ids), np.int32)
    if completion_only:
      mask[:common_prefix_length(prompt_ids, ids)] = 0
    return ids, mask
  if fmt == "conversational":
    messages = row["messages"]
    text, spans = template.assistant_spans(messages) if assistant_only else (template.render(messages)[0], [])
    ids, starts, ends = tok.encode_offsets(text)
    mask = spans_mask(starts, ends, spans) if assistant_only else np.ones(len(ids), np.int32)
    return ids, mask
  prompt, whole = row["prompt"], row["prompt"] + row["completion"]
  prompt_ids = tok.encode_offsets(template.render(prompt, add_generation_prompt=True)[0])[0]
  text, spans = template.assistant_spans(whole) if assistant_only else (template.render(whole)[0], [])
  ids, starts, ends = tok.encode_offsets(text)
  mask = spans_mask(starts, ends, spans) if assistant_only else np.ones(len(ids), np.int32)
  if completion_only:
    mask[:common_prefix_length(prompt_ids, ids)] = 0
  return ids, mask


def no_template_error(fmt: str, tokenizer: str) -> ConfigError:
  where = ("data.tokenizer=byte has no directory to read one from" if tokenizer == "byte" else
           f"data.tokenizer={tokenizer} has neither a chat_template.jinja beside it nor a chat_template in its "
           "tokenizer_config.json")
  return ConfigError(f"data.format={fmt} needs a chat template and {where}; give one with "
                     "data.chat_template=FILE (a Jinja template, e.g. the model's chat_template.jinja)")
