"""A toy feed-forward that declares census counters under its own scopes (tests/test_census_parts.py): it gathers
the rows in reverse under ROWS and runs a running sum over them, a scan, under SCAN. Registered by the test
that needs it (registry.PARTS["counted"] = "countedpart:counted")."""
import jax
import jax.numpy as jnp

from meshlm import spec as S
from meshlm.models.family import CensusCounter, Instrument, Part

ROWS, SCAN = "counted_rows", "counted_scan"
CENSUS = (CensusCounter(field="stablehlo.counted", kind="scope_gathers_scatters", scope=ROWS),
          CensusCounter(field="counted", kind="scan_dead_work", scope=SCAN))


def spec(m) -> dict:
  return {"w": S.kernel((m.embed_dim, m.embed_dim), ("embed", None))}


def apply(p: dict, x_BTD: jax.Array, ctx=None, state=None):
  T = x_BTD.shape[1]
  with jax.named_scope(ROWS):
    rows_BTD = jnp.take(x_BTD, jnp.arange(T)[::-1], axis=1)  # a gather; its gradient a scatter-add
  with jax.named_scope(SCAN):
    def step(total_BD, row_BD):
      total_BD = total_BD + row_BD @ p["w"]
      return total_BD, total_BD
    _, sums_TBD = jax.lax.scan(step, jnp.zeros_like(x_BTD[:, 0]), rows_BTD.swapaxes(0, 1))
  return sums_TBD.swapaxes(0, 1), None, {}


def counted() -> Part:
  return Part(name="counted", key="mlp", spec=spec, apply=apply, position_wise=True,
              instrument=Instrument(census=CENSUS))


def uncounted() -> Part:
  """The same part with its counters under a scope no op has (the negative control)."""
  return Part(name="uncounted", key="mlp", spec=spec, apply=apply, position_wise=True, instrument=Instrument(census=(
      CensusCounter(field="stablehlo.nowhere", kind="scope_gathers_scatters", scope="no_such_scope"),
      CensusCounter(field="nowhere", kind="scan_dead_work", scope="no_such_scope"))))


def elsewhere() -> Part:
  """A part declaring counted's "counted" field under another scope: a conflict."""
  return Part(name="elsewhere", key="mlp", spec=spec, apply=apply, position_wise=True,
              instrument=Instrument(census=(CensusCounter(field="counted", kind="scan_dead_work", scope="elsewhere"),)))


def misfiled() -> Part:
  """A part declaring a StableHLO kind outside the "stablehlo." fields."""
  return Part(name="misfiled", key="mlp", spec=spec, apply=apply, position_wise=True,
              instrument=Instrument(census=(
                  CensusCounter(field="counted", kind="scope_gathers_scatters", scope=ROWS),)))
