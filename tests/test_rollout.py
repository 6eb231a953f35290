"""generate as an RL rollout: arrays out, a seed per row, and for MoE models the routed expert ids of
every token fed, in the train step's forced_expert_ids layout. Replaying them in the training forward
routes exactly as the sampler did: the same logits, bit for bit, as the forward routing by itself."""
import functools

import jax
import numpy as np
import pytest

import meshlm
from meshlm.models import decoder
from meshlm.models.ffns.moe import knobs
from meshlm.models import generate as G

LENGTHS, NEW = (5, 9, 12), 8


@functools.cache
def rollout():
  cfg = meshlm.load_config("model=qwen3-moe-tiny", "train.compute_dtype=float32", "cpu_devices=2", "mesh.fsdp=2")
  params = meshlm.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(3)
  prompts = [[int(t) for t in rng.integers(0, cfg.model.vocab_size, n)] for n in LENGTHS]
  out = G.generate(cfg, params, prompts, max_new_tokens=NEW, temperature=1.0, seed=[11, 12, 13], stop_tokens=())
  seqs = [p + n for p, n in zip(prompts, out.token_lists())]
  block = np.zeros((len(seqs), out.expert_ids.shape[1]), np.int32)
  for i, s in enumerate(seqs):
    block[i, :len(s)] = s
  return cfg, params, prompts, out, block


@functools.cache
def _forward_program():
  """The jitted training forward of rollout()'s config: the free and the forced calls each compile once, the
  control's other forced ids reuse the forced program."""
  cfg = rollout()[0]
  return jax.jit(lambda p, t, f: decoder.forward(cfg, p, t, return_side=True, layer_inputs={"forced_expert_ids": f}))


def _forward(params, block, forced=None):
  logits, side = _forward_program()(params, block, forced)
  return np.asarray(logits), np.asarray(side["moe_expert_ids"])


def test_outputs_are_arrays_in_the_replay_layout():
  cfg, _, prompts, out, block = rollout()
  B, L, k = len(prompts), len(decoder.input_readers(cfg, "forced_expert_ids")), knobs(cfg.model).num_experts_per_tok
  assert out.tokens.shape == out.logprobs.shape == (B, NEW) and list(out.lengths) == [NEW] * B
  assert out.expert_ids.shape == (B, max(LENGTHS) + NEW, L, k) and out.expert_ids.dtype == np.int32
  for b, n in enumerate(LENGTHS):
    # Routed: every prompt token and every new token but the last (never fed); the rest -1.
    fed = n + NEW - 1
    assert np.all(out.expert_ids[b, :fed] >= 0) and np.all(out.expert_ids[b, fed:] == -1)


def test_replayed_ids_give_the_samplers_routing_and_the_same_logits_bit_for_bit():
  cfg, params, _, out, block = rollout()
  free_logits, free_ids = _forward(params, block)
  recorded = out.expert_ids >= 0
  # The sampler (prefill + cached decode) routed every fed token as the training forward does.
  np.testing.assert_array_equal(np.moveaxis(free_ids, 0, 2)[recorded], out.expert_ids[recorded])
  forced = np.moveaxis(out.expert_ids, 2, 0)  # [L_moe, B, T, k]
  logits, ids = _forward(params, block, forced)
  np.testing.assert_array_equal(logits, free_logits)
  np.testing.assert_array_equal(ids, free_ids)
  # The policy's log-probs of the sampled tokens, from the replayed forward, are the sampler's.
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  for b, n in enumerate(LENGTHS):
    want = [logp[b, n - 1 + j, block[b, n + j]] for j in range(NEW)]
    np.testing.assert_allclose(out.logprobs[b], want, atol=1e-5, rtol=0)
  # Control: other experts at the recorded positions change the logits.
  E = knobs(cfg.model).num_experts
  shifted = np.where(forced >= 0, (forced + 1) % E, -1)
  other, _ = _forward(params, block, shifted)
  assert np.abs(other - free_logits).max() > 1e-4


def test_a_row_seed_replays_that_row():
  """Row b's draw depends on its seed and its logits alone: the same seed gives the same tokens in
  another batch position; another seed gives other tokens."""
  cfg, params, prompts, out, _ = rollout()
  again = G.generate(cfg, params, prompts[::-1], max_new_tokens=NEW, temperature=1.0, seed=[13, 12, 11],
                     stop_tokens=())
  assert again.token_lists()[::-1] == out.token_lists()
  other = G.generate(cfg, params, prompts, max_new_tokens=NEW, temperature=1.0, seed=[21, 22, 23], stop_tokens=())
  assert other.token_lists() != out.token_lists()
  with pytest.raises(meshlm.ConfigError, match="seed: 2 seeds for 3 prompts"):
    G.generate(cfg, params, prompts, max_new_tokens=NEW, seed=[1, 2])


def test_eos_stops_a_row_by_default():
  cfg, params, prompts, out, _ = rollout()
  eos = int(out.tokens[0, 2])  # row 0's third sampled token, as if it were the model's eos
  stopped = G.generate(cfg.model_copy(update={"model": cfg.model.model_copy(update={"eos_token_id": eos})}), params,
                       prompts, max_new_tokens=NEW, temperature=1.0, seed=[11, 12, 13])
  assert stopped.lengths[0] <= 3 and stopped.token_lists()[0][-1] == eos
  assert stopped.token_lists()[0] == out.token_lists()[0][:stopped.lengths[0]]
  full = G.generate(cfg.model_copy(update={"model": cfg.model.model_copy(update={"eos_token_id": eos})}), params,
                    prompts, max_new_tokens=NEW, temperature=1.0, seed=[11, 12, 13], stop_tokens=())
  assert full.token_lists() == out.token_lists()  # () never stops early


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_a_batch_the_mesh_divides_samples_as_on_one_device(mode):
  """4 prompts on fsdp=2: the rows are sharded (3 prompts, as above, are not). Prefill's token and log-prob
  buffers and the routed-ids record are built with the rows' sharding; explicit sharding refused the
  replicated buffers written with sharded rows, and the draw refused replicated row keys with sharded logits.
  Tokens and expert ids equal one device's, log-probs to 1e-5."""
  prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5], [8, 8]]

  def sample(*overrides, key=0):
    # One MoE layer (the preset's dense first layer and its other MoE layers add compile time, not buffers: the
    # routed-ids record is built once for all the MoE layers).
    cfg = meshlm.load_config("model=qwen3-moe-tiny", "model.num_layers=1", "model.mlp_only_layers=[]",
                             "train.compute_dtype=float32", *overrides)
    params = meshlm.init_params(cfg, jax.random.key(key))
    # Sampled (temperature, top-p): the row keys are sharded as the rows, and each row draws as on one device.
    return G.generate(cfg, params, prompts, max_new_tokens=4, stop_tokens=(), temperature=0.8, top_p=0.9)

  one = sample("cpu_devices=1")
  two = sample("cpu_devices=2", "mesh.fsdp=2", f"shard_mode={mode}")
  assert two.token_lists() == one.token_lists()
  np.testing.assert_array_equal(two.expert_ids, one.expert_ids)
  np.testing.assert_allclose(two.logprobs, one.logprobs, atol=1e-5, rtol=0)
  # Control: other weights sample other tokens, so the equality above can fail.
  assert sample("cpu_devices=1", key=1).token_lists() != one.token_lists()
