"""Weight gradients reduce-scattered to their parameter sharding (issue 55, item 2).

XLA:TPU reduce-scatters a bfloat16 weight gradient over a leading dim, as a fusion whose computation all-reduces and
keeps this device's dynamic-slice; over the minor dim it all-reduces some whole and slices them. The census counts
such a fusion as the reduce-scatter it is (analysis/census.reduce_scatter_fusions). There (the scatter_leading
key: auto is its tpu rule on TPU, sharding.scatter_rule) a gradient whose FSDP dim is the kernel's minor one (down
"fd", o "nhd", the embedding table [V, D]), where XLA:TPU would all-reduce it (sharding.minor_scatter_all_reduced),
is formed with that dim leading and its shard put back in the kernel's order (nn/dense.weight_grad,
sharding.take_rows). The TPU program's check is in tests/test_compile.py (test_tpu_weight_gradients_are_reduce_scattered);
here, on CPU, the census's reading of XLA:TPU's form, and the numbers: the TPU path run on CPU (scatter_leading=all:
wherever the minor dim is sharded) gives
bit-identical float32 loss and gradients, under explicit and auto; so does the blockwise head's exchange of its
gradient's partials (nn/head_loss.py).
"""
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.analysis import census as C
from meshlm.config import load_config
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel import sharding as S

DN = sys.modules["meshlm.nn.dense"]  # the module (meshlm.nn.dense is also the function's name)

# XLA:TPU's reduce-scatter of a [512, 1024] gradient over 4 devices inside a 2-trip loop (trimmed from a v5p
# program), beside an all-reduce of a [1024, 512] one and a slice after it, not fused: that one is an all-reduce.
TPU_HLO = """HloModule m

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

%all-reduce-scatter.3.clone.1 (input.12: bf16[512,1024]) -> bf16[128,1024] {
  %input.12 = bf16[512,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %all-reduce.64 = bf16[512,1024]{1,0:T(8,128)(2,1)} all-reduce(%input.12), channel_id=36, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add, frontend_attributes={from-cross-replica-sharding="true"}
  %partition-id.28 = u32[] partition-id()
  %constant.1110 = u32[] constant(128)
  %multiply.124 = u32[]{:T(128)} multiply(%partition-id.28, %constant.1110)
  %constant.1111 = u32[] constant(0)
  ROOT %dynamic-slice.306 = bf16[128,1024]{1,0:T(8,128)(2,1)} dynamic-slice(%all-reduce.64, %multiply.124, %constant.1111), dynamic_slice_sizes={128,1024}
}

%body (p: (s32[], bf16[512,1024])) -> (s32[], bf16[512,1024]) {
  %p = (s32[], bf16[512,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %g = bf16[512,1024]{1,0} get-tuple-element(%p), index=1
  %fusion.411 = bf16[128,1024]{1,0:T(8,128)(2,1)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.3.clone.1, metadata={op_name="jit(step)/transpose(jvp())/while/body/layers/mlp/gate/btd,btf->df/dot_general"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[512,1024]) tuple(%next, %g)
}

%cond (p: (s32[], bf16[512,1024])) -> pred[] {
  %p = (s32[], bf16[512,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(2)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[512,1024], b: bf16[1024,512]) -> bf16[1024,512] {
  %a = bf16[512,1024]{1,0} parameter(0)
  %b = bf16[1024,512]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[512,1024]) tuple(%zero, %a)
  %loop = (s32[], bf16[512,1024]) while(%init), condition=%cond, body=%body
  %all-reduce.68 = bf16[1024,512]{1,0:T(8,128)(2,1)} all-reduce(%b), channel_id=28, replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/layers/mlp/down/btf,btd->fd/dot_general"}
  ROOT %get-tuple-element.3418 = bf16[1024,512]{1,0:T(8,128)(2,1)} copy(%all-reduce.68)
}
"""


def test_census_counts_xla_tpus_reduce_scatter_fusion_as_a_reduce_scatter():
  counts, _ = C.hlo_counts(TPU_HLO)
  cols = counts["collectives"]
  rs, ar = cols["reduce-scatter"], cols["all-reduce"]
  # The fusion: one reduce-scatter per trip, its bytes the shard it leaves on each device, under the loop's scope.
  assert (rs["count"], rs["bytes"]) == (2, 2 * 128 * 1024 * 2), rs
  assert [c["scope"] for c in rs["calls"]] == ["layers/mlp/gate backward"], rs["calls"]
  # The all-reduce inside it is not counted apart; the unfused one is an all-reduce of the whole array.
  assert (ar["count"], ar["bytes"]) == (1, 1024 * 512 * 2), ar
  # Control: a computation that all-reduces but roots in something else than a slice of it is no reduce-scatter.
  other = TPU_HLO.replace("ROOT %dynamic-slice.306", "%dynamic-slice.306").replace(
      "%constant.1111 = u32[] constant(0)\n", "%constant.1111 = u32[] constant(0)\n  ROOT %r = u32[] copy(%constant.1111)\n")
  cols = C.hlo_counts(other)[0]["collectives"]
  assert cols["reduce-scatter"]["count"] == 0 and cols["all-reduce"]["count"] == 3, cols


def test_scatter_order_moves_only_a_minor_fsdp_dim_xla_would_all_reduce():
  """Which weight gradients are formed dy first under the tpu rule: those whose kernel's minor dim is sharded over a
  mesh axis the batch is (the reduction's) and whose bfloat16 shards XLA:TPU would all-reduce (an odd multiple of 128
  wide); under all, every sharded one; under none (auto's rule off TPU), none."""
  x_btd, x_bnth = P("fsdp", None, None), P("fsdp", None, None, None)
  with jax.set_mesh(make_mesh(load_config("cpu_devices=4", "mesh.fsdp=4"))):
    order = lambda eqn, k_spec, x_spec, shape, itemsize, rule="tpu": DN.scatter_order(  # noqa: E731
        eqn, k_spec, x_spec, shape, itemsize, rule)
    assert order("btf,fd->btd", P(None, "fsdp"), x_btd, (1024, 512), 2) == "df"  # down, shards of 128
    assert order("btf,fd->btd", P(None, "fsdp"), x_btd, (1024, 3584), 2) == "df"  # 896 = 7 x 128
    assert order("btf,fd->btd", P(None, "fsdp"), x_btd, (14336, 4096), 2) is None  # 1024: XLA scatters
    assert order("btf,fd->btd", P(None, "fsdp"), x_btd, (1024, 512), 4) is None  # float32: XLA scatters
    assert order("bnth,nhd->btd", P(None, None, "fsdp"), x_bnth, (4, 128, 512), 2) == "dnh"  # o
    assert order("bnth,nhd->btd", P("tensor", None, "fsdp"), x_bnth, (4, 128, 512), 2) == "dnh"
    assert order("btd,df->btf", P("fsdp", None), x_btd, (512, 1024), 2) is None  # gate: d leads already
    assert order("btd,dnh->bnth", P("fsdp", None, None), x_btd, (512, 4, 128), 2) is None  # q
    assert order("btf,fd->btd", P(None, None), x_btd, (1024, 512), 2) is None  # nothing sharded
    assert S.leading_spec(P(None, "fsdp"), (768, 512), 2, "tpu") == P("fsdp", None)  # the embedding table
    assert S.leading_spec(P(None, "fsdp"), (768, 4096), 2, "tpu") is None  # shards of 1024: XLA scatters
    assert S.leading_spec(P(None, "fsdp"), (766, 512), 2, "tpu") is None  # fsdp does not divide V
    assert S.leading_spec(P("fsdp", None), (768, 512), 2, "tpu") is None  # V sharded already
    # all: every gradient whose minor dim is sharded, whatever its width and dtype; still none whose d leads.
    assert order("btf,fd->btd", P(None, "fsdp"), x_btd, (14336, 4096), 4, "all") == "df"
    assert order("btd,df->btf", P("fsdp", None), x_btd, (512, 1024), 2, "all") is None
    assert S.leading_spec(P(None, "fsdp"), (768, 4096), 4, "all") == P("fsdp", None)
    # none, and auto on this CPU (the rule derived from the program's platform): none.
    assert S.scatter_rule("auto") == "none" and S.scatter_rule("tpu") == "tpu"
    assert order("btf,fd->btd", P(None, "fsdp"), x_btd, (1024, 512), 2, "none") is None
    assert S.leading_spec(P(None, "fsdp"), (768, 512), 2, "none") is None


BASE = ("model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.compute_dtype=float32", "train.seq_len=32",
        "train.per_device_batch_size=2")


def _grads(mode: str, leading: bool, *extra: str, patch=None):
  """(loss, grads as numpy, the census's transpose-of-dot pairs of the lowered loss and gradients, its text).
  leading: scatter_leading=all, the TPU path wherever a weight gradient's minor dim is sharded (llama2-tiny's float32
  shards of 64 are none of those XLA:TPU would all-reduce); else none."""
  from seams import random_batch
  from meshlm.train import step as ST
  mp = pytest.MonkeyPatch()
  if patch is not None:
    patch(mp)
  try:
    jax.clear_caches()
    step = ST.build_train_step(load_config(*BASE, f"shard_mode={mode}", f"scatter_leading={'all' if leading else 'none'}",
                                           *extra))
    state = step.init_state(jax.random.key(0))
    batch = random_batch(step)
    with jax.set_mesh(step.mesh):
      fn = jax.jit(lambda p, b: ST.grads_and_loss(step.cfg, p, b, step.loss_fn, step.batch_spec, step.trainable)[:2])
      lowered = fn.lower(state.params, batch)
      loss, grads = lowered.compile()(state.params, batch)
  finally:
    mp.undo()
    jax.clear_caches()
  _, pairs, _ = C.stablehlo_counts(lowered.as_text(), ())
  return np.asarray(loss), jax.tree.map(np.asarray, grads), pairs, lowered.as_text()


def _assert_same(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_the_tpu_path_on_cpu_is_bit_identical(mode):
  """The dy-first weight gradients and the embedding table's detour (reduce-scatter over V, then to its D
  sharding), run on CPU: float32 loss and every gradient bit-identical to the kernel-order path (the same
  products summed in the same order; only the dot's output order and where the sum is split change). The path is
  taken: down's and o's weight gradients are now a dot and a transpose of its shard, a blocked pair to the census (the
  kernel-order path has none: its dW needs no transpose)."""
  loss, grads, pairs, _ = _grads(mode, True)
  ref_loss, ref_grads, ref_pairs, _ = _grads(mode, False)
  assert loss == ref_loss
  _assert_same(grads, ref_grads)
  # llama2-tiny: down [F, D] = [768, 256], o [N, H, D] = [8, 32, 256].
  scattered = {tuple(p["shape"]) for p in pairs if p["weight_grad"] and p["kind"] == "blocked"}
  assert scattered == {(768, 256), (8, 32, 256)}, pairs
  assert not any(p["weight_grad"] and p["kind"] == "blocked" for p in ref_pairs), ref_pairs


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_gradients_exchange_is_bit_identical(tied):
  """The blockwise loss's head gradient: each device's partials exchanged to its slice of the kernel (an
  all-to-all) and summed there, not summed whole and sliced (which XLA:TPU all-reduces: nn/head_loss.py). float32
  loss and gradients bit-identical to the sum-then-slice form (its control: the exchange left out). Under explicit,
  where the exchange is head_loss's only `_pin`."""
  from meshlm.nn import head_loss
  keys = ("loss_impl=blockwise", "loss_block=16", "train.seq_len=64", f"model.tie_embeddings={str(tied).lower()}")
  loss, grads, _, text = _grads("explicit", False, *keys)
  ref_loss, ref_grads, _, ref_text = _grads("explicit", False, *keys,
                                            patch=lambda mp: mp.setattr(head_loss, "_pin", lambda a, spec: a))
  assert text != ref_text  # the exchange is in the program
  assert loss == ref_loss
  _assert_same(grads, ref_grads)
