"""Rollouts: prompts from JSONL, G completions per prompt from `generate`, and the RL step's batch.

    prompts = load_prompts(cfg, tokenizer)         # every line checked before anything compiles
    it = PromptIterator(len(prompts), per_step, seed)
    idx = it.next()                                # prompt indices of one step (an epoch is a shuffle)
    gen = sample(cfg, params, [prompts[i].ids for i in idx], seeds, mesh)   # rows g*G + j
    batch = to_batch(cfg, prompt_ids, gen, T)      # the RL step's host batch (rewards/advantages apart)

The training row of completion b is its prompt then its completion, left-aligned as the sampler fed them:
position p of inputs is token p, so what the sampler recorded of its layers' choices (position p: token p's,
Generation.recorded) is the replay's batch field as it is. Targets are inputs shifted by one; the loss mask covers the completion's
tokens (from the prompt's last position on), and the log-probs sit at the target positions.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models.model import resolve
from meshlm.models import generate as G


@dataclasses.dataclass
class Prompt:
  text: str
  ids: list[int]
  row: dict  # the JSONL object: the fields the rewards read
  messages: list[dict] | None = None  # a conversational prompt's messages (TRL's form), else None


def load_prompts(cfg: Config, tokenizer, path: str | None = None, key: str = "rl.prompts") -> list[Prompt]:
  """The lines of rl.prompts (or of path, named `key` in errors: rl.eval_prompts) as Prompts; an empty file, a line
  without a string `prompt`, or a prompt that leaves no room for rl.max_new_tokens within model.max_position is
  refused in one line, as is an rl.max_new_tokens that leaves no room for any prompt."""
  path = cfg.rl.prompts if path is None else path
  if path is None:
    raise ConfigError(f"{key}: not set; give a JSONL file with a `prompt` field per line")
  if not os.path.isfile(path):
    raise ConfigError(f"{key}={path}: no such file")
  room = cfg.model.max_position - cfg.rl.max_new_tokens
  if room < 1:
    raise ConfigError(f"rl.max_new_tokens={cfg.rl.max_new_tokens} leaves no room for a prompt within "
                      f"model.max_position={cfg.model.max_position}; lower rl.max_new_tokens below "
                      f"{cfg.model.max_position}")
  out, first = [], 0  # first: the line of the first prompt, whose form (string or messages) every line keeps
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{key}={path}: line {n} is not JSON ({e.msg}: column {e.colno})") from None
      chat = isinstance(row, dict) and isinstance(row.get("prompt"), list)
      if chat:
        text, ids = _chat_prompt(cfg, tokenizer, row["prompt"], f"{key}={path}: line {n}")
      elif not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ConfigError(f"{key}={path}: line {n} has no non-empty string field `prompt` (nor a list of messages)")
      else:
        text, ids = row["prompt"], [int(i) for i in tokenizer.encode(row["prompt"])]
      if len(ids) > room:
        raise ConfigError(f"{key}={path}: line {n}'s prompt is {len(ids)} tokens, longer than model.max_position"
                          f" - rl.max_new_tokens = {cfg.model.max_position} - {cfg.rl.max_new_tokens} = {room}")
      bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
      if bad:
        raise ConfigError(f"{key}={path}: line {n}: token id {bad[0]} is outside the model's vocabulary "
                          f"[0, {cfg.model.vocab_size})")
      if out and chat != (out[0].messages is not None):
        form = {True: "a list of messages", False: "a string"}
        raise ConfigError(f"{key}={path}: line {n}'s prompt is {form[chat]} but line {first}'s is {form[not chat]}; "
                          "give every prompt of a file in one form (the rewards get one shape)")
      first = first if out else n
      out.append(Prompt(text, ids, row, row["prompt"] if chat else None))
  if not out:
    raise ConfigError(f"{key}={path}: empty; give at least one line with a `prompt` field")
  return out


def _chat_prompt(cfg: Config, tokenizer, messages: list, where: str) -> tuple[str, list[int]]:
  """A conversational prompt (TRL's: a list of {role, content} messages) as the chat template renders it with the
  generation prompt (the template as training finds it: data.chat_template, else beside data.tokenizer), and its ids."""
  from meshlm.train.data import chat_template
  from meshlm.train.data.chat import TemplateError
  from meshlm.train.data.formats import row_problem
  problem = row_problem({"messages": messages}, "conversational", "text")
  if problem is not None:
    raise ConfigError(f"{where}: prompt{problem.removeprefix('messages')}")
  try:
    text, _ = chat_template(cfg, "conversational").render(messages, add_generation_prompt=True)
  except TemplateError as e:
    raise ConfigError(f"{where}: {e}") from None
  return text, [int(i) for i in tokenizer.encode_offsets(text)[0]]


def eval_prompts(cfg: Config, tokenizer, prompts: list[Prompt]) -> list[Prompt]:
  """The eval set: the first rl.eval_prompts of the training prompts, or the file rl.eval_prompts names."""
  ev = cfg.rl.eval_prompts
  if isinstance(ev, int):
    return prompts[:ev]
  out = load_prompts(cfg, tokenizer, ev, "rl.eval_prompts")
  if (out[0].messages is None) != (prompts[0].messages is None):
    form = {True: "strings", False: "lists of messages"}
    raise ConfigError(f"rl.eval_prompts={ev}: its prompts are {form[out[0].messages is None]} but rl.prompts' are "
                      f"{form[prompts[0].messages is None]}; give both in one form (the rewards get one shape)")
  return out


class PromptIterator:
  """Prompt indices, per_step at a time, epoch after epoch, each epoch a permutation seeded by (seed, epoch).
  Its state is (epoch, cursor): checkpointed, it resumes exactly."""

  def __init__(self, n: int, per_step: int, seed: int):
    self.n, self.per_step, self.seed = n, per_step, seed
    self.epoch, self.cursor = 0, 0

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.n)

  def next(self) -> list[int]:
    out = []
    while len(out) < self.per_step:
      order = self._order(self.epoch)
      take = min(self.per_step - len(out), self.n - self.cursor)
      out += [int(i) for i in order[self.cursor:self.cursor + take]]
      self.cursor += take
      if self.cursor == self.n:
        self.epoch, self.cursor = self.epoch + 1, 0
    return out

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "cursor": self.cursor}

  def set_state(self, state: dict) -> None:
    self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def row_multiple(cfg: Config) -> int:
  """What the train step needs T to be a multiple of: the mesh.context shards' count, times what each shard's
  length must be a multiple of for the model's parts (MeshRules.shard_multiple: whole chunks of a chunked
  recurrence), and of 2 for context_attention=ring (each shard two zigzag chunks)."""
  if cfg.mesh.context > 1:
    return cfg.mesh.context * math.lcm(resolve(cfg).shard_multiple, 2 if cfg.context_attention == "ring" else 1)
  return cfg.mesh.context


def row_len(cfg: Config, prompts: list[Prompt]) -> int:
  """T, the training row length: the longest prompt plus rl.max_new_tokens, less the last token (never an
  input), rounded up to a multiple of 8 and of row_multiple(cfg); fixed for the run, so the step compiles once."""
  n = max(len(p.ids) for p in prompts) + cfg.rl.max_new_tokens - 1
  m = math.lcm(8, row_multiple(cfg))
  return -(-n // m) * m


def sampler_config(cfg: Config) -> Config:
  """cfg as the sampler sees it: the keys that change nothing it computes (rl.*, run_dir, checkpoint.*,
  train.freeze/steps/stop_after) at their defaults, so RL runs that differ only there share generate's
  compiled prefill and decode loop."""
  train = cfg.train.model_copy(update={"freeze": [], "steps": 1, "stop_after": None})
  return cfg.model_copy(update={"rl": type(cfg.rl)(), "run_dir": None, "checkpoint": type(cfg.checkpoint)(),
                                "train": train})


def sample(cfg: Config, params, prompt_ids: list[list[int]], seeds: list[int], mesh, stop_tokens) -> G.Generation:
  """G completions of each prompt (rows g*G + j), seeded per row."""
  rl = cfg.rl
  rows = [p for p in prompt_ids for _ in range(rl.num_generations)]
  return G.generate(sampler_config(cfg), params, rows, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k,
                    top_p=rl.top_p, stop_tokens=stop_tokens, seed=seeds, mesh=mesh)


def truncated(gen: G.Generation, stop_tokens) -> np.ndarray:
  """[B] bool: the completions that rl.max_new_tokens cut, their last token no stop token (TRL's is_truncated)."""
  stops = set(int(t) for t in stop_tokens)
  return np.array([n == 0 or int(gen.tokens[b, n - 1]) not in stops for b, n in enumerate(gen.lengths)], bool)


def to_batch(cfg: Config, prompt_ids: list[list[int]], gen: G.Generation, T: int,
             stop_tokens=()) -> dict[str, np.ndarray]:
  """The RL step's host batch from a rollout, without advantages (set from the rewards). With
  rl.mask_truncated_completions the truncated completions' loss mask is 0 (they still count as rows)."""
  rows = [p for p in prompt_ids for _ in range(cfg.rl.num_generations)]
  B = len(rows)
  inputs = np.zeros((B, T), np.int32)
  targets = np.zeros((B, T), np.int32)
  seg = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  sampler = np.zeros((B, T), np.float32)
  for b, p in enumerate(rows):
    n, c = len(p), int(gen.lengths[b])
    seq = np.asarray(p + [int(t) for t in gen.tokens[b, :c]], np.int32)
    inputs[b, :len(seq) - 1] = seq[:-1]
    targets[b, :len(seq) - 1] = seq[1:]
    seg[b, :len(seq) - 1] = 1
    mask[b, n - 1:n - 1 + c] = 1.0
    sampler[b, n - 1:n - 1 + c] = gen.sample_logprobs[b, :c]
  if cfg.rl.mask_truncated_completions:
    mask[truncated(gen, stop_tokens)] = 0.0
  batch = {"inputs": inputs, "targets": targets, "segment_ids": seg, "loss_mask": mask,
           "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
           "sampler_logp": sampler, "old_logp": sampler.copy(), "advantages": np.zeros((B,), np.float32)}
  if cfg.rl.beta > 0:
    batch["ref_logp"] = sampler.copy()  # the trainer scores the reference into it (rl/trainer.py)
  for name, rec in gen.recorded.items():  # every input a part replays (generate records them all)
    # rec [B, T_gen, n, ...]; position p: what token p chose, -1 where no token was fed.
    forced = np.full((B, T) + rec.shape[2:], -1, rec.dtype)
    n = min(T, rec.shape[1])
    forced[:, :n] = rec[:, :n]
    forced[seg == 0] = -1  # padding: not forced
    batch[name] = forced
  return batch
