"""Sampling with the prompt's sequence sharded over mesh.context: the KV-cache generation of a MoE model on
context=2 (explicit) and on context=2 x fsdp=2 (auto) draws the same greedy tokens as on one device, with the same
log-probs (float32) and the same recorded expert ids (what router replay forces in the train step). The prefill
runs the prompt as the train step runs a sequence, sharded on context; its routed ids are written into a
buffer that is not (the decode steps write one position at a time). Before this test, that write failed to
trace under mesh.context for every MoE model, so `meshlm train`'s end-of-run sample and `meshlm rl` crashed there.

Negative control: a prefill whose attention sees only its own shard's keys (what a context-parallel attention
that never gathers K/V computes) must draw other tokens or log-probs.
"""
import functools

import jax
import numpy as np
import pytest

import meshlm
from meshlm.models import api, generate as G
from meshlm.nn import attention as A
from seams import own_shard_only

# mixtral-tiny narrower, two MoE layers; two prompts whose lengths bucket to 32 positions, so the longer one
# spans the shard edge at 16 on context=2.
SHRINK = ("model=mixtral-tiny", "model.num_layers=2", "model.embed_dim=64", "model.vocab_size=128",
          "model.parts.moe.mlp_dim=64", "train.compute_dtype=float32")
LENGTHS = (13, 29)
NEW = 8
# Float32 reassociation only (the prefill's sums split over the shards). Measured max |log-prob diff|: 7.2e-7 on
# both meshes, the same tokens; the control moves a log-prob by 0.56.
ATOL = 1e-5
LEAK = 1e-3
MESHES = {"context2_explicit": ("cpu_devices=2", "mesh.context=2", "shard_mode=explicit"),
          "context2_fsdp2_auto": ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2", "shard_mode=auto")}


@functools.cache
def params_and_prompts():
  cfg = meshlm.load_config(*SHRINK, "cpu_devices=1")
  params = jax.tree.map(np.asarray, meshlm.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(1)
  return params, [[int(t) for t in rng.integers(0, cfg.model.vocab_size, n)] for n in LENGTHS]


@functools.cache
def sample(*over: str) -> G.Generation:
  cfg = meshlm.load_config(*SHRINK, *over)
  params, prompts = params_and_prompts()
  return G.generate(cfg, params, prompts, max_new_tokens=NEW, stop_tokens=())


def _diff(got: G.Generation, want: G.Generation) -> float:
  return float(np.max(np.abs(got.logprobs - want.logprobs)))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sampling_on_context_shards_equals_one_device(mesh):
  want, got = sample("cpu_devices=1"), sample(*MESHES[mesh])
  print(f"{mesh}: max |log-prob diff| {_diff(got, want):.3g}; tokens {got.tokens.tolist()}")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert _diff(got, want) < ATOL
  assert want.expert_ids is not None and want.expert_ids.shape[:2] == (len(LENGTHS), max(LENGTHS) + NEW)
  np.testing.assert_array_equal(got.expert_ids, want.expert_ids)
  # The ids are real routing: several experts chosen, at every position that went through the model (the
  # prompt and the new tokens but the last, which is sampled and never fed back), -1 after.
  assert len(np.unique(want.expert_ids[want.expert_ids >= 0])) > 2
  for b, n in enumerate(LENGTHS):
    fed = n + NEW - 1
    assert np.all(want.expert_ids[b, :fed] >= 0) and np.all(want.expert_ids[b, fed:] == -1)


def test_a_prefill_that_attends_within_its_shard_only_fails_the_check():
  real = A.gqa_attention
  A.gqa_attention = own_shard_only(real, 2)
  api.clear_programs()  # the jitted prefill of this config is traced anew with the broken attention
  try:
    broken = G.generate(meshlm.load_config(*SHRINK, *MESHES["context2_explicit"]), *params_and_prompts(),
                        max_new_tokens=NEW, stop_tokens=())
  finally:
    A.gqa_attention = real
    api.clear_programs()
  want = sample("cpu_devices=1")
  print(f"own shard only: max |log-prob diff| {_diff(broken, want):.3g}")
  assert not np.array_equal(broken.tokens, want.tokens) or _diff(broken, want) > LEAK
