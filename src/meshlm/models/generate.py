"""Sampling with a KV cache: one jitted prefill, then the whole decode loop on the device.

    out = meshlm.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=64, temperature=0.8, top_p=0.95)
    out.tokens [B, N], out.logprobs [B, N], out.lengths [B]   # row b's new tokens are tokens[b, :lengths[b]]
    out.token_lists(), out.logprob_lists()                    # the same as Python lists
    out.recorded {input: [B, T, n, ...]}                      # what a replay of this sample forces

Prompts of different lengths are right-padded into one block; each row then advances from its own
length. The decode loop is a `lax.while_loop` with a done mask: no host round-trip per token, and it
stops when every row has sampled a stop token. Each decode step writes its K/V rows into the donated
cache in place. Shapes come in buckets (prompt block, new tokens and cache length rounded up to a power
of two), so a call compiles the prefill once and the decode loop once per bucket, never once per token.

`logprobs` are log softmax of the model's (soft-capped) logits at the sampled token, independent of
temperature, top-k and top-p, which only shape the draw. `sample_logprobs` are the log-probs of the
distribution the token was really drawn from (after temperature, top-k and top-p, by `truncate`): what
RL's importance ratio divides by. `recorded` holds, for each per-layer input that a part's side output
replays (Replay.replays), that side output over the rows prompt + completion, laid out as the train step's
batch field of that name: position p of row b holds what token p chose, and -1 where no token was fed
(padding, the last token). (`Generation` is models/api.py's, with its named views of the record.)
Sampling is seeded per row (`seed` an int or one per row): row b's draw depends only on its seed, its
logits and the step. `recompute_greedy` is the plain reference: the whole prefix through `forward`
for every token.
"""
from __future__ import annotations

import collections
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models import decoder
from meshlm.models.params import merge_state
from meshlm.models.model import resolve
from meshlm.models.api import Generation, cached, place
from meshlm.parallel.mesh import resolve_mesh
from meshlm.parallel.sharding import constrain

MIN_BUCKET = 16

# Traces of the jitted prefill / decode loop, counted where they happen (at trace time), so a call can
# report how many compilations it caused.
TRACES: collections.Counter = collections.Counter()


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


def truncate(z: jax.Array, top_k: int | None, top_p: float) -> jax.Array:
  """z [..., V] (logits over the temperature) with every token outside top-k and top-p at -inf: the
  distribution sampling draws from is softmax of the result. The RL trainer scores completions with the
  same function, so its log-probs are of the distribution the sampler really used."""
  if top_k is not None and top_k < z.shape[-1]:
    kth = jax.lax.top_k(z, top_k)[0][..., -1:]
    z = jnp.where(z < kth, -jnp.inf, z)
  if top_p < 1:
    # Keep the smallest set of most likely tokens whose probability reaches top_p.
    desc = jnp.sort(z, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
    cut = jnp.sum(cum - jax.nn.softmax(desc, axis=-1) < top_p, axis=-1, keepdims=True)  # tokens kept, >= 1
    z = jnp.where(z < jnp.take_along_axis(desc, cut - 1, axis=-1), -jnp.inf, z)
  return z


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int | None,
           top_p: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(token [B], log p(token) [B], log q(token) [B]): p is the model's softmax, q the distribution drawn
  from (after temperature, top-k and top-p; q = 1 when greedy). temperature 0 is greedy; top-k and top-p
  cut the tail first. key: one key for the batch, or one per row ([B] keys: row b's draw depends on its
  key alone)."""
  # The vocab whole on each device: top-k, sort and the draw are then local, and unambiguous under
  # explicit sharding. [B, V] is one row per sequence, small next to the step's weights.
  logits = constrain(logits_BV.astype(jnp.float32), ("batch", None))
  logp = jax.nn.log_softmax(logits, axis=-1)
  if temperature == 0:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    return tok, lp, jnp.zeros_like(lp)  # zeros with the rows' sharding (explicit refuses a replicated one)
  z = truncate(logits / temperature, top_k, top_p)
  if key.ndim:
    tok = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, z)
  else:
    tok = jax.random.categorical(key, z, axis=-1)
  tok = tok.astype(jnp.int32)
  logq = jax.nn.log_softmax(z, axis=-1)
  pick = lambda a: jnp.take_along_axis(a, tok[:, None], axis=-1)[:, 0]  # noqa: E731
  return tok, pick(logp), pick(logq)


def recorded_inputs(cfg: Config) -> dict[str, str]:
  """{side output name: the per-layer input it replays} over the plan's parts (Replay.replays)."""
  return resolve(cfg).replays


def _record(buf_BTn, side_nBt, start_B, real_B):
  """Writes side [n, B, t, ...] into buf [B, T, n, ...] at positions start_B[b] + [0, t), where real."""
  # [B, t, n, ...], whole along t: under mesh.context the prefill's side outputs are sharded on the sequence,
  # and the buffer is not (the decode steps write one position at a time). Routed ids are small.
  vals = jnp.moveaxis(side_nBt, 0, 2)
  vals = constrain(vals, ("batch",) + (None,) * (vals.ndim - 1))
  t = vals.shape[1]
  pos = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, t]
  real = real_B if real_B.ndim == 2 else jnp.broadcast_to(real_B[:, None], pos.shape)
  pos = constrain(jnp.where(real, pos, buf_BTn.shape[1]), ("batch", None))  # out of range: dropped
  # One scatter per row (vmapped: the rows are a batch dimension, so a batch-sharded buffer stays sharded).
  write = lambda buf_Tn, pos_t, vals_tn: buf_Tn.at[pos_t].set(vals_tn, mode="drop")
  return jax.vmap(write)(buf_BTn, pos, vals.astype(buf_BTn.dtype))


def _steps(cfg: Config, temperature: float, top_k: int | None, top_p: float):
  """The jitted prefill and decode loop for one config and sampling setting (api.cached keeps them across calls)."""
  records = recorded_inputs(cfg)

  def keys_at(seeds_B, t):
    # Row keys sharded as the rows are: the draw vmaps over keys and batch-sharded logits together.
    seeds_B = constrain(seeds_B, ("batch",))
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), t))(seeds_B)

  def prefill(params, tokens_BT, lengths_B, seeds_B, stops, cache_len, new_len, total_len):
    TRACES["prefill"] += 1
    B, T = tokens_BT.shape
    logits, cache, side = decoder.prefill(cfg, params, tokens_BT, lengths_B, cache_len)
    tok, lp, lq = sample(logits, keys_at(seeds_B, 0), temperature, top_k, top_p)
    bufs = {}
    for name, field in records.items():
      vals = side[name]  # [n, B, T, ...]
      buf = jnp.full((B, total_len) + vals.shape[:1] + vals.shape[3:], -1, vals.dtype)
      # Rows sharded as the batch is (explicit sharding refuses a replicated buffer written with sharded rows).
      buf = constrain(buf, ("batch",) + (None,) * (buf.ndim - 1))
      real = jnp.arange(T, dtype=jnp.int32)[None, :] < lengths_B[:, None]
      bufs[field] = _record(buf, vals, jnp.zeros((B,), jnp.int32), real)
    # Built from tok and lp themselves, so the buffers carry the rows' sharding.
    first = jnp.arange(new_len)[None, :] == 0
    toks = jnp.where(first, tok[:, None], 0).astype(jnp.int32)
    lps = jnp.where(first, lp[:, None], 0.0).astype(jnp.float32)
    lqs = jnp.where(first, lq[:, None], 0.0).astype(jnp.float32)
    done = jnp.isin(tok, stops)
    return toks, (lps, lqs), jnp.ones_like(tok, jnp.int32), done, cache, bufs

  def decode_loop(params, toks, lps, lengths, done, cache, bufs, prompt_B, seeds_B, stops, max_new):
    TRACES["decode"] += 1
    # Once per call, not per token: the kernels gathered once (layers.prepare) and the embedding table as the lookup
    # reads it (whole under explicit sharding), which each step would otherwise gather again. The barrier keeps XLA
    # from sinking the gathers back into the loop (it does, to save their memory: the 397B step gathered a 2 GB
    # table per token).
    prepared = decoder.loop_invariants(cfg, params)
    prepared = jax.lax.optimization_barrier(prepared) if prepared is not None else None

    def cond(c):
      t, _, _, _, done, _, _ = c
      return (t < max_new) & ~jnp.all(done)

    def body(c):
      t, toks, lps, lengths, done, cache, bufs = c
      fed = toks[:, t - 1]  # the previous token, at position prompt + t - 1
      logits, cache, side = decoder.decode(cfg, params, fed, prompt_B + t - 1, cache, prepared=prepared)
      real = (t - 1) < lengths  # the fed token is one of the row's own
      bufs = {field: _record(bufs[field], side[name], prompt_B + t - 1, real) for name, field in records.items()}
      tok, lp, lq = sample(logits, keys_at(seeds_B, t), temperature, top_k, top_p)
      live = ~done
      toks = toks.at[:, t].set(jnp.where(live, tok, 0))
      lps = (lps[0].at[:, t].set(jnp.where(live, lp, 0.0)), lps[1].at[:, t].set(jnp.where(live, lq, 0.0)))
      lengths = lengths + live.astype(jnp.int32)
      done = done | (live & jnp.isin(tok, stops))
      return t + 1, toks, lps, lengths, done, cache, bufs

    out = jax.lax.while_loop(cond, body, (jnp.int32(1), toks, lps, lengths, done, cache, bufs))
    return out[1:]

  return (jax.jit(prefill, static_argnames=("cache_len", "new_len", "total_len")),
          jax.jit(decode_loop, donate_argnums=(5,)))


def sampler_programs(cfg: Config, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0):
  """The jitted (prefill, decode loop) that `generate` runs for cfg with this sampling setting (meshlm
  compile lowers them from abstract inputs). prefill(params, tokens [B, T], lengths [B], seeds [B], stops [S],
  cache_len=, new_len=, total_len=) -> (toks, (lps, lqs), n, done, cache, bufs); decode_loop(params, toks, lps, n,
  done, cache, bufs, prompt lengths [B], seeds [B], stops [S], max_new) -> the same six. jit keys its
  executables on the mesh the caller enters (jax.set_mesh(mesh)), so the pair serves every mesh."""
  return cached("sample", cfg, _steps, float(temperature), top_k, float(top_p))


def stop_ids(cfg: Config, stop_tokens: Sequence[int] | None) -> list[int]:
  """The ids that end a row: stop_tokens when given (() for none), else the model's eos_token_id."""
  if stop_tokens is not None:
    return [int(t) for t in stop_tokens]
  eos = cfg.model.eos_token_id
  return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def generate(cfg: Config, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
             stop_tokens: Sequence[int] | None = None, seed: int | Sequence[int] = 0, mesh=None) -> Generation:
  """Samples up to max_new_tokens after each prompt (lists of token ids of any lengths).

  A row stops after it samples a stop token (kept as its last token): stop_tokens, or by default the
  model's eos_token_id (model.eos_token_id; pass () to never stop early). seed: an int (row b draws
  with seed + b) or one seed per row. params: the whole model tree, the model-state leaves merged in
  (params.merge_state; what checkpoints, meshlm.init_params and hf.load give). mesh: where to sample (default:
  parallel.resolve_mesh: the enclosing jax.set_mesh's, else the one params live on, else the config's); params not
  yet on it are placed onto their shardings.
  """
  check_request(cfg, prompts, max_new_tokens, temperature, top_k, top_p)
  B = len(prompts)
  seeds = np.asarray([seed + b for b in range(B)] if isinstance(seed, int) else list(seed), np.int32)
  if seeds.shape != (B,):
    raise ConfigError(f"seed: {len(seeds)} seeds for {B} prompts; give one int or one seed per prompt")
  mesh = resolve_mesh(cfg, params, mesh)
  params = place(cfg, params, mesh)
  lengths = np.array([len(p) for p in prompts], np.int32)
  T = bucket(int(lengths.max()), cfg.model.max_position)
  N = bucket(max_new_tokens, cfg.model.max_position)
  cache_len = bucket(int(lengths.max()) + max_new_tokens, cfg.model.max_position)
  block = np.zeros((B, T), np.int32)
  for i, p in enumerate(prompts):
    block[i, :len(p)] = p
  stops = np.asarray(stop_ids(cfg, stop_tokens) or [-1], np.int32)  # -1 is never sampled
  prefill, decode_loop = cached("sample", cfg, _steps, float(temperature), top_k, float(top_p))
  before = dict(TRACES)
  with jax.set_mesh(mesh):
    toks, lps, n, done, cache, bufs = prefill(params, block, lengths, seeds, stops, cache_len=cache_len, new_len=N,
                                              total_len=T + N)
    toks, lps, n, done, cache, bufs = decode_loop(params, toks, lps, n, done, cache, bufs, lengths, seeds, stops,
                                                  np.int32(max_new_tokens))
  used = {k: TRACES[k] - before.get(k, 0) for k in ("prefill", "decode")}
  total = int(lengths.max()) + max_new_tokens
  return Generation(_host(toks)[:, :max_new_tokens], _host(lps[0])[:, :max_new_tokens], _host(n),
                    {k: _host(v)[:, :total] for k, v in bufs.items()}, used, _host(lps[1])[:, :max_new_tokens])


def _host(a: jax.Array) -> np.ndarray:
  """The whole of a (global) array as numpy on this process: across processes, gathered from every one."""
  if a.is_fully_addressable:
    return np.asarray(a)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def recompute_greedy(cfg: Config, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     mesh=None) -> list[list[int]]:
  """The reference: greedy tokens with no cache, the whole prefix through `forward` for each token."""
  check_request(cfg, prompts, max_new_tokens, 0.0, None, 1.0)
  mesh = resolve_mesh(cfg, params, mesh)
  params = place(cfg, params, mesh)
  out = []

  @jax.jit
  def next_token(params, tokens, i):
    logits = decoder.forward(cfg, params, tokens)
    return jnp.argmax(logits[0, i - 1].astype(jnp.float32))

  with jax.set_mesh(mesh):
    for p in prompts:
      buf = np.zeros((1, bucket(len(p) + max_new_tokens, cfg.model.max_position)), np.int32)
      buf[0, :len(p)] = p
      for i in range(len(p), len(p) + max_new_tokens):
        buf[0, i] = int(next_token(params, jnp.asarray(buf), i))
      out.append([int(x) for x in buf[0, len(p):len(p) + max_new_tokens]])
  return out

