"""`meshlm generate PATH prompt=...`: sample from a run, meshlm model or Hugging Face directory."""
from __future__ import annotations

import sys

from meshlm.commands.resolve import load_config
from meshlm.errors import ConfigError

USAGE = ("meshlm generate PATH prompt=TEXT|prompt_ids=ID,ID|messages=FILE [chat=true] [max_new_tokens=64] "
         "[temperature=0] [top_k=N] [top_p=1] [seed=0] [stop=ID,ID] [key=value ...]")
OPTIONS = """  PATH              a run directory, a meshlm model directory or a Hugging Face model directory
  prompt=TEXT       the text to continue, tokenized with PATH's tokenizer.json (else data.tokenizer), after the
                    BOS its post-processor puts before a text (Llama 3's), as plain-text training rows
  prompt_ids=ID,ID  or the prompt as token ids: no tokenizer is needed, and the new token ids are printed
  chat=true         prompt=TEXT is a user message, rendered with PATH's chat template and its generation prompt
                    (chat_template.jinja or tokenizer_config.json beside the tokenizer, else data.chat_template);
                    the assistant's reply is printed
  messages=FILE     or the conversation so far: a JSON list of {role, content} messages (or an object with
                    "messages"), rendered the same way
  max_new_tokens=N  tokens to sample after the prompt (default 64)
  temperature=T     0 is greedy (default 0)
  top_k=N, top_p=P  restrict the draw to the N likeliest tokens / the smallest set holding mass P
  seed=N            the sampling seed (default 0)
  stop=ID,ID        token ids that end the completion (kept as its last token); default: the model's
                    eos_token_id
  other key=value pairs are config overrides: cpu_devices, mesh.*, shard_mode, data.tokenizer"""
SAMPLING_KEYS = {"prompt": str, "prompt_ids": str, "max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float,
                 "seed": int, "stop": str, "chat": str, "messages": str}


def _completion(cfg, params, ids: list[int], opts: dict, stop: list[int] | None, mesh) -> list[int]:
  """The one prompt's new tokens. The one place that knows generate's return type and its stop default."""
  from meshlm.models.generate import generate
  out = generate(cfg, params, [ids], max_new_tokens=opts["max_new_tokens"], temperature=opts["temperature"],
                 top_k=opts["top_k"], top_p=opts["top_p"], stop_tokens=stop, seed=opts["seed"], mesh=mesh)
  return out.token_lists()[0]


def _ids(key: str, text: str) -> list[int]:
  try:
    return [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise ConfigError(f"{key}={text!r}: expected token ids separated by commas (e.g. {key}=1,2,3)") from None


def _chat_ids(cfg, tok, opts: dict) -> list[int]:
  """The prompt as the chat template renders it with the generation prompt: prompt=TEXT as one user message, or the
  messages of messages=FILE. The same template and rules as training on conversations (train/data/chat.py)."""
  import json
  from meshlm.train.data import chat_template
  from meshlm.train.data.formats import row_problem
  if "messages" in opts:
    try:
      with open(opts["messages"], encoding="utf-8") as f:
        messages = json.load(f)
    except (OSError, ValueError) as e:
      raise ConfigError(f"messages={opts['messages']}: cannot read a JSON list of messages ({e})") from None
    messages = messages.get("messages") if isinstance(messages, dict) else messages
    problem = row_problem({"messages": messages}, "conversational", "text")
    if problem is not None:
      raise ConfigError(f"messages={opts['messages']}: {problem}")
  else:
    messages = [{"role": "user", "content": opts["prompt"]}]
  from meshlm.train.data.chat import TemplateError
  try:
    text, _ = chat_template(cfg, "conversational").render(messages, add_generation_prompt=True)
  except TemplateError as e:
    raise ConfigError(str(e)) from None
  return [int(t) for t in tok.encode_offsets(text)[0]]


def _chat_flag(opts: dict) -> bool:
  value = opts.pop("chat", "false").lower()
  if value not in ("true", "false"):
    raise ConfigError(f"chat={value!r}: expected true or false")
  return value == "true" or "messages" in opts


def main(args: list[str]) -> int:
  """PATH is a run directory, a meshlm model directory or a Hugging Face model directory; other key=value
  pairs are config overrides (cpu_devices, mesh.*, shard_mode)."""
  if not args or "=" in args[0]:
    raise ConfigError(f"generate: expected a model directory first; usage: {USAGE}")
  path, rest = args[0], args[1:]
  opts: dict = {"max_new_tokens": 64, "temperature": 0.0, "top_k": None, "top_p": 1.0, "seed": 0, "stop": ""}
  overrides = []
  for item in rest:
    key, _, value = item.partition("=")
    if key in SAMPLING_KEYS and _:
      try:
        opts[key] = SAMPLING_KEYS[key](value)
      except ValueError:
        raise ConfigError(f"{key}={value!r}: expected {SAMPLING_KEYS[key].__name__}") from None
    else:
      overrides.append(item)
  chat = _chat_flag(opts)
  if sum(k in opts for k in ("prompt", "prompt_ids", "messages")) != 1:
    raise ConfigError(f"generate: give prompt=TEXT or prompt_ids=ID,ID (one of them), or messages=FILE (a "
                      f"conversation); usage: {USAGE}")
  if chat and "prompt_ids" in opts:
    raise ConfigError("generate: chat=true renders text with the chat template; give prompt=TEXT or messages=FILE")
  if not path.startswith(("/", ".")) and "/" not in path:
    from meshlm.config import preset_names
    import os
    if path in preset_names() and not os.path.isdir(path):
      raise ConfigError(f"generate {path}: a preset, which has no trained weights; generate needs a run, meshlm "
                        f"model or Hugging Face directory (train one: meshlm train model={path} run_dir=runs/{path}, "
                        f"then meshlm generate runs/{path} prompt=...)")
    path = "./" + path  # a directory, never a preset name
  from meshlm.commands.resolve import load_tree
  from meshlm.console import printable
  from meshlm.models.generate import check_request
  from meshlm.parallel.mesh import resolve_mesh
  from meshlm.train.data.tokenizers import make_tokenizer
  cfg = load_config(f"model={path}", "train.compute_dtype=float32", *overrides)
  if "prompt_ids" in opts:
    tok, ids = None, _ids("prompt_ids", opts["prompt_ids"])
  else:
    tok = make_tokenizer(cfg, otherwise="or give the prompt as token ids (prompt_ids=ID,ID)")
    # A plain prompt starts as a plain-text training row does: the tokenizer's post-processor BOS (Llama 3's), if any.
    ids = _chat_ids(cfg, tok, opts) if chat else [int(t) for t in (*tok.bos_ids, *tok.encode(opts["prompt"]))]
  stop = _ids("stop", opts["stop"])
  check_request(cfg, [ids], opts["max_new_tokens"], opts["temperature"], opts["top_k"], opts["top_p"])
  params = load_tree(cfg)
  new = _completion(cfg, params, ids, opts, stop or None, resolve_mesh(cfg, params))
  if tok is None:
    print(" ".join(str(t) for t in new))
  elif chat:
    print(printable(tok.decode(new)))  # the assistant's reply (the template's text is not the user's)
  else:
    # The prompt and the completion decoded together: a tokenizer that marks word starts (SentencePiece's "▁")
    # drops the completion's leading space when it is decoded alone.
    whole, prompt = tok.decode(ids + new), tok.decode(ids)
    rest = whole[len(prompt):] if whole.startswith(prompt) else tok.decode(new)
    print(printable(opts["prompt"] + rest))
  sys.stdout.flush()
  return 0
