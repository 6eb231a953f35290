"""Sampling with a KV cache: one jitted prefill, then one jitted decode step per token, the cache donated.

    out = meshlm.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=64, temperature=0.8, top_p=0.95)
    out.tokens[i], out.logprobs[i]  # prompt i's new tokens and the model's log-probability of each

Prompts of different lengths are right-padded into one block; each row then advances from its own
length. Shapes come in buckets (prompt block and cache length rounded up to a power of two), so a
call compiles the prefill once and the decode step once per bucket, never once per token.

`logprobs` are log softmax of the model's (soft-capped) logits at the sampled token: the policy's
log-probabilities that RL needs, independent of temperature, top-k and top-p, which only shape the
draw. `recompute_greedy` is the plain reference: the whole prefix through `forward` for every token.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models import decoder
from meshlm.parallel.sharding import constrain

MIN_BUCKET = 16

# Traces of the jitted prefill / decode step, counted where they happen (at trace time), so a call can
# report how many compilations it caused.
TRACES: collections.Counter = collections.Counter()


@dataclasses.dataclass
class Generation:
  tokens: list[list[int]]  # each prompt's new tokens, up to and including a stop token
  logprobs: list[list[float]]  # log p(token | prefix) under the model, one per new token
  compilations: dict[str, int]  # {"prefill": n, "decode": n} traced during this call


def bucket(n: int, cap: int) -> int:
  """n rounded up to a power of two (at least MIN_BUCKET), but never past cap (when cap >= n)."""
  return min(max(MIN_BUCKET, 1 << math.ceil(math.log2(max(n, 1)))), max(cap, n))


def check_request(cfg: Config, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                  top_k: int | None, top_p: float) -> None:
  """Every bad request fails here, in one line naming the value, before anything compiles."""
  m = cfg.model
  if not prompts:
    raise ConfigError("prompts: empty; give at least one prompt")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ConfigError(f"prompt {i}: empty; a prompt needs at least one token")
    bad = [t for t in p if not 0 <= int(t) < m.vocab_size]
    if bad:
      raise ConfigError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {m.vocab_size})")
    if len(p) > m.max_position:
      raise ConfigError(f"prompt {i}: {len(p)} tokens is longer than model.max_position={m.max_position}")
  if max_new_tokens < 1:
    raise ConfigError(f"max_new_tokens={max_new_tokens}: must be at least 1")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > m.max_position:
    raise ConfigError(f"max_new_tokens={max_new_tokens}: the longest prompt ({longest} tokens) plus the new tokens "
                      f"overflow model.max_position={m.max_position}; at most {m.max_position - longest} fit")
  if not 0 < top_p <= 1:
    raise ConfigError(f"top_p={top_p}: must be in (0, 1]")
  if temperature < 0:
    raise ConfigError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
  if top_k is not None and top_k < 1:
    raise ConfigError(f"top_k={top_k}: must be at least 1 (or unset for no top-k)")


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int | None,
           top_p: float) -> tuple[jax.Array, jax.Array]:
  """(token [B], log p(token) [B]). temperature 0 is greedy; top-k and top-p cut the tail first."""
  # The vocab whole on each device: top-k, sort and the draw are then local, and unambiguous under
  # explicit sharding. [B, V] is one row per sequence, small next to the step's weights.
  logits = constrain(logits_BV.astype(jnp.float32), ("batch", None))
  logp = jax.nn.log_softmax(logits, axis=-1)
  if temperature == 0:
    tok = jnp.argmax(logits, axis=-1)
  else:
    z = logits / temperature
    if top_k is not None and top_k < z.shape[-1]:
      kth = jax.lax.top_k(z, top_k)[0][:, -1:]
      z = jnp.where(z < kth, -jnp.inf, z)
    if top_p < 1:
      # Keep the smallest set of most likely tokens whose probability reaches top_p.
      desc = jnp.sort(z, axis=-1)[:, ::-1]
      cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
      cut = jnp.sum(cum - jax.nn.softmax(desc, axis=-1) < top_p, axis=-1, keepdims=True)  # tokens kept, >= 1
      z = jnp.where(z < jnp.take_along_axis(desc, cut - 1, axis=-1), -jnp.inf, z)
    tok = jax.random.categorical(key, z, axis=-1)
  tok = tok.astype(jnp.int32)
  return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


@functools.lru_cache(maxsize=32)
def _steps(cfg_json: str, mesh, temperature: float, top_k: int | None, top_p: float):
  """The jitted prefill and decode step for one config and sampling setting (cached across calls)."""
  cfg = Config.model_validate_json(cfg_json)

  def prefill(params, tokens_BT, lengths_B, key, cache_len):
    TRACES["prefill"] += 1
    logits, cache = decoder.prefill(cfg, params, tokens_BT, lengths_B, cache_len)
    tok, lp = sample(logits, key, temperature, top_k, top_p)
    return tok, lp, cache

  def decode(params, tokens_B, positions_B, cache, key):
    TRACES["decode"] += 1
    logits, cache = decoder.decode(cfg, params, tokens_B, positions_B, cache)
    tok, lp = sample(logits, key, temperature, top_k, top_p)
    return tok, lp, cache

  return (jax.jit(prefill, static_argnames="cache_len"), jax.jit(decode, donate_argnums=(3,)))


def generate(cfg: Config, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
             stop_tokens: Sequence[int] = (), seed: int = 0, mesh=None) -> Generation:
  """Samples up to max_new_tokens after each prompt (lists of token ids of any lengths).

  A row stops after it samples one of stop_tokens (kept as its last token). mesh: where params live
  (default: the config's mesh; params not yet on it are placed onto their shardings).
  """
  from meshlm.parallel.mesh import make_mesh
  check_request(cfg, prompts, max_new_tokens, temperature, top_k, top_p)
  mesh = make_mesh(cfg) if mesh is None else mesh
  params = jax.device_put(params, decoder.param_shardings(cfg, mesh))
  B = len(prompts)
  lengths = np.array([len(p) for p in prompts], np.int32)
  T = bucket(int(lengths.max()), cfg.model.max_position)
  cache_len = bucket(int(lengths.max()) + max_new_tokens, cfg.model.max_position)
  block = np.zeros((B, T), np.int32)
  for i, p in enumerate(prompts):
    block[i, :len(p)] = p
  prefill, decode = _steps(cfg.model_dump_json(), mesh, float(temperature), top_k, float(top_p))
  before = dict(TRACES)
  stops = np.asarray(list(stop_tokens), np.int32)
  toks, lps = [], []
  key = jax.random.key(seed)
  with jax.set_mesh(mesh):
    key, sub = jax.random.split(key)
    tok, lp, cache = prefill(params, block, lengths, sub, cache_len=cache_len)
    done = np.zeros(B, bool)
    for t in range(max_new_tokens):
      host_tok, host_lp = np.asarray(tok), np.asarray(lp)
      toks.append(np.where(done, -1, host_tok))
      lps.append(host_lp)
      done |= np.isin(host_tok, stops)
      if done.all() or t == max_new_tokens - 1:
        break
      key, sub = jax.random.split(key)
      tok, lp, cache = decode(params, tok, jnp.asarray(lengths + t), cache, sub)
  out_t, out_lp = np.stack(toks, 1), np.stack(lps, 1)
  tokens, logprobs = [], []
  for i in range(B):
    n = int(np.sum(out_t[i] >= 0))
    tokens.append([int(x) for x in out_t[i, :n]])
    logprobs.append([float(x) for x in out_lp[i, :n]])
  used = {k: TRACES[k] - before.get(k, 0) for k in ("prefill", "decode")}
  return Generation(tokens, logprobs, used)


def recompute_greedy(cfg: Config, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     mesh=None) -> list[list[int]]:
  """The reference: greedy tokens with no cache, the whole prefix through `forward` for each token."""
  from meshlm.parallel.mesh import make_mesh
  check_request(cfg, prompts, max_new_tokens, 0.0, None, 1.0)
  mesh = make_mesh(cfg) if mesh is None else mesh
  params = jax.device_put(params, decoder.param_shardings(cfg, mesh))
  out = []

  @jax.jit
  def next_token(params, tokens, i):
    logits = decoder.forward(cfg, params, tokens)
    return jnp.argmax(logits[0, i - 1].astype(jnp.float32))

  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    for p in prompts:
      buf = np.zeros((1, bucket(len(p) + max_new_tokens, cfg.model.max_position)), np.int32)
      buf[0, :len(p)] = p
      for i in range(len(p), len(p) + max_new_tokens):
        buf[0, i] = int(next_token(params, jnp.asarray(buf), i))
      out.append([int(x) for x in buf[0, len(p):len(p) + max_new_tokens]])
  return out

