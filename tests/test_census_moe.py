"""The census's MoE fields: sorts forward/backward, gathers and scatters in MoE layers (the moe part's declared
counter, stablehlo.moe), weight-gradient dots by parameter, optimization barriers (the expert-weight-gradient
barrier), counted per step (call sites expanded, scan bodies times their trip count)."""
import jax
import pytest

from meshlm.analysis import census as C
from meshlm.analysis import golden
from meshlm.analysis import stablehlo as SH
from meshlm.config import load_config

from moe_helpers import with_settings

# A hand-written module: @body runs in a 3-trip while; @shared is called from main and from @body,
# once under a transpose(...) path; a shard_map region names its ops' scopes.
TEXT = """module @m {
  func.func public @main(%arg0: tensor<4x8xf32>, %arg1: tensor<2x8x16xf32>) -> tensor<4xi32> {
    %0 = func.call @shared(%arg0) : (tensor<4x8xf32>) -> tensor<4xi32> loc(#loc1)
    %c = stablehlo.constant dense<0> : tensor<i32> loc(#loc0)
    %1:2 = stablehlo.while(%iterArg = %c, %iterArg_1 = %arg0) : tensor<i32>, tensor<4x8xf32>
    cond {
      %c_2 = stablehlo.constant dense<3> : tensor<i32> loc(#loc0)
      %2 = stablehlo.compare LT, %iterArg, %c_2, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1> loc(#loc0)
      stablehlo.return %2 : tensor<i1> loc(#loc0)
    } do {
      %2 = func.call @body(%iterArg_1) : (tensor<4x8xf32>) -> tensor<4x8xf32> loc(#loc2)
      stablehlo.return %iterArg, %2 : tensor<i32>, tensor<4x8xf32> loc(#loc0)
    } loc(#loc0)
    return %0 : tensor<4xi32> loc(#loc0)
  } loc(#loc0)
  func.func private @body(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = func.call @shared(%arg0) : (tensor<4x8xf32>) -> tensor<4xi32> loc(#loc3)
    %1 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"fsdp"}, {}]>] out_shardings=[<@mesh, [{"fsdp"}, {}]>] manual_axes={"fsdp"} (%arg1: tensor<1x8xf32>) {
      %2 = "stablehlo.gather"(%arg1, %arg1) <{dimension_numbers = #stablehlo.gather<offset_dims = [1]>}> : (tensor<1x8xf32>, tensor<1x8xf32>) -> tensor<1x8xf32> loc(#loc4)
      %3 = stablehlo.dot_general %2, %2, contracting_dims = [0] x [0] : (tensor<1x8xf32>, tensor<1x8xf32>) -> tensor<8x16xf32> loc(#loc5)
      sdy.return %2 : tensor<1x8xf32> loc(#loc0)
    } : (tensor<4x8xf32>) -> tensor<4x8xf32> loc(#loc6)
    return %1 : tensor<4x8xf32> loc(#loc0)
  } loc(#loc0)
  func.func private @shared(%arg0: tensor<4x8xf32>) -> tensor<4xi32> {
    %0:2 = "stablehlo.sort"(%arg0, %arg0) <{dimension = 0 : i64}> ({
    ^bb0(%arg1: tensor<f32>, %arg2: tensor<f32>):
      %1 = stablehlo.compare LT, %arg1, %arg2 : (tensor<f32>, tensor<f32>) -> tensor<i1> loc(#loc0)
      stablehlo.return %1 : tensor<i1> loc(#loc0)
    }) : (tensor<4x8xf32>, tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) loc(#loc7)
    return %0#0 : tensor<4xi32> loc(#loc0)
  } loc(#loc0)
}
#loc0 = loc(unknown)
#loc1 = loc("jit(f)/jvp(head)/argsort")
#loc2 = loc("jit(f)/transpose(jvp())/while/body/closed_call")
#loc3 = loc("layers/argsort")
#loc4 = loc("gather/gather")
#loc5 = loc("experts/down/dot_general")
#loc6 = loc("layers/moe/shard_map")
#loc7 = loc("sort")
"""


def test_counts_per_step_through_calls_loops_and_shard_map():
  mod = SH.parse(TEXT)
  assert list(mod.trip_counts.values()) == [3]
  got = C.executed_counts(mod)
  # @shared's sort: once from main (forward), 3 times from the loop body (a transpose path: backward).
  assert got["sorts"] == {"forward": 1, "backward": 3}
  # The gather sits in the shard_map, whose scope "layers/moe/shard_map" puts it in a MoE layer.
  assert got["moe"]["gathers"] == {"forward": 0, "backward": 3}
  # The [8, 16] dot result is a slice of the [2, 8, 16] argument: a weight gradient, named by its scope.
  assert got["weight_grad_dots"] == {"layers/moe/experts/down": 3}
  # Controls: a loop bound that is not a constant counts the body once; without the shard_map's
  # location its ops lose the "moe" scope.
  once = C.executed_counts(SH.parse(TEXT.replace("dense<3>", "dense<3> : tensor<i32>\n      %c_3 = stablehlo.constant dense<4>")))
  assert once["sorts"] == {"forward": 1, "backward": 1}
  assert C.executed_counts(SH.parse(TEXT.replace('"layers/moe/shard_map"', '"shard_map"')))["moe"]["gathers"]["backward"] == 0
  # A dot that keeps an operand's leading (token) axis is an input gradient, whatever its shape.
  dx = TEXT.replace("contracting_dims = [0] x [0]", "contracting_dims = [1] x [0]")
  assert C.executed_counts(SH.parse(dx))["weight_grad_dots"] == {}


BASE = ("cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1", "train.seq_len=32", "shard_mode=explicit")


def _census(preset: str, *over: str) -> dict:
  jax.clear_caches()  # monkeypatched variants must not reuse a cached trace
  return golden.stablehlo_census(load_config(f"model={preset}", *BASE, *over))["stablehlo"]


def _golden(preset: str) -> dict:
  """The preset's census as _census(preset) gives it, read from its golden file's explicit arm (the same config:
  golden.BASE under explicit; tests/test_analysis.py holds the file to the lowering), nested like a census."""
  import json
  import os
  with open(os.path.join(os.path.dirname(__file__), "golden", "census", f"{preset}.json")) as f:
    doc = json.load(f)
  assert tuple(doc["base"]) + ("shard_mode=explicit",) == BASE and not doc.get("shrink"), doc["base"]
  out: dict = {}
  for key, value in doc["counts"]["explicit"].items():
    *path, leaf = key.removeprefix("stablehlo.").split(".")
    node = out
    for k in path:
      node = node.setdefault(k, {})
    node[leaf] = value
  return out


def _wgrad(result: dict, name: str) -> dict:
  return {k: v for k, v in result["weight_grad_dots"].items() if k.endswith("/" + name)}


@pytest.fixture(scope="module")
def qwen():
  return _golden("qwen3-moe-tiny")


def test_qwen3_moe_tiny_one_sort_per_moe_layer_forward_none_backward(qwen):
  # 4 layers: a dense one, then 3 MoE layers in a scan (trip count 3).
  assert qwen["sorts"] == {"forward": 3, "backward": 0}
  assert qwen["weight_grad_dots"]["layers/mlp/moe/router"] == 3
  assert qwen["weight_grad_dots"]["layer_0/mlp/gate"] == 1  # the dense layer
  # Per-expert dots in the scan over row blocks: gate and up per block, down per block (down's in the fused GLU-down
  # backward, under the down kernel's own scope).
  down = qwen["weight_grad_dots"]["layers/mlp/moe/experts/down"]
  assert qwen["weight_grad_dots"]["layers/mlp/moe/experts/gate_up"] == 2 * down > 0
  # No row scatters either way: the unsort's backward gathers by perm and the dispatch's gather's backward gathers by
  # the inverse permutation (custom VJPs), two gathers per layer in the backward, as the forward's two.
  assert qwen["moe"]["gathers"] == {"forward": 6, "backward": 6}


def test_expert_grad_barrier_is_in_the_step_once_per_moe_layer(qwen, monkeypatch):
  """moe_mlp's default grad_barrier=True reaches the model: one optimization barrier per MoE layer,
  in the backward only (the preset passes no grad_barrier, so this is the default's)."""
  assert qwen["optimization_barriers"] == {"forward": 0, "backward": 3}
  # Control: the same step with the barrier off has none.
  from meshlm.nn import moe
  monkeypatch.setattr(moe, "moe_mlp", with_settings(moe.moe_mlp, grad_barrier=False))
  assert _census("qwen3-moe-tiny")["optimization_barriers"] == {"forward": 0, "backward": 0}


def test_mixtral_tiny_unrolled_layers(monkeypatch):
  r = _golden("mixtral-tiny")
  assert r["sorts"] == {"forward": 2, "backward": 0}
  # Unrolled layers hand the expert loop its kernels in their stacks (StackRow): no barrier on them, whose
  # cotangents are stack-shaped pads that XLA fuses across layers. With every row sliced out
  # (stack_rows=false), the barrier is back, one per MoE layer.
  assert r["optimization_barriers"] == {"forward": 0, "backward": 0}
  assert _census("mixtral-tiny", "stack_rows=false")["optimization_barriers"] == {"forward": 0, "backward": 2}
  assert _wgrad(r, "moe/router") == {"layer_0/mlp/moe/router": 1, "layer_1/mlp/moe/router": 1}


def test_remat_without_the_save_names_sorts_again_in_the_backward(monkeypatch):
  """remat=full saves the permutation (0 sorts in the backward); without the names the moe part
  declares (Compute.remat_save_names) the backward replays the argsort, once per MoE layer: the census
  sees it."""
  import dataclasses
  from meshlm.models import registry
  assert _census("qwen3-moe-tiny", "remat=full")["sorts"] == {"forward": 3, "backward": 0}
  fam = registry.get("qwen3_moe")
  kinds = {k: dataclasses.replace(v, ffn=dataclasses.replace(v.ffn, compute=dataclasses.replace(
      v.ffn.compute, remat_save_names=()))) for k, v in fam.kinds.items()}
  monkeypatch.setattr(registry, "get", lambda name: dataclasses.replace(fam, kinds=kinds))
  assert _census("qwen3-moe-tiny", "remat=full")["sorts"] == {"forward": 3, "backward": 3}


def test_argsort_unsort_adds_a_sort_per_layer(monkeypatch):
  """The plain unsort (argsort of perm) is a second sort per MoE layer."""
  from meshlm.nn import moe
  monkeypatch.setattr(moe, "moe_mlp", with_settings(moe.moe_mlp, unsort_impl="argsort"))
  assert _census("qwen3-moe-tiny")["sorts"] == {"forward": 6, "backward": 0}


# A frozen router's missing weight-gradient dots (and every other kernel's kept, a trained router's 3 as the control):
# tests/test_rl.py's test_census_of_the_rl_step_has_no_router_weight_gradient_dot, on the RL step, which is this
# train step with RL's loss (the same grads_and_loss and train.freeze mask) and router replay on.


def test_dense_preset_has_no_sorts_and_seven_weight_gradients_per_layer():
  r = _census("llama2-tiny")
  assert r["sorts"] == {"forward": 0, "backward": 0}
  assert r["optimization_barriers"] == {"forward": 0, "backward": 0}
  assert r["moe"] == {"gathers": {"forward": 0, "backward": 0}, "scatters": {"forward": 0, "backward": 0}}
  per_layer = {k.split("/", 1)[1] for k in r["weight_grad_dots"] if k.startswith("layer_0/")}
  assert per_layer == {"attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down"}
  assert sum(r["weight_grad_dots"].values()) == 2 * 7 + 1  # and the LM head


def test_summary_and_compare_show_the_moe_fields(qwen):
  from meshlm.analysis.compare import render
  s = C.summary({"stablehlo": qwen})
  assert s["stablehlo.sorts.forward"] == 3 and s["stablehlo.sorts.backward"] == 0
  assert s["stablehlo.weight_grad_dots.layers/mlp/moe/router"] == 3
  assert s["stablehlo.optimization_barriers.forward"] == 0 and s["stablehlo.optimization_barriers.backward"] == 3
  table = C.render({"stablehlo": qwen, "hlo": {"collectives": {}}})
  assert [line.split() for line in table.splitlines() if "optimization_barriers" in line] == [
      ["stablehlo.optimization_barriers.forward", "0"], ["stablehlo.optimization_barriers.backward", "3"]]
  frozen = dict(s, **{"stablehlo.optimization_barriers.backward": 0})
  del frozen["stablehlo.weight_grad_dots.layers/mlp/moe/router"]
  text = render({"arms": {"a": s, "b": frozen}, "identical_op_counts": False, "diff": []})
  row = next(line for line in text.splitlines() if "weight_grad_dots.layers/mlp/moe/router" in line)
  assert row.split()[1:] == ["3", "-", "*"]
  row = next(line for line in text.splitlines() if "optimization_barriers.backward" in line)
  assert row.split()[1:] == ["3", "0", "*"]
