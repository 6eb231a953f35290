"""The census' per-step counts read every loop's trip count or name the loops they could not read (issue 45, item 4).

One small program, compiled once on one CPU device: a scan of 3 steps whose body runs a scan of 5 (the GDN chunk
scans inside the layer scan) with a sort and a matmul in it, and beside the inner scan a `while_loop` whose trip
count is data-dependent (the flash attention block loops and the grouped matmul's tile loops are such loops).
"""
from __future__ import annotations

import re

import pytest

OUTER, INNER = 3, 5


@pytest.fixture(scope="module")
def program():
  """(StableHLO text with locations, optimized HLO text) of the nested-scan program and of the same program
  without its while_loop (the control whose every loop has a count)."""
  import jax
  import jax.numpy as jnp

  def f(x_ND, w_LDD, dynamic: bool):
    def layer(h_ND, w_DD):
      def chunk(h2_ND, k):
        with jax.named_scope("chunk"):
          return jnp.sort(jnp.tanh(h2_ND @ w_DD) + k, axis=-1), None
      with jax.named_scope("chunks"):
        h_ND, _ = jax.lax.scan(chunk, h_ND, jnp.arange(INNER, dtype=h_ND.dtype))
      if dynamic:
        with jax.named_scope("dyn"):
          # Runs until the state passes a value read from the data: no trip count in the program.
          _, h_ND = jax.lax.while_loop(lambda s: s[0] < jnp.abs(s[1]).sum(), lambda s: (s[0] + 1.0, s[1] * 0.5),
                                       (jnp.float32(0), h_ND))
      return h_ND, None
    with jax.named_scope("layers"):
      return jax.lax.scan(layer, x_ND, w_LDD)[0].sum()

  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((OUTER, 16, 16), jnp.float32)
  out = {}
  for dynamic in (True, False):
    lowered = jax.jit(lambda x, w, d=dynamic: f(x, w, d)).lower(x, w)
    out[dynamic] = (lowered.as_text(debug_info=True), lowered.compile().as_text())
  return out


def test_nested_scans_count_every_trip_in_stablehlo(program):
  from meshlm.analysis import census as CS
  counts, _, mod = CS.stablehlo_counts(program[True][0])
  assert counts["sorts"]["forward"] == OUTER * INNER
  assert sorted(t for t in mod.trip_counts.values() if t is not None) == sorted([INNER, OUTER])
  # Negative control: an inner loop read as unknown counts its sort once per start of the inner loop, and is named.
  inner = next(k for k, t in mod.trip_counts.items() if t == INNER)
  mod.trip_counts[inner] = None
  assert CS.executed_counts(mod)["sorts"]["forward"] == OUTER
  assert {u["scope"] for u in CS.unread_loops(mod)} == {"layers/chunks forward", "layers/dyn forward"}


def test_a_data_dependent_loop_is_named_not_counted_silently(program):
  from meshlm.analysis import census as CS
  counts, _, _ = CS.stablehlo_counts(program[True][0])
  assert counts["unread_loops"] == [{"scope": "layers/dyn forward", "runs": OUTER}]
  hlo, _ = CS.hlo_counts(program[True][1])
  assert hlo["unread_loops"] == [{"scope": "layers/dyn forward", "runs": OUTER}]
  line = CS.unread_loops_line({"stablehlo": counts["unread_loops"], "hlo": hlo["unread_loops"]})
  assert line.endswith("stablehlo 3 (layers/dyn forward x3), hlo 3 (layers/dyn forward x3)")
  # Control: without the while_loop every loop's count is read, and the reports say nothing.
  counts, _, _ = CS.stablehlo_counts(program[False][0])
  hlo, _ = CS.hlo_counts(program[False][1])
  assert counts["unread_loops"] == [] and hlo["unread_loops"] == []
  assert CS.unread_loops_line({"stablehlo": [], "hlo": []}) is None
  many = [{"scope": f"s{k}", "runs": k} for k in range(1, 7)]
  assert CS.unread_loops_line({"hlo": many}, top=2).endswith("hlo 21 (s6 x6; s5 x5; 4 more scopes)")


@pytest.mark.parametrize("printed", [True, False], ids=["known_trip_count", "tpu_like"])
def test_nested_scans_count_every_trip_in_hlo(program, printed):
  """XLA:CPU prints each scan's known_trip_count; XLA:TPU prints none, and analysis/hlo.py reads the count from
  the condition, the start and the step: the inner scan's body runs OUTER x INNER times either way."""
  from meshlm.analysis import hlo as H
  text = program[False][1]
  if not printed:
    text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    assert "known_trip_count" not in text
  mod = H.parse(text)
  loops = [i for i in mod.instrs() if i.opcode == "while"]
  assert sorted(i.trip_count for i in loops) == sorted([INNER, OUTER])
  inner = next(i for i in loops if i.trip_count == INNER)
  assert mod.multipliers[inner.called["body"][0]] == OUTER * INNER
  assert mod.unread_loops() == []
  if not printed:
    # Negative control: a condition the reader does not recognise (XLA:CPU wraps each compare in a fusion: read
    # through it) leaves both loops unread, counted once per start, and named.
    broken = H.parse(text.replace("direction=LT", "direction=NE"))
    assert len(broken.unread_loops()) == 2 and broken.multipliers[inner.called["body"][0]] == 1
