"""analysis/cost.py's counts beyond the dots: the splash kernel's custom calls (counted from their shapes, the
skipped blocks left out) and loops whose trip count is read from where their bound comes from.

The splash rows compile a tiny attention gradient for one v5p chip through libtpu (nothing runs); the loop rows
compile small programs for the CPU.
"""
from __future__ import annotations

import importlib.util

import pytest

from meshlm.analysis import cost as C
from meshlm.analysis import hlo as H

tpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                         reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")

# q [B, N, T, H], k and v [B, K, T, H]: GQA, two 512-row blocks per sequence (the causal mask skips 1 of 4).
B, N, K, T, HD = 2, 4, 2, 1024, 128


@pytest.fixture(scope="module")
def splash_program():
  """(the HLO text, XLA's cost_analysis) of the splash core's forward and backward compiled for one v5p chip."""
  import jax
  import jax.numpy as jnp

  from meshlm.nn import splash_attention as SPA
  from meshlm.nn.splash_rule import Blocks
  from meshlm.parallel import topology as TP
  mesh = jax.sharding.Mesh(TP.devices(TP.parse("v5p:1x1x1"))[:1], ("x",))

  # The three separate kernels (forward, dq, dkv) these tests count one by one, over 2 x 2 blocks of 512: the
  # two-kernel backward at block 512, not the defaults (block 1024, whose one block would keep every pair, and the
  # fused backward there, whose one kernel cost.py counts as dkv_fused).
  def loss(q, k, v):
    blocks = Blocks(512, 512, 512, 512, 512, 512, 512, 512, length=T)
    return jnp.sum(SPA.splash_attention(q, k, v, scale=HD ** -0.5, blocks=blocks, interpret=False).astype(jnp.float32))
  S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(  # noqa: E731
      mesh, jax.sharding.PartitionSpec()))
  with jax.set_mesh(mesh):
    c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(S(B, N, T, HD), S(B, K, T, HD), S(B, K, T, HD)).compile()
  return c.as_text(), c.cost_analysis()


def _analytic(share: float) -> dict[str, float]:
  """The kernels' matmul FLOPs by hand: per (head, query, key) pair the forward's q k^T and p v (2 x 2H), dq's
  scores, dp and dq (3 x 2H), dkv's scores, dv, dp and dk (4 x 2H), over the share of key blocks computed."""
  pairs = B * N * T * T * share
  return {"fwd": 2 * pairs * 2 * HD, "dq": 2 * pairs * 3 * HD, "dkv": 2 * pairs * 4 * HD}


@tpu
@pytest.mark.ci_must_run
def test_splash_custom_calls_are_counted_from_their_shapes(splash_program):
  """Each of the three kernels (forward, dq, dkv) counts its matmuls over the 3 of 4 blocks the causal mask keeps,
  read from the block mask XLA prints (exact). Controls: the dots alone (the count before custom calls were read)
  see none of it, XLA's cost_analysis neither, and every block (no skipping) is 4/3 of it."""
  text, xla = splash_program
  mod = H.parse(text)
  calls = {i.name.split("_")[2]: C.splash_flops(mod, i) for i in mod.instrs() if i.opcode == "custom-call"}
  want = _analytic(3 / 4)
  assert calls == {k: (v, False) for k, v in want.items()}
  total, estimated = C.custom_call_flops(mod)
  assert total == sum(want.values()) and estimated == []
  assert C.flops(mod) < 0.01 * total and xla["flops"] < 0.01 * total
  assert sum(_analytic(1.0).values()) == pytest.approx(4 / 3 * total)


@tpu
@pytest.mark.ci_must_run
def test_a_mask_too_large_to_print_is_estimated_and_named(splash_program, monkeypatch):
  """Where XLA prints the block mask as {...} (a long sequence's), the share is the causal triangle of the mask's
  n x n blocks, (n + 1) / 2n, and the call is named as estimated (here n = 2: the same 3/4); the roofline lists it."""
  from meshlm.analysis import aot
  text, xla = splash_program
  elided = text.replace("constant({ { { 1, 0 }, { 2, 1 } } })", "constant({...})")
  assert elided != text
  mod = H.parse(elided)
  total, estimated = C.custom_call_flops(mod)
  assert total == sum(_analytic(3 / 4).values())
  assert len(estimated) == 3 and all(n.startswith("splash_mha_") for n in estimated)
  chip = aot.Chip(kind="TPU v5", platform="tpu", devices=1, devices_per_chip=1, hbm_bytes=None, hbm_source=None,
                  peak_flops=459e12, hbm_bandwidth=2765e9)
  r = aot.roofline(elided, xla, chip, model_flops=None)
  assert r["custom_call_flops"] == total and r["flops"] == r["dot_flops"] + total
  assert any(line.startswith("custom calls: 3 splash kernels") for line in r["estimated"])
  assert not any(line.startswith("custom calls") for line in aot.roofline(text, xla, chip, None)["estimated"])


@tpu
@pytest.mark.ci_must_run
def test_the_ragged_dot_kernel_counts_each_row_against_one_groups_kernel():
  """jax.lax.ragged_dot (the MoE grouped matmul's `ragged`, what auto builds for a TPU) with its gradients, compiled
  for v5p: XLA:TPU writes each as a ragged-dot custom call, the forward and dx ([M, K] x [G, K, N]) and dW (ragged
  contracting, -> [G, K, N]), each 2 M K N. Control: the dots alone (the count before the kernel was read) see none
  of it."""
  import jax
  import jax.numpy as jnp
  from meshlm.parallel import topology as TP
  M, K, N, G = 64, 256, 384, 8
  sharding = jax.sharding.SingleDeviceSharding(TP.devices(TP.parse("v5p:1x1x1"))[0])
  S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731

  def loss(x, w, sizes):
    return jnp.square(jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32)).sum()  # the backward needs y

  args = (S((M, K), jnp.bfloat16), S((G, K, N), jnp.bfloat16), S((G,), jnp.int32))
  mod = H.parse(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text())
  calls = [C.ragged_dot_flops(mod, i) for i in mod.instrs() if i.opcode == "custom-call"]
  counted = [f for f in calls if f is not None]
  assert counted == [2.0 * M * K * N] * 3, counted
  total, estimated = C.custom_call_flops(mod)
  assert total == 3 * 2.0 * M * K * N and len(estimated) == 3 and all(n.startswith("ragged-dot") for n in estimated)
  assert C.flops(mod) < 0.01 * total


# --------------------------------------------------------------------------------- loops bounded by an outer loop

def _flash_program(window: int | None = None):
  """The flash core's forward and backward (nn/flash_attention.py) compiled for the CPU: 8 query blocks of 64, each
  running an inner loop over the key blocks it sees (and the backward over the query blocks that see each key
  block), whose bounds follow from the outer block index."""
  import jax
  import jax.numpy as jnp

  from meshlm.nn.flash_attention import flash_attention

  def loss(q, k, v):
    return jnp.sum(flash_attention(q, k, v, scale=0.1, block=FB, window=window))
  S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(S(1, FN, FT, FH), S(1, 1, FT, FH), S(1, 1, FT, FH)).compile()


FT, FN, FH, FB = 512, 2, 64, 64  # 8 blocks


def test_a_causal_block_loop_counts_each_of_its_outer_loops_iterations():
  """Query block i runs i + 1 key-block tiles: the inner loops' trips are read from the outer loop's counter, 36 of
  8 x 8 tiles (4.5 per start). The compiled program (XLA:CPU at the locked JAX) holds 6 tile-sized matmuls in the
  inner loops' bodies and 1 in the backward's outer scan (the key block against a broadcast constant, left outside
  the inner loop): (36 x 6 + 8) [64 x 64] x [64 x 128] matmuls. Control: counted once per start, as before, 8 of
  the 36 tiles."""
  mod = H.parse(_flash_program().as_text())
  inner = [i for i in mod.instrs() if i.opcode == "while" and i.trip_count is None]
  assert [i.mean_trips for i in inner] == [4.5, 4.5] and mod.unread_loops() == []
  tile = 2 * FB * FB * FN * FH
  assert C.flops(mod) == (36 * 6 + 8) * tile
  for i in inner:
    i.mean_trips = None
  mod.multipliers = H._multipliers(mod.comps, mod.entry)
  assert C.flops(mod) == (8 * 6 + 8) * tile and len(mod.unread_loops()) == 2


def test_a_windowed_block_loop_counts_the_tiles_of_its_band():
  """Under a 150-position window query block i sees key blocks max(64 i - 149, 0) // 64 .. i: 26 tiles in all (3.25
  per start), in both the forward's and the backward's inner loop."""
  mod = H.parse(_flash_program(window=150).as_text())
  tiles = sum(i + 1 - max(i * FB - 150 + 1, 0) // FB for i in range(FT // FB))
  assert tiles == 26
  assert sorted(i.mean_trips for i in mod.instrs() if i.opcode == "while" and i.trip_count is None) == [3.25, 3.25]


def test_a_bound_read_from_data_stays_unread():
  """A loop whose bound is an input's value (a grouped matmul's row count) is not given a count: it stays in
  unread_loops, its body counted once per start."""
  import jax
  import jax.numpy as jnp

  def f(x, n):
    def outer(h, i):
      return jax.lax.fori_loop(0, n[i], lambda j, a: jnp.tanh(a @ a), h), None
    return jax.lax.scan(outer, x, jnp.arange(4))[0]
  c = jax.jit(f).lower(jax.ShapeDtypeStruct((32, 32), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32)).compile()
  mod = H.parse(c.as_text())
  (loop,) = mod.unread_loops()
  assert loop.mean_trips is None and C.flops(mod) == 4 * 2 * 32 ** 3


# --------------------------------------------------------------------------------- the report: HLO against model

def test_the_hlo_count_meets_the_model_count_with_remats_recompute():
  """A 2-layer llama2-tiny train step under the flash core (its causal block loops read as above) compiled for 4
  CPU devices: the HLO's FLOPs are within 5% of the model's (6 x parameters + causal attention), and under
  remat=full of the model's plus the recomputed forward (a third more; the loss's head is not recomputed, 4% under).
  Control: remat=full against the model count alone is 25% over."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).parent))
  from test_compile import compile_json
  got = {}
  for remat in ("none", "full"):
    r = compile_json("model=llama2-tiny", "model.num_layers=2", "topology=cpu:4", "mesh.fsdp=4", "hbm_gib=1",
                     f"remat={remat}", "attention_impl=flash", "--no-census")["programs"]["train"]["roofline"]
    assert r["unread_loops"] == [] and r["model_flops_run"] == r["model_flops"] * (1 + (remat == "full") / 3)
    got[remat] = r
  assert abs(got["none"]["hlo_over_model"] - 1) < 0.05 and abs(got["full"]["hlo_over_model"] - 1) < 0.05
  assert got["full"]["flops"] / got["full"]["model_flops"] > 1.25


# --------------------------------------------------------------------------------- the decode step's bytes

FIXTURE = __import__("pathlib").Path(__file__).parent / "fixtures" / "decode_step.hlo"
# Bytes one trip of the fixture's token loop moves, by hand (bf16: 2 bytes an element):
STEP = {
    "row of the stack": 256 * 256 * 2 + 4 + 256 * 256 * 2,  # 1 of 8 layers' [256, 256] (and the index) read, written
    "x kept on chip": 256 * 2,  # read from HBM, written to VMEM (S(1)): no HBM write
    "dot": 256 * 256 * 2 + 256 * 2,  # reads the row (x is on chip), writes y [1, 256]
    "K/V row scattered in place": 4 * 4 + 4 * 64 * 2 + 4 * 64 * 2,  # indices and rows read, rows written
    "switch: its larger branch": 2 * 256 * 256 * 2 + 2 * 16 * 256 * 2,  # negate [256, 256], slice [16, 256]
    "all-gather": 32 * 256 * 2 + 256 * 256 * 2,  # the shard read, the gathered [256, 256] written
    "embedding rows": 4 * 4 + 2 * 4 * 256 * 2,  # 4 rows of the [256, 256] table gathered (and their ids)
    "counter and bound": 12 + 9,  # t + 1; the condition's compare
}
ONCE = 8 * 256 * 256 * (4 + 2)  # the stack's float32 -> bf16 cast, hoisted out of the loop


def test_a_decode_step_is_one_trip_of_the_token_loop_counted_by_hand():
  """The decode roofline counts one trip of the program's token loop (its trip count, the new tokens, is a runtime
  value) and apart from it what runs once per call; within the trip each rule holds the hand count exactly. Controls:
  the whole program (the loop's body once plus the hoisted cast: how `--program decode` counted before) is 4.8x the
  step; without the on-chip placement, the activation's write and the dot's read of it count; a layout copy that
  is not a view (a negate) makes the whole stack read; the smaller branch counted too adds its bytes."""
  text = FIXTURE.read_text()
  mod = H.parse(text)
  loop = C.step_loop(mod)
  assert loop is not None and loop.name == "loop"
  step = C.loop_comps(mod, loop)
  assert C.traffic_bytes(mod, step) == sum(STEP.values())
  assert C.traffic_bytes(mod) - C.traffic_bytes(mod, step) == ONCE
  assert C.flops(mod, step) == 2 * 256 * 256
  assert C.traffic_bytes(mod) > 4.8 * sum(STEP.values())
  off_chip = H.parse(text.replace("{1,0:T(1,128)S(1)}", "{1,0}"))
  assert C.traffic_bytes(off_chip, C.loop_comps(off_chip, C.step_loop(off_chip))) == sum(STEP.values()) + 2 * 512
  not_a_view = H.parse(text.replace("copy(%p.0)", "negate(%p.0)"))
  assert (C.traffic_bytes(not_a_view, C.loop_comps(not_a_view, C.step_loop(not_a_view)))
          == sum(STEP.values()) + 7 * 256 * 256 * 2)
  both = {c for i in mod.instrs() if i.opcode == "conditional" for c in i.called["branch_computations"]}
  assert sum(b for b, i in C.traffic(mod) if i.comp in both) == STEP["switch: its larger branch"]
  assert [i.name for _, i in C.traffic(mod, step) if i.comp == "branch_small"] == []


def test_the_scatter_and_the_async_gather_write_what_they_move():
  """Per instruction: the cache's K/V scatter reads its indices and rows and writes the rows, not the [4, 1024, 64]
  buffer (262,144 bytes read and written whole); the all-gather's call-update writes the gathered array, not the
  operand it carries in its result tuple (16,384 bytes more); a gather reads the rows it takes, not its table."""
  mod = H.parse(FIXTURE.read_text())
  assert C.instruction_bytes(mod, mod.by_name["cache.1"]) == (4 * 4 + 4 * 64 * 2, 4 * 64 * 2)
  assert C.instruction_bytes(mod, mod.by_name["ag.u"]) == (32 * 256 * 2, 256 * 256 * 2)
  assert C.instruction_bytes(mod, mod.by_name["ag.s"]) == (0, 0)  # its state flag lives in SMEM (S(2))
  assert C.instruction_bytes(mod, mod.by_name["emb"]) == (4 * 4 + 4 * 256 * 2, 4 * 256 * 2)  # not the whole table


def _hand_count(report: dict, rows: int, kv_layers: int, kv_heads: int, head_dim: int, embed: tuple[int, int] | None):
  """Bytes one decode step must move per device, from the program's inputs: the parameters read once in bf16 (half
  their float32 bytes), the embedding table read only at the rows' tokens where it is not also the head (embed:
  (vocab, dim) of an untied table); the K/V cache read whole (its buffer, not the filled part: attention reads every
  slot); the rest of the cache (GDN conv and recurrent states) read and written whole."""
  inputs = report["memory"]["arguments_by_input"]
  weights = inputs["params"] / 2
  if embed:
    weights -= (embed[0] - rows) * embed[1] * 2
  kv = inputs["cache"] if kv_layers is None else kv_layers * 2 * rows * kv_heads * 512 * head_dim * 2
  states = inputs["cache"] - kv
  return weights + kv + 2 * states


@tpu
@pytest.mark.ci_must_run
@pytest.mark.parametrize("model, rows, kv, embed", [
    # Dense, tied head (the table is the head: read whole): 28 layers x 8 kv heads x 128.
    (("model=qwen3-0.6b",), 1, (28, 8, 128), None),
    # GDN and MoE: 1 full-attention layer (2 kv heads x 32) and 3 GDN layers' states; all 8 experts' kernels read
    # (the loop grouped matmul reads each local expert's: named, as auto builds ragged for a TPU); an untied 512 x 128
    # embedding.
    (("model=qwen3.5-moe-tiny", "train.compute_dtype=bfloat16", "model.parts.moe.grouped_matmul=loop"), 4,
     (1, 2, 32), (512, 128)),
])
def test_the_decode_roofline_meets_the_hand_count(model, rows, kv, embed):
  """The decode step compiled for one v5p chip (prompts of 128, 384 new tokens: a 512-slot cache), against the hand
  count above: within 5%. Control: the whole program counted as one step (the loop body once plus the float32 ->
  bf16 casts XLA hoists out of the loop, once per call) is over 3x the hand count."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).parent))
  from test_compile import compile_json
  d = compile_json(*model, "topology=v5p:1x1x1", "train.seq_len=128", "rl.max_new_tokens=384",
                   f"train.per_device_batch_size={rows}", "--program", "decode", "--no-census")["programs"]["decode"]
  r = d["roofline"]
  hand = _hand_count(d, rows, *kv, embed)
  # The token loop is the step, not an unread loop; what stays unread is the grouped matmul's row-block loops.
  assert r["step_loop"] and all("experts" in u["scope"] for u in r["unread_loops"])
  # On TPU the step attends with the pallas kernel (decode_attention_impl=auto), its cache counted whole (named).
  assert any(e.startswith("custom calls:") and "decode attention" in e for e in r["estimated"]), r["estimated"]
  assert abs(r["bytes"] / hand - 1) < 0.05, (r["bytes"], hand)
  assert (r["bytes"] + r["once_bytes"]) / hand > 3
  assert d["rollout"]["step_s"] == r["bound_s"] and d["rollout"]["seconds"] == r["once_s"] + 384 * r["bound_s"]


@tpu
@pytest.mark.ci_must_run
def test_the_decode_loop_gathers_the_embedding_table_once_per_call(monkeypatch):
  """A llama2-tiny with the 397B's vocabulary (248,320 x 1,024) decoding on tpu7x:2x2x1 (8 devices) under explicit
  FSDP: the lookup reads the table whole (take_rows), and decoder.loop_invariants gathers it once, before the token
  loop (an optimization barrier keeps XLA from sinking it back): no collective inside one decode step has the
  table's shape, and the step moves less than the table. Control: without the loop invariants each step gathers
  the table, on every token (as the 397B rollout's step did: 2 GB of bf16 per token)."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).parent))
  from test_compile import compile_json
  from meshlm.analysis import aot
  from meshlm.models import api, decoder
  texts = []
  real = aot.roofline
  monkeypatch.setattr(aot, "roofline", lambda text, *a, **k: texts.append(text) or real(text, *a, **k))
  shape = (248320, 1024)
  args = ("model=llama2-tiny", f"model.vocab_size={shape[0]}", f"model.embed_dim={shape[1]}", "model.num_layers=2",
          "topology=tpu7x:2x2x1", "mesh.fsdp=-1", "train.seq_len=48", "rl.max_new_tokens=16", "--program", "decode",
          "--no-census")

  def table_gathers():
    """(the step's, the rest's) collectives whose result has the table's shape, and the step's bytes."""
    mod = H.parse(texts[-1])
    step = C.loop_comps(mod, C.step_loop(mod))
    found = [i for i in mod.instrs() if ("all-gather" in i.name or "all-reduce" in i.name)
             and any(a.shape == shape for a in i.result)]
    return sum(i.comp in step for i in found), sum(i.comp not in step for i in found), C.traffic_bytes(mod, step)

  api.clear_programs()
  compile_json(*args)
  inside, outside, step = table_gathers()
  assert inside == 0 and outside > 0 and step < shape[0] * shape[1] * 2
  monkeypatch.setattr(decoder, "loop_invariants", lambda cfg, params: None)
  api.clear_programs()
  compile_json(*args)
  inside, outside, before = table_gathers()
  assert inside > 0 and outside == 0 and before > step + shape[0] * shape[1] * 2
  api.clear_programs()


KERNELS = "\n".join([
    "HloModule decode_kernels",
    "ENTRY %main (p0: s32[4], p1: s32[1], p2: bf16[4,2,2,128], p3: bf16[4,2,1,128], p4: bf16[4,2,1,128], "
    "p5: bf16[3,4,2,512,128], p6: bf16[3,4,2,1,128]) -> bf16[3,4,2,512,128] {",
    "  %cur_ref = s32[4]{0} parameter(0)",
    "  %layer_ref = s32[1]{0} parameter(1)",
    "  %q_ref = bf16[4,2,2,128]{3,2,1,0} parameter(2)",
    "  %kn_ref = bf16[4,2,1,128]{3,2,1,0} parameter(3)",
    "  %vn_ref = bf16[4,2,1,128]{3,2,1,0} parameter(4)",
    "  %kc_ref = bf16[3,4,2,512,128]{4,3,2,1,0} parameter(5)",
    "  %rows = bf16[3,4,2,1,128]{4,3,2,1,0} parameter(6)",
    "  %decode_attention.1 = bf16[4,2,2,128]{3,2,1,0} custom-call(%cur_ref, %layer_ref, %q_ref, %kn_ref, %vn_ref, "
    "%kc_ref, %kc_ref), custom_call_target=\"tpu_custom_call\"",
    "  ROOT %write_rows.1 = bf16[3,4,2,512,128]{4,3,2,1,0} custom-call(%cur_ref, %rows, %kc_ref), "
    "custom_call_target=\"tpu_custom_call\"",
    "}", ""])


def test_the_decode_kernels_move_one_layer_and_one_tile_per_row():
  """nn/decode_attention's kernel reads one layer's row of the stacks it is given (every slot: an upper figure) and its
  small operands, writes its output; the tiled K/V write reads each row's new K/V and the (8-slot) tile holding its
  slot, and writes that tile back, not the [3, 4, 2, 512, 128] cache. Its FLOPs: every query row against every slot,
  2 x 512 x (128 + 128) each."""
  mod = H.parse(KERNELS)
  stack = 3 * 4 * 2 * 512 * 128 * 2
  small = 4 * 4 + 4 + (4 * 2 * 2 * 128 + 2 * 4 * 2 * 128) * 2
  assert C.instruction_bytes(mod, mod.by_name["decode_attention.1"]) == (small + 2 * stack // 3, 4 * 2 * 2 * 128 * 2)
  tiles = stack * 8 // 512
  assert C.instruction_bytes(mod, mod.by_name["write_rows.1"]) == (4 * 4 + 3 * 4 * 2 * 128 * 2 + tiles, tiles)
  assert C.custom_call_flops(mod) == (2.0 * 4 * 2 * 2 * 512 * 256, ["decode_attention.1"])
