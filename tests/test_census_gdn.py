"""The census' gdn section (the gdn part's declared counter: analysis/counters.scan_dead_work under nn/gdn.py's
chunk scope) on the chunked rule's own program and on a GDN model's train step, with controls that add the dead work
it looks for. That a program without the chunk scope counts zeros (scans under another scope included) is
tests/test_census_parts.py's test_a_registered_parts_counters_are_census_fields."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import load_config
from meshlm.analysis import census as C
from meshlm.analysis import hlo as H
from meshlm.analysis.counters import scan_dead_work
from meshlm.models.family import CensusCounter
from meshlm.models.mixers.gdn import gdn as gdn_part
from meshlm.nn import gdn

B, T, K, N, HD, J, CHUNK = 1, 128, 1, 2, 16, 16, 32
U = T // CHUNK
COUNTER, = gdn_part().instrument.census  # what the census counts for the part: the dead work under the chunk scope


def _inputs():
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return (gdn.l2_normalize(f(B, T, K, HD)) * HD ** -0.5, gdn.l2_normalize(f(B, T, K, HD)), f(B, T, N, J),
          -jnp.asarray(r.uniform(0.01, 0.7, (B, T, N)), jnp.float32),
          jnp.asarray(r.uniform(0.05, 0.95, (B, T, N)), jnp.float32))


def _rule(q, k, v, g, beta):
  o, S = gdn.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=CHUNK)
  return o, S


def _counts(fn) -> dict:
  return scan_dead_work(H.parse(jax.jit(fn).lower(*_inputs()).compile().as_text()), COUNTER.scope)


@pytest.fixture(scope="module")
def forward_counts():
  return _counts(lambda *a: _rule(*a)[0])


def test_the_part_declares_the_gdn_field_under_the_rules_scope():
  assert COUNTER == CensusCounter(field="gdn", kind="scan_dead_work", scope=gdn.CHUNK_SCOPE)


def test_the_forward_rule_has_one_chunk_scan_whose_only_zero_fill_is_its_scan_output(forward_counts):
  # One lax.scan over the U chunks; JAX starts its one output (the chunk states) as a broadcast zero.
  assert forward_counts["chunk_scans"] == 1
  assert forward_counts["zero_filled_outputs"] == 1
  assert forward_counts["hoisted_zero_carries"] == 0


def test_a_zero_filled_buffer_written_inside_the_chunk_scope_is_counted(forward_counts):
  """Control: a second loop in the gdn_chunked scope that writes each chunk's output sum into a buffer it
  carries from jnp.zeros (the dead fill) adds one zero-filled output."""
  def with_dead_fill(*a):
    o, _ = _rule(*a)
    with jax.named_scope(COUNTER.scope):
      def body(buf_UBNJ, u):
        row = jax.lax.dynamic_slice_in_dim(o, u * CHUNK, CHUNK, 1).sum(1)  # [B, N, J]
        return jax.lax.dynamic_update_index_in_dim(buf_UBNJ, row, u, 0), None
      buf, _ = jax.lax.scan(body, jnp.zeros((U, B, N, J)), jnp.arange(U))
    return o, buf
  c = _counts(with_dead_fill)
  assert c["chunk_scans"] == forward_counts["chunk_scans"] + 1
  assert c["zero_filled_outputs"] == forward_counts["zero_filled_outputs"] + 1


def test_a_zero_buffer_carried_around_the_chunk_scans_is_counted_as_hoisted():
  """Control: a 'layer' loop around the rule carrying a zero buffer of the chunk states' shape (the fill
  XLA would hoist out of a layer body) is a hoisted zero carry."""
  def layers(q, k, v, g, beta):
    def layer(carry, _):
      x, buf = carry
      o, S = _rule(q, k, x, g, beta)
      return (o, buf + jnp.sum(S)), None
    (o, buf), _ = jax.lax.scan(layer, (v, jnp.zeros((U, B, N, J, HD))), None, length=2)
    return o, buf
  c = _counts(layers)
  assert c["chunk_scans"] >= 1
  assert c["hoisted_zero_carries"] >= 1


@pytest.fixture(scope="module")
def model_census():
  tiny = ("cpu_devices=2", "mesh.fsdp=2", "train.per_device_batch_size=1", "train.seq_len=64",
          "train.compute_dtype=float32", "model.embed_dim=32", "model.mlp_dim=32", "model.vocab_size=64")
  # 4 chunks: a loop of one trip would be inlined (a knob of the gdn part, which llama refuses)
  gdn_cfg = load_config("model=qwen3.5-tiny", *tiny, "model.parts.gdn.chunk_size=16")
  return gdn_cfg, C.census(gdn_cfg)


def test_a_gdn_train_step_has_a_forward_and_a_backward_chunk_scan_per_layer_and_nothing_hoisted(model_census):
  cfg, got = model_census
  from meshlm.models.decoder import plan
  gdn_layers = sum(k == "linear_attn" for k in plan(cfg).kinds)
  assert gdn_layers == 3
  assert got["gdn"]["chunk_scans"] == 2 * gdn_layers
  assert got["gdn"]["hoisted_zero_carries"] == 0
  # Shown in the table and compared by `meshlm compare`.
  assert "gdn.hoisted_zero_carries" in C.summary(got)

# A model without GDN layers shows zeros: tests/test_census_parts.py's
# test_a_registered_parts_counters_are_census_fields runs census_of on a program with a forward and a backward scan
# under another part's scope and asserts every gdn field 0 (the fields themselves are its OLD_SUMMARY_FIELDS); a
# llama train step's census here cost 3 s of CPU.
