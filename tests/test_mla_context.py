"""Context parallelism of multi-head latent attention (deepseek_v3): the tiny model (one MLA + MoE layer) with its
sequence sharded over mesh.context equals the same model unsharded, in the loss and every gradient (float32), on
context=2 and on context=2 x fsdp=2. The batch packs documents that span the shard edge. The MLA core runs in an
auto-axes region (models/mixers/mla.py), so XLA's partitioner gathers what each shard's queries need; nothing here
is MLA-specific parallel code, and this test is what shows that the partitioned program computes the same numbers.

Negative control: attention that sees only its own shard's keys (what a context-parallel attention that never
gathers K/V computes) must fail the same check.

Each program compiles once per module (functools.cache); every program is grads_and_loss (the train step's loss
and gradients), jitted on one mesh.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.models.params import init_model_state, init_params, model_state_shardings, param_shardings
from meshlm.nn import attention as A
from meshlm.parallel.mesh import make_mesh
from meshlm.train.step import grads_and_loss
from seams import max_diffs, own_shard_only, packed_batch, placed_batch

T = 64
# deepseek-v3-tiny on one MoE layer (first_k_dense_replace=0; the preset has one dense and two MoE layers, all with
# MLA), narrower, so each program compiles in seconds. Its dense layer's MLP is position-wise, and a dense GLU under
# mesh.context is tests/test_gdn_context.py's (qwen3.5-tiny); with it, the four programs took 27 s of CPU, 21 s
# without.
SHRINK = ("model.num_layers=1", "model.first_k_dense_replace=0", "model.embed_dim=64", "model.vocab_size=128",
          f"train.seq_len={T}", "train.compute_dtype=float32", "train.per_device_batch_size=2")
# Float32 reassociation only: measured max |diff| of the loss and any gradient leaf 1.9e-8 (context=2) and
# 2.0e-8 (context=2 x fsdp=2), against gradients up to 0.046; the control moves some value by 0.019. (With the
# dense layer too: 3.5e-8, 3.2e-8, 0.044 and 0.030.)
ATOL = 1e-6
LEAK = 1e-3  # what the negative control must move some value by, at least


def batch(vocab: int) -> dict:
  """Two rows. Row 0: documents [0, 20) | [20, 50) | [50, 64), the second spans the shard edge at 32 (context=2).
  Row 1: [0, 40) | [40, 58) | padding [58, 64): the first spans the edge; padding has segment id 0 and no loss."""
  return packed_batch(vocab, T, ((0, 20, 50, 64), (0, 40, 58)))


@functools.cache
def params():
  """(params, model state) as numpy; the routing bias (model state) drawn at random, so that it picks experts."""
  cfg = load_config("model=deepseek-v3-tiny", *SHRINK, "cpu_devices=1")
  mesh = make_mesh(cfg)
  state = jax.tree.map(np.asarray, init_model_state(cfg, jax.random.key(1), mesh))
  rng = np.random.default_rng(1)
  state = jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype), state)
  return jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), mesh)), state


@functools.cache
def run(*over: str, local_only: bool = False):
  """(loss, grads as numpy) of grads_and_loss on the mesh `over` names."""
  cfg = load_config("model=deepseek-v3-tiny", *SHRINK, *over)
  mesh = make_mesh(cfg)
  p, state = params()
  p = jax.device_put(p, param_shardings(cfg, mesh))
  state = jax.device_put(state, model_state_shardings(cfg, mesh))
  b = batch(cfg.model.vocab_size)
  with jax.set_mesh(mesh):
    put = placed_batch(mesh, b)
    attention = A.gqa_attention
    try:
      if local_only:
        A.gqa_attention = own_shard_only(attention, cfg.mesh.context)
      step = jax.jit(lambda p, s, b: grads_and_loss(cfg, p, b, model_state=s)[:2])
      compiled = step.lower(p, state, put).compile()
    finally:
      A.gqa_attention = attention
    loss, grads = compiled(p, state, put)
  return float(loss), jax.tree.map(np.asarray, grads)


errors = max_diffs


UNSHARDED = ("cpu_devices=1",)
MESHES = {"context2": ("cpu_devices=2", "mesh.context=2", "shard_mode=explicit"),
          "context2_fsdp2": ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2", "shard_mode=explicit")}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_sequence_equals_unsharded(mesh):
  want = run(*UNSHARDED)
  errs = errors(run(*MESHES[mesh]), want)
  print(f"{mesh}: max |diff| {max(errs.values()):.3g}; largest |gradient| "
        f"{max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want[1])):.3g}")
  mla_leaves = [k for k in errs if "attn" in k]
  assert len(mla_leaves) >= 8, mla_leaves  # every MLA parameter (q_a ... o) has its gradient
  assert any("router" in k for k in errs)  # and the MoE layer's
  assert max(errs.values()) < ATOL, {k: v for k, v in errs.items() if v >= ATOL}


def test_attention_within_each_shard_only_fails_the_check():
  errs = errors(run(*MESHES["context2"], local_only=True), run(*UNSHARDED))
  print(f"own shard only: max |diff| {max(errs.values()):.3g}")
  assert max(errs.values()) > LEAK, errs
  # The wrapper alone, at one shard, is plain attention: the control fails by what the shards miss, not by the wrapper.
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 8, 4)), jnp.float32) for _ in range(3))  # [B, N, T, H]
  mask = jnp.tril(jnp.ones((8, 8), bool))[None, None, None]
  plain = A.gqa_attention(q, k, v, mask, scale=0.5)
  np.testing.assert_array_equal(own_shard_only(A.gqa_attention, 1)(q, k, v, mask, scale=0.5), plain)
  assert np.max(np.abs(own_shard_only(A.gqa_attention, 2)(q, k, v, mask, scale=0.5) - plain)) > LEAK
