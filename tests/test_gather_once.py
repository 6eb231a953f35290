"""Kernels gathered once before the layer scan (nn/gather_once.py; the parts' `prepare`): the MoE router
(issue 11, speedup 5) and the attention query kernel. Under FSDP one all-gather of each stacked kernel
([L, D, E], [L, D, N, H]) before the layers and none in the scanned body; each layer's router gradient
stays a per-layer [D, E] reduction in the backward loop (no full-size reduction of the stack); loss and
gradients bit-identical to the per-layer-gather path, under explicit and auto."""
import jax
import numpy as np
import pytest

from meshlm.analysis import census as C
from meshlm.config import load_config
from meshlm.nn import gather_once as GO

# qwen3-moe-tiny: a dense layer, then 3 MoE layers in a scan; router [3, 256, 8] sharded on fsdp.
from seams import compiled_grads

BASE = ("model=qwen3-moe-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.compute_dtype=bfloat16", "train.seq_len=32",
        "train.per_device_batch_size=1")
L, D, E = 3, 256, 8
Q = (D, 8, 48)  # the query kernel [D, N, H]; its stacks: one dense layer, then 3 MoE layers



def _run(mode: str, gather_once: bool):
  """(loss, grads as numpy, router collectives of the compiled forward+backward)."""
  mp = pytest.MonkeyPatch()
  if not gather_once:
    # The plain path: no gathered copy, each layer's kernel slice goes to its projection as stored.
    mp.setattr(GO, "gather_stack", lambda *a, **k: None)
    mp.setattr(GO, "gathered", lambda kernel, full, axes: kernel)
  try:
    loss, grads, compiled = compiled_grads(load_config(*BASE, f"shard_mode={mode}"))
  finally:
    mp.undo()
    jax.clear_caches()
  counts, mod = C.hlo_counts(compiled.as_text())
  in_loop = {c for c, m in mod.multipliers.items() if m > 1}
  all_gathers = [ins for ins in mod.instrs() if ins.opcode in ("all-gather", "all-gather-start") and ins.out is not None]
  # Router gathers by shape: no other array here ends in [D, E], and JAX >= 0.11 names the per-layer
  # gather after the nested jit whose result it reshards (".../while/body/jit"), not the router.
  gathers = [(ins.out.shape, ins.comp in in_loop) for ins in all_gathers if ins.out.shape[-2:] == (D, E)]
  q_gathers = [(ins.out.shape, ins.comp in in_loop) for ins in all_gathers if ins.out.shape[-3:] == Q]
  # The gathered stacks as the layers read them (XLA:CPU widens a bf16 all-gather to f32 and narrows it after,
  # its float normalization; XLA:TPU gathers bf16): the dtypes of the q_gather_once scope's stack-shaped values.
  q_copies = {(ins.out.shape, ins.out.dtype) for ins in mod.instrs()
              if "q_gather_once" in ins.op_name and ins.out is not None and ins.out.shape[-3:] == Q
              and ins.opcode != "all-gather"}
  # Router-gradient reductions: arrays of a router's shape (a layer's or the stack's, whole or an fsdp
  # shard, any dim order) in reducing collectives (XLA combines several into one tuple).
  router_shapes = {tuple(sorted(s)) for s in ((D, E), (D // 4, E), (L, D, E), (L, D // 4, E))}
  reductions = [(tuple(a.shape), ins.comp in in_loop) for ins in mod.instrs()
                if ins.opcode in ("all-reduce", "all-reduce-start", "reduce-scatter", "reduce-scatter-start")
                for a in ins.result if tuple(sorted(d for d in a.shape if d != 1)) in router_shapes]
  return np.asarray(loss), jax.tree.map(np.asarray, grads), gathers, reductions, (q_gathers, q_copies)


@pytest.fixture(scope="module", params=["explicit", "auto"])
def arms(request):
  return {on: _run(request.param, on) for on in (True, False)}


def test_one_router_gather_before_the_scan_none_inside(arms):
  _, _, gathers, _, _ = arms[True]
  assert gathers == [((L, D, E), False)]
  # Control: without it the scanned body gathers each layer's [D, E] slice (forward, and the
  # backward again), and nothing gathers the stack.
  _, _, plain, _, _ = arms[False]
  assert plain and all(shape == (D, E) and looped for shape, looped in plain)


def test_one_query_gather_per_stack_before_the_scan_none_inside(arms):
  *_, (q_gathers, q_copies) = arms[True]
  # The dense layer's stack [1, D, N, H] and the MoE layers' [3, D, N, H], each gathered once, outside
  # every loop.
  assert sorted(q_gathers) == [((1,) + Q, False), ((L,) + Q, False)], q_gathers
  # Cast to the compute dtype before the gather: the gathered copies, alive through the forward and the
  # backward, are bf16 (half the float32 parameters' bytes); the gradient still reaches the float32 kernel
  # (bit-identical to the plain path: the test below).
  assert ((L,) + Q, "bf16") in q_copies and ((1,) + Q, "bf16") in q_copies, q_copies
  # Control: without it the scan's body gathers each MoE layer's [D, N, H] slice (forward and backward).
  *_, (plain, plain_copies) = arms[False]
  assert any(shape == Q and looped for shape, looped in plain), plain
  assert not any(shape == (L,) + Q for shape, _ in plain) and not plain_copies


def test_router_gradient_stays_per_layer(arms):
  _, _, _, reductions, _ = arms[True]
  # A per-layer [D, E] (or its [D/fsdp, E] shard) reduction in the backward loop; nothing of the
  # stack's [L, D, E] size.
  assert reductions and all(looped and len(shape) == 2 for shape, looped in reductions), reductions


def test_loss_and_gradients_match_the_per_layer_gather(arms):
  loss_on, grads_on, _, _, _ = arms[True]
  loss_off, grads_off, _, _, _ = arms[False]
  # Bit-identical on XLA:CPU with the pinned JAX (measured: loss and every gradient, both modes).
  np.testing.assert_array_equal(loss_on, loss_off)
  router_on = grads_on["layers"]["moe"]["moe"]["router"]
  assert router_on.shape == (L, D, E) and np.all(np.any(router_on != 0, axis=(1, 2)))  # every layer's
  for a, b in zip(jax.tree.leaves(grads_on), jax.tree.leaves(grads_off)):
    np.testing.assert_array_equal(a, b)
