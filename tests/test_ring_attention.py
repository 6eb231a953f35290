"""context_attention=ring (nn/ring_attention.py): attention over a sequence sharded on mesh.context, K/V passed
around the ring and merged into flash's online softmax, zigzag-balanced.

- The kernel alone against flash_attention on the whole sequence (forward and the three gradients, float32), on
  context=4 (GQA groups, packed segments, the soft-cap, chunks that are not a whole number of blocks) and on
  context=2 (a sliding window, MLA's unequal query/key and value head dims); negative controls: the zigzag offset
  skipped (chunk positions read as contiguous), and K/V sent the wrong way round the ring.
- Whole tiny models with their sequence sharded equal the same model unsharded (the xla core), logits and every
  gradient: llama (full attention) on context=2 and 4 (explicit) and context=2 x fsdp=2 (auto); qwen3.5 (GDN
  hybrid) on context=4 and context=2 x fsdp=2 (auto).
- The compiled programs: no all-gather of K/V over the context axis is left in attention, the ring's
  collective-permutes are there, each no larger than one chunk; the gather form (the control) has the gather.
- Causal balance: every device has the same visible block pairs at every ring step (contiguous chunks do not).

Each program compiles once per module (functools.cache).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.analysis.census import attention_impl, hlo_counts
from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.models import decoder, registry
from meshlm.models.params import init_params, param_shardings
from meshlm.nn import flash_attention as FA, ring_attention as RA
from meshlm.parallel.mesh import make_mesh
from meshlm.train.step import grads_and_loss
from seams import max_diffs, packed_batch, placed_batch

# Float32 reassociation only. Measured max |diff| (kernel: out, dq, dk, dv against flash on the whole sequence):
# 2.9e-6 at most; models (logits and any gradient leaf against the unsharded xla core): see MODEL_ATOL.
KERNEL_ATOL = 2e-5
MODEL_ATOL = 2e-5
LEAK = 1e-2  # what a negative control must move some value by, at least

# ------------------------------------------------------------------------------------------- the kernel

T_K = 64
KERNEL_CASES = {
  # shards, (N, K, H, Hv), window, softcap, segments, block: c = 64 / 8 = 8 rows per chunk, blocks of 5 (padded)
  "context4_gqa_segments_softcap": (4, (4, 2, 8, 8), None, 5.0, True, 5),
  # c = 16, blocks of 4; MLA: every query head its own key (G = 1), value dims 6 against query/key dims 8
  "context2_window_mla_dims": (2, (2, 2, 8, 6), 11, None, False, 4),
}


def _kernel_inputs(case: str):
  _, (N, K, H, Hv), _, _, segs, _ = KERNEL_CASES[case]
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(2, T_K, N, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, T_K, K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, T_K, K, Hv)), jnp.float32)
  # Documents crossing the chunk edges; row 1 one document whole.
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3, 4], [13, 30, 9, 12]), np.ones(T_K, int)])) if segs else None
  return q, k, v, seg


def _kernel_run(case: str, attention):
  """(out, dq, dk, dv) of `attention` (flash_attention's signature) on the case's inputs, one jit."""
  shards, (N, K, H, Hv), window, softcap, _, block = KERNEL_CASES[case]
  q, k, v, seg = _kernel_inputs(case)
  fn = lambda q, k, v: attention(q, k, v, seg, scale=H ** -0.5, softcap=softcap, window=window, block=block)  # noqa: E731

  def value_and_grads(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(jnp.cos(3.0 * out))
  return [np.asarray(a) for a in jax.jit(value_and_grads)(q, k, v)]


@functools.cache
def _flash(case: str):
  return _kernel_run(case, FA.flash_attention)


def _ring(case: str):
  shards = KERNEL_CASES[case][0]
  with jax.set_mesh(make_mesh(load_config(f"cpu_devices={shards}", f"mesh.context={shards}"))):
    return _kernel_run(case, RA.ring_attention)


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_ring_equals_flash_on_the_whole_sequence(case):
  errs = [float(np.max(np.abs(a - b))) for a, b in zip(_ring(case), _flash(case))]
  print(f"{case}: max |ring - flash| out, dq, dk, dv = {errs}")
  assert max(errs) < KERNEL_ATOL, errs


@pytest.mark.parametrize("patch, wrong", [
  # The rebalancing offset skipped: device r's rows are taken as chunks 2r, 2r + 1 (contiguous) though they
  # hold chunks r and 2C - 1 - r.
  ("chunk_ids", lambda real: lambda r, C: (2 * r, 2 * r + 1)),
  # K/V sent the wrong way round: the blocks arriving are not device r - step's.
  ("ring_perm", lambda real: lambda C: [(i, (i - 1) % C) for i in range(C)]),
])
def test_a_broken_ring_fails_the_comparison(monkeypatch, patch, wrong):
  case = "context4_gqa_segments_softcap"
  monkeypatch.setattr(RA, patch, wrong(getattr(RA, patch)))
  errs = [float(np.max(np.abs(a - b))) for a, b in zip(_ring(case), _flash(case))]
  print(f"broken {patch}: max |ring - flash| out, dq, dk, dv = {errs}")
  assert errs[0] > LEAK and max(errs[1:]) > LEAK, errs


def _visible_pairs(chunks, C: int, n: int, b: int) -> list[list[int]]:
  """[step][device]: the (query block, key block) pairs with a visible position, over the device's four chunk
  pairs at that ring step (causal; chunks of n blocks of b)."""
  st = FA._Static(1.0, None, None, b, n * b, False)
  out = []
  for step in range(C):
    row = []
    for r in range(C):
      mine, theirs = chunks(r, C), chunks((r - step) % C, C)
      row.append(sum(int(hi) - int(lo) for a in mine for e in theirs
                           for i in range(n) for lo, hi in [FA._key_blocks(st, i, (a - e) * n * b, n)]))
    out.append(row)
  return out


@pytest.mark.parametrize("C", [2, 4, 8])
def test_zigzag_balances_causal_work_over_the_ring(C):
  """Zigzag: at every step each device sees the same number of visible block pairs (after the first, two of
  its four chunk pairs whole, n^2 blocks each); over the ring the causal half of the square, once. Contiguous
  chunks (the control): at each step after the first, the busiest device works and device 0 idles."""
  n, b = 3, 4
  zig = _visible_pairs(RA.chunk_ids, C, n, b)
  assert all(len(set(row)) == 1 for row in zig), zig
  assert all(row[0] == 2 * n * n for row in zig[1:])
  total = (2 * C * n) * (2 * C * n + 1) // 2  # the causal block pairs of the whole sequence
  assert sum(row[0] for row in zig) * C == total
  flat = _visible_pairs(lambda r, C: (2 * r, 2 * r + 1), C, n, b)
  assert sum(max(row) for row in flat) > 1.5 * sum(max(row) for row in zig) * (C - 1) / C, (flat, zig)
  assert all(row[0] == 0 for row in flat[1:])  # device 0's keys all come after its queries


# --------------------------------------------------------------------------------------------- the models

LLAMA = ("model=llama2-tiny", "model.num_layers=1", "model.embed_dim=32", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=8", "model.mlp_dim=64", "model.vocab_size=64", "train.seq_len=64")
# qwen3.5-tiny shrunk as tests/test_gdn_context.py does: one linear-attention and one gated full-attention layer.
QWEN = ("model=qwen3.5-tiny", "model.num_layers=2", "model.full_attention_interval=2", "model.embed_dim=32",
    "model.mlp_dim=64", "model.vocab_size=64", "model.parts.gdn.chunk_size=16", "model.parts.gdn.key_head_dim=8",
    "model.parts.gdn.value_head_dim=8", "model.head_dim=8", "train.seq_len=128")
MODELS = {"llama": LLAMA, "qwen3.5": QWEN}
COMMON = ("train.compute_dtype=float32", "train.per_device_batch_size=1")
UNSHARDED = ("cpu_devices=1",)  # attention_impl=auto: xla at these lengths on CPU, the reference
RING = ("attention_impl=flash", "context_attention=ring")
MESHES = {"context2": ("cpu_devices=2", "mesh.context=2", "shard_mode=explicit"),
          "context4": ("cpu_devices=4", "mesh.context=4", "shard_mode=explicit"),
          "context2_fsdp2_auto": ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2", "shard_mode=auto")}


def _batch(model: str, vocab: int) -> dict:
  """Two rows of packed documents spanning the chunk edges (T / 8 apart at context=4), one starting exactly on
  one, and padding (segment 0, no loss)."""
  T = 64 if model == "llama" else 128
  return packed_batch(vocab, T, ((0, T // 3, T // 2, T), (0, 5 * T // 8 + 3, T - 6)))


@functools.cache
def _params(model: str):
  cfg = load_config(*MODELS[model], *COMMON, *UNSHARDED)
  return jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), make_mesh(cfg)))


@functools.cache
def _model_run(model: str, *over: str):
  """(logits, loss, grads) as numpy and the compiled HLO text: the model's forward and grads_and_loss, one jit."""
  cfg = load_config(*MODELS[model], *COMMON, *over)
  registry.validate(cfg)
  mesh = make_mesh(cfg)
  p = jax.device_put(_params(model), param_shardings(cfg, mesh))
  b = _batch(model, cfg.model.vocab_size)
  with jax.set_mesh(mesh):
    put = placed_batch(mesh, b)

    def step(p, b):
      logits = decoder.forward(cfg, p, b["inputs"], b["positions"], b["segment_ids"])
      return (logits,) + grads_and_loss(cfg, p, b)[:2]
    compiled = jax.jit(step).lower(p, put).compile()
    logits, loss, grads = compiled(p, put)
  return np.asarray(logits), float(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


def _errors(got, want) -> dict[str, float]:
  real = _batch("llama" if got[0].shape[1] == 64 else "qwen3.5", 2)["segment_ids"] > 0  # padding's logits are free
  errs = max_diffs(got[1:3], want[1:3])
  errs["logits"] = float(np.max(np.abs(got[0] - want[0])[real]))
  return errs


@pytest.mark.parametrize("model, mesh", [("llama", "context2"), ("llama", "context4"), ("llama", "context2_fsdp2_auto"),
                                         ("qwen3.5", "context4"), ("qwen3.5", "context2_fsdp2_auto")])
def test_ring_model_equals_unsharded(model, mesh):
  errs = _errors(_model_run(model, *RING, *MESHES[mesh]), _model_run(model, *UNSHARDED))
  print(f"{model} {mesh}: max |diff| {max(errs.values()):.3g} (logits {errs['logits']:.3g})")
  assert len(errs) > 10  # logits, loss and every parameter's gradient
  assert max(errs.values()) < MODEL_ATOL, {k: v for k, v in errs.items() if v >= MODEL_ATOL}


def _collectives(hlo: str, scope: str) -> dict[str, list[dict]]:
  counts, _ = hlo_counts(hlo)
  return {kind: [c for c in d["calls"] if scope in (c["scope"] or "")] for kind, d in counts["collectives"].items()}


def _has_length(shape: str, T: int) -> bool:
  dims = shape.split("[")[1].split("]")[0].split(",")
  return str(T) in dims


@pytest.mark.parametrize("model, mesh, shards", [("llama", "context4", 4), ("qwen3.5", "context2_fsdp2_auto", 2)])
def test_ring_program_gathers_no_keys_or_values(model, mesh, shards):
  """In the compiled ring programs, attention's collectives never carry the whole sequence: no all-gather (or
  any collective) of T rows in the attention layers, and the ring's collective-permutes are there, each one
  chunk (T / 2C rows) of one array, no more."""
  cfg = load_config(*MODELS[model], *COMMON)
  T, m = cfg.train.seq_len, cfg.model
  hlo = _model_run(model, *RING, *MESHES[mesh])[3]
  attn = "full_attn" if model == "qwen3.5" else "attn"
  calls = _collectives(hlo, attn)
  whole = [(kind, c["shape"], c["scope"]) for kind, cs in calls.items() for c in cs if _has_length(c["shape"], T)]
  assert not whole, whole
  ring = [c for c in calls["collective-permute"] if "ring_attention" in c["scope"]]
  assert ring, calls["collective-permute"]
  chunk = 2 * (T // (2 * shards)) * max(m.num_heads, m.num_kv_heads) * m.head_dim * 4  # B = 2 rows, float32
  assert all(c["bytes_per_call"] <= chunk for c in ring), [(c["shape"], c["bytes_per_call"]) for c in ring]


def test_gather_program_gathers_keys_and_values():
  """The control of the check above: context_attention=gather (XLA's partitioning of the same flash core) on
  context=2 all-gathers K/V with their whole T in the attention layer, and no ring permutes are there."""
  T = 64
  hlo = _model_run("llama", "attention_impl=flash", "context_attention=gather", *MESHES["context2"])[3]
  calls = _collectives(hlo, "attn")
  assert [c for c in calls["all-gather"] if _has_length(c["shape"], T)], calls["all-gather"]
  assert not [c for c in calls["collective-permute"] if "ring_attention" in c["scope"]]


def test_the_key_resolves_and_reports():
  """ring runs where training shards the sequence with the flash core; the reports say so; T must split into
  2 x mesh.context chunks (one ConfigError line naming the keys)."""
  assert attention_impl(load_config(*LLAMA, *RING, "mesh.context=2"), "cpu") == "ring"
  assert attention_impl(load_config(*LLAMA, "attention_impl=flash", "mesh.context=2", "context_attention=gather"),
                          "cpu") == "flash"
  assert attention_impl(load_config(*LLAMA, *RING), "cpu") == "flash"  # one shard: nothing to pass around
  assert attention_impl(load_config(*LLAMA, "mesh.context=2"), "cpu") == "xla"  # the materialized reference gathers
  assert load_config().context_attention == "ring"
  with pytest.raises(ConfigError, match=r"^context_attention=ring: train.seq_len=68 .*multiple of 8"):
    registry.validate(load_config(*LLAMA, "train.seq_len=68", "mesh.context=4", "cpu_devices=4"))
  registry.validate(load_config(*LLAMA, "train.seq_len=68", "mesh.context=4", "cpu_devices=4",
                                  "context_attention=gather"))
  with pytest.raises(ConfigError, match=r"^context_attention: .*'ring' or 'gather'"):
    load_config("context_attention=allgather")
