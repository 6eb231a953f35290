"""Unrolled layers hand the MoE expert loop its kernels in their stacks (`stack_rows`, nn/stack_row.py).

- mixtral-tiny (unrolled), float32: loss and every gradient bit-identical to the sliced rows
  (stack_rows=false), on one device and on fsdp=2 with the kernels expert-parallel (`experts`: the stacks
  go into the dispatch's shard_map as stored) and FSDP-gathered (`embed`: each row sliced out first).
- The compiled step slices no expert stack where the rows are read in place; with stack_rows=false it
  slices each stack once per layer (control). Under `embed` (stacks sharded on embed: reading them in
  place would gather every layer's row) the rows are sliced out first, and both settings compile alike.
- A StackRow's `at` and `get` read the row's entries, and a wrong row index fails the comparison.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.nn.stack_row import StackRow, materialize

from seams import compiled_grads

BASE = ("model=mixtral-tiny", "train.compute_dtype=float32", "train.seq_len=32")
MESHES = {
    "one device": ("cpu_devices=1", "mesh.fsdp=1", "train.per_device_batch_size=2"),
    # Two of the four experts per device: with one, XLA unrolls the expert loop and the one read is a slice.
    "fsdp2 experts": ("cpu_devices=2", "mesh.fsdp=2", "train.per_device_batch_size=1",
                      "model.parts.moe.kernel_fsdp=experts"),
    "fsdp2 embed": ("cpu_devices=2", "mesh.fsdp=2", "train.per_device_batch_size=1", "model.parts.moe.kernel_fsdp=embed"),
}


def _run(mesh: tuple, rows: bool):
  """(loss, grads as numpy, the compiled HLO) of the step's loss and gradients."""
  loss, grads, compiled = compiled_grads(load_config(*BASE, *mesh, f"stack_rows={str(rows).lower()}"))
  return np.asarray(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


@pytest.fixture(scope="module", params=list(MESHES))
def arms(request):
  return request.param, {rows: _run(MESHES[request.param], rows) for rows in (True, False)}


KERNEL_META = re.compile(r"\['moe'\]\['moe'\]\['(gate|up|down)'\]")  # matched with the HLO's escapes removed
INSTR = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+\s+(\w[\w\-]*)\(([^)]*)\)")


def _stack_slices(hlo: str) -> int:
  """Static slices (a slice, or a fusion XLA named for one) whose operand is an expert kernel stack (an
  entry parameter whose metadata names p['layers'][kind]['moe'][gate|up|down])."""
  lines = hlo.splitlines()
  stacks = {m.group(1) for line in lines if (m := INSTR.match(line)) and m.group(2) == "parameter"
            and KERNEL_META.search(line.replace("\\", ""))}
  n = 0
  for line in lines:
    m = INSTR.match(line)
    if m and (m.group(2) == "slice" or (m.group(2) == "fusion" and m.group(1).startswith("slice"))) and \
        {a.strip().lstrip("%") for a in m.group(3).split(",")} & stacks:
      n += 1
  return n


def _gathers(hlo: str) -> list[str]:
  """The all-gathers' result types, sorted."""
  return sorted(m.group(1) for m in re.finditer(r"= (\S+) all-gather(?:-start)?\(", hlo))


def test_loss_and_gradients_are_bit_identical_to_the_sliced_rows(arms):
  name, runs = arms
  (loss_on, grads_on, _), (loss_off, grads_off, _) = runs[True], runs[False]
  np.testing.assert_array_equal(loss_on, loss_off)
  gate = grads_on["layers"]["moe"]["moe"]["gate"]
  assert gate.shape[0] == 2 and np.all(np.any(gate != 0, axis=(1, 2, 3)))  # both layers' kernels get gradients
  for a, b in zip(jax.tree.leaves(grads_on), jax.tree.leaves(grads_off)):
    np.testing.assert_array_equal(a, b)


def test_the_expert_stacks_are_read_in_place(arms):
  name, runs = arms
  on, off = _stack_slices(runs[True][2]), _stack_slices(runs[False][2])
  if name == "fsdp2 embed":
    # The stacks are sharded on embed: the rows are sliced out and gathered, as in the plain path (XLA
    # gathers first, then slices the gathered stack), so the two compile alike.
    assert on == off, (on, off)
    assert _gathers(runs[True][2]) == _gathers(runs[False][2])  # no stack gathered whole
    return
  # Control: slicing every row out slices each of gate, up and down once per layer.
  assert off == 3 * 2, (name, off)
  assert on == 0, (name, on)


def test_a_stack_row_reads_its_row_and_a_wrong_row_fails():
  stack = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
  row = StackRow(stack, 1)
  assert row.shape == (3, 4, 5) and row.ndim == 3 and row.dtype == jnp.float32
  np.testing.assert_array_equal(materialize(row), stack[1])
  for e in range(3):
    np.testing.assert_array_equal(row.at(jnp.int32(e)), stack[1, e])
  assert not np.array_equal(StackRow(stack, 0).at(jnp.int32(2)), stack[1, 2])  # the other layer's expert
  leaves, tree = jax.tree.flatten(row)
  assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).index == 1  # the index is static
