"""Chat templates: the model's Jinja template rendered the way transformers' apply_chat_template renders it, and
the character spans of the assistant's turns that the assistant-only loss trains on.

The environment is transformers' own recipe (jinja2's ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, the
loopcontrols extension, a `generation` block tag that records what it renders, `raise_exception`, a `tojson` that
does not escape HTML, `strftime_now`), and a conversation is rendered with the same variables: messages,
add_generation_prompt, tools=None, documents=None and the tokenizer's special tokens (bos_token, eos_token, ...).
transformers itself is never imported: scripts/make_chat_fixtures.py records its renderings, and the tests hold
ours equal to them.

Where the assistant's tokens are (data.assistant_only):
  - "generation": the template marks them with {% generation %} ... {% endgeneration %} (transformers'
    return_assistant_tokens_mask, which TRL's assistant_only_loss reads).
  - "prefix": otherwise, assistant turn i spans from the end of the rendering of messages[:i] with the generation
    prompt to the end of the rendering of messages[:i + 1]; each must be a prefix of the whole conversation's
    rendering, else the conversation is refused (a template that rewrites earlier turns, such as Qwen3's, which drops
    the thinking of earlier turns, needs generation markers: data.chat_template=FILE).
"""
from __future__ import annotations

import contextvars
import datetime
import functools
import json
import os
import re

from meshlm.errors import ConfigError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The names a message's reasoning comes under; templates read reasoning_content (transformers' aliasing).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The tokenizer_config.json entries passed to the template (transformers passes its special tokens map).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(ValueError):
  """The template refused a conversation (its raise_exception, or a Jinja error while rendering)."""


@functools.lru_cache(maxsize=8)
def _compile(source: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body and, while a render tracks spans, records where
    the body lands in the output (the blocks rendered so far give its start)."""
    tags = {"generation"}

    def __init__(self, environment):
      super().__init__(environment)
      self.tracking = contextvars.ContextVar("meshlm_generation_spans", default=None)

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
      text = caller()
      tracking = self.tracking.get()
      if tracking is not None:
        blocks, spans = tracking
        start = sum(len(b) for b in blocks)
        spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source), env.extensions[Generation.identifier]


class ChatTemplate:
  """A chat template and the special tokens it is rendered with. Picklable (Grain's threads and checkpoints):
  the compiled template is rebuilt from the source."""

  def __init__(self, source: str, where: str, special: dict[str, str] | None = None):
    self.source, self.where, self.special = source, where, dict(special or {})
    self.has_generation = bool(_GENERATION_TAG.search(source))
    try:
      _compile(source)
    except Exception as e:  # a TemplateSyntaxError, reported as the file's
      raise ConfigError(f"{where}: not a valid Jinja chat template ({type(e).__name__}: {e})") from None

  @property
  def mask_rule(self) -> str:
    """How assistant tokens are found: "generation" (the template's markers) or "prefix" (prefix renderings)."""
    return "generation" if self.has_generation else "prefix"

  @property
  def special_tokens_read(self) -> frozenset[str]:
    """The special tokens (bos_token, eos_token, ...) the template reads: variables a tokenizer_config.json fills."""
    import jinja2.meta
    template, _ = _compile(self.source)
    return frozenset(jinja2.meta.find_undeclared_variables(template.environment.parse(self.source))) & \
        frozenset(_SPECIAL_TOKENS)

  def __getstate__(self):
    return {"source": self.source, "where": self.where, "special": self.special}

  def __setstate__(self, state):
    self.__init__(state["source"], state["where"], state["special"])

  def render(self, messages: list[dict], add_generation_prompt: bool = False,
             track: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the character spans its {% generation %} blocks rendered, when `track`)."""
    import jinja2
    template, ext = _compile(self.source)
    variables = dict(self.special, messages=_alias_reasoning(messages), tools=None, documents=None,
                     add_generation_prompt=add_generation_prompt)
    blocks, spans = [], []
    try:
      if not track:
        return template.render(**variables), []
      token = ext.tracking.set((blocks, spans))
      try:
        for block in template.generate(**variables):
          blocks.append(block)
      finally:
        ext.tracking.reset(token)
    except jinja2.exceptions.TemplateError as e:
      raise TemplateError(f"the chat template ({self.where}) refused the conversation: {e}") from None
    return "".join(blocks), spans

  def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's rendering, the character spans of its assistant turns), by mask_rule."""
    if self.has_generation:
      return self.render(messages, track=True)
    text, _ = self.render(messages)
    spans = []
    for i, m in enumerate(messages):
      if m.get("role") != "assistant":
        continue
      before, _ = self.render(messages[:i], add_generation_prompt=True)
      through, _ = self.render(messages[:i + 1])
      if not (through.startswith(before) and text.startswith(through)):
        raise TemplateError(f"the chat template ({self.where}) renders assistant turn {i} differently once later "
                            "turns follow, so its tokens cannot be found by prefix; give a template with "
                            "{% generation %} markers (data.chat_template=FILE), or data.assistant_only=false")
      spans.append((len(before), len(through)))
    return text, spans


def _alias_reasoning(messages: list[dict]) -> list[dict]:
  """transformers' aliasing: a message's reasoning under any of its names is also reasoning_content."""
  out = []
  for m in messages:
    reasoning = next((m[k] for k in _REASONING_FIELDS if isinstance(m, dict) and m.get(k) is not None), None)
    out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
  return out


def _special_tokens(config: dict) -> dict[str, str]:
  out = {}
  for name in _SPECIAL_TOKENS:
    value = config.get(name)
    value = value.get("content") if isinstance(value, dict) else value
    if isinstance(value, str):
      out[name] = value
  return out


def _tokenizer_config(folder: str) -> dict:
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  try:
    with open(path) as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"data.tokenizer: cannot read {path} ({e})") from None
  return config if isinstance(config, dict) else {}


def _config_template(config: dict, path: str) -> str | None:
  """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the one named default)."""
  t = config.get("chat_template")
  if isinstance(t, list):
    named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
    t = named.get("default")
    if t is None:
      raise ConfigError(f"{path}: chat_template lists templates {sorted(map(str, named))} and none named default; "
                        "give one with data.chat_template=FILE")
  return t if isinstance(t, str) else None


def load_chat_template(template_path: str | None, tokenizer_file: str | None) -> ChatTemplate | None:
  """data.chat_template=FILE, else the tokenizer's directory: chat_template.jinja, then tokenizer_config.json's
  chat_template. The special tokens come from the tokenizer_config.json beside the tokenizer. None: no template."""
  folder = os.path.dirname(tokenizer_file) if tokenizer_file else None
  config = _tokenizer_config(folder) if folder else {}
  special = _special_tokens(config)
  if template_path is not None:
    path = os.path.expanduser(template_path)
    try:
      with open(path, encoding="utf-8") as f:
        return ChatTemplate(f.read(), f"data.chat_template={template_path}", special)
    except OSError as e:
      raise ConfigError(f"data.chat_template={template_path}: cannot read it ({e.strerror})") from None
  if folder is None:
    return None
  jinja = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return ChatTemplate(f.read(), jinja, special)
  side = os.path.join(folder, "tokenizer_config.json")
  source = _config_template(config, side)
  return None if source is None else ChatTemplate(source, side, special)
