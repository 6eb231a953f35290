"""The census counts what the parts declare (Instrument.census): a registered part's counters under its own scopes
become census fields with their counts, a counter whose scope occurs nowhere counts zeros, an unregistered
part adds no field, and the tree's parts give the table the fields it always had, in the same order."""
import jax
import jax.numpy as jnp
import pytest

from meshlm.analysis import census as C
from meshlm.models import registry

import countedpart

D, T = 8, 8
GATHERS_SCATTERS = {"gathers": {"forward": 1, "backward": 0}, "scatters": {"forward": 0, "backward": 1}}
ZEROS = {"gathers": {"forward": 0, "backward": 0}, "scatters": {"forward": 0, "backward": 0}}

# The table's scalar fields before the parts declared their counters (census.SUMMARY_FIELDS at 60149c0), the
# reference summary_fields() keeps for the tree's parts.
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
OLD_SUMMARY_FIELDS = (
    "stablehlo.sharding_barriers", "stablehlo.transpose_of_dot.adjacent", "stablehlo.transpose_of_dot.blocked",
    "stablehlo.transpose_of_dot.weight_grad.adjacent", "stablehlo.transpose_of_dot.weight_grad.blocked",
    "stablehlo.transposes", "stablehlo.dots", "hlo.transposes", "hlo.copies", "hlo.fusions",
    *[f"hlo.collectives.{k}.{f}" for k in COLLECTIVES for f in ("count", "bytes")],
    "blowups", "scan_layout", "memory.temp_size_in_bytes", "memory.total_bytes", "cost.flops", "cost.bytes_accessed",
    "stablehlo.sorts.forward", "stablehlo.sorts.backward",
    "stablehlo.optimization_barriers.forward", "stablehlo.optimization_barriers.backward",
    *[f"stablehlo.moe.{k}.{d}" for k in ("gathers", "scatters") for d in ("forward", "backward")],
    *[f"gdn.{k}" for k in ("chunk_scans", "zero_filled_outputs", "hoisted_zero_carries", "copies", "transposes")],
)


@pytest.fixture(scope="module")
def low() -> C.Lowered:
  """The toy part's forward and backward, lowered and compiled (the census reads any program)."""
  loss = lambda p, x: jnp.sum(countedpart.apply(p, x)[0] ** 2)
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower({"w": jnp.ones((D, D))}, jnp.ones((2, T, D)))
  return C.lowered_of(lowered, lowered.compile())


def register(monkeypatch, **parts: str) -> None:
  for name, where in parts.items():
    monkeypatch.setitem(registry.PARTS, name, where)


def test_the_tree_parts_declare_the_moe_and_gdn_fields_in_registry_order():
  from meshlm.models.ffns.moe import CENSUS as MOE
  from meshlm.models.mixers.gdn import CENSUS as GDN
  assert registry.census_counters() == MOE + GDN
  assert C.summary_fields() == OLD_SUMMARY_FIELDS


def test_a_registered_parts_counters_are_census_fields(low, monkeypatch):
  register(monkeypatch, counted="countedpart:counted")
  got = C.census_of(low)
  # One gather of the rows forward, its gradient a scatter-add backward; the scan forward and its transpose.
  assert got["stablehlo"]["counted"] == GATHERS_SCATTERS
  assert got["counted"]["chunk_scans"] == 2 and got["counted"]["zero_filled_outputs"] >= 1
  # The tree's parts' fields are there too, with zeros: the program has none of their scopes.
  assert got["stablehlo"]["moe"] == ZEROS and set(got["gdn"].values()) == {0}
  fields = C.summary_fields()
  assert fields[:len(OLD_SUMMARY_FIELDS)] == OLD_SUMMARY_FIELDS
  assert fields[len(OLD_SUMMARY_FIELDS):] == (
      *[f"stablehlo.counted.{k}.{d}" for k in ("gathers", "scatters") for d in ("forward", "backward")],
      *[f"counted.{k}" for k in ("chunk_scans", "zero_filled_outputs", "hoisted_zero_carries", "copies", "transposes")])
  row = C.summary(got)
  assert row["stablehlo.counted.gathers.forward"] == 1 and row["counted.chunk_scans"] == 2


def test_a_counter_whose_scope_occurs_nowhere_counts_zeros(low, monkeypatch):
  """Negative control: the same program, counters under a scope none of its ops has."""
  register(monkeypatch, uncounted="countedpart:uncounted")
  got = C.census_of(low)
  assert got["stablehlo"]["nowhere"] == ZEROS
  assert set(got["nowhere"].values()) == {0}


def test_an_unregistered_part_adds_no_field(low):
  """Negative control: without the registry line the toy part's scopes are not counted at all."""
  got = C.census_of(low)
  assert "counted" not in got and "counted" not in got["stablehlo"]
  assert not [f for f in C.summary_fields() if "counted" in f]
  assert got["stablehlo"]["moe"] == ZEROS  # the tree's parts' fields stay


def test_counters_are_deduplicated_by_field_and_a_conflict_is_refused(low, monkeypatch):
  register(monkeypatch, counted="countedpart:counted", counted_again="countedpart:counted")
  assert [c.field for c in registry.census_counters()] == ["stablehlo.moe", "gdn", "stablehlo.counted", "counted"]
  assert C.census_of(low)["stablehlo"]["counted"] == GATHERS_SCATTERS  # counted once
  register(monkeypatch, elsewhere="countedpart:elsewhere")
  with pytest.raises(ValueError, match="census field 'counted': part 'counted' declares .*, part 'elsewhere' declares"):
    registry.census_counters()


def test_a_stablehlo_counter_outside_the_stablehlo_fields_is_refused(monkeypatch):
  register(monkeypatch, misfiled="countedpart:misfiled")
  with pytest.raises(ValueError, match="census field 'counted': a scope_gathers_scatters counter reads the "
                                       "stablehlo program, so its field must start with 'stablehlo.'"):
    C.census_of(C.Lowered("", "", {}, {}))
