"""context_attention=ring (nn/ring_attention.py): attention over a sequence sharded on mesh.context, K/V passed
around the ring and merged into flash's online softmax, zigzag-balanced.

- The kernel alone against flash_attention on the whole sequence (forward and the three gradients, float32), on
  context=4: GQA groups, packed segments, the soft-cap, a sliding window that crosses chunk edges, value dims
  unlike the query/key dims (MLA's), chunks that are not a whole number of blocks. Negative controls (forward):
  the zigzag offset skipped (chunk positions read as contiguous), K/V sent the wrong way round the ring.
- Whole tiny models with their sequence sharded equal the same model unsharded (the xla core): llama (full
  attention) on context=4 (explicit), logits, loss and every gradient; qwen3.5 (GDN hybrid: GDN's own context
  parallelism beside the ring) on context=2 x fsdp=2 (auto), loss and every gradient.
- The compiled programs: no all-gather of K/V over the context axis is left in attention, the ring's
  collective-permutes are there, each no larger than one chunk; the gather form of the kernel (the control) has
  the gather.
- Causal balance: every device has the same visible block pairs at every ring step (contiguous chunks do not).

Each program compiles once per module (functools.cache).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.analysis.census import attention_impl, hlo_counts, stablehlo_counts
from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.models import decoder, registry
from meshlm.models.params import init_params, param_shardings
from meshlm.nn import flash_attention as FA, ring_attention as RA
from meshlm.nn.attention import resolve_context
from meshlm.parallel.mesh import make_mesh
from meshlm.train.step import grads_and_loss
from seams import max_diffs, packed_batch, placed_batch

# Float32 reassociation only. Measured max |diff|: the kernel against flash on the whole sequence 2.4e-7 (out),
# 6.6e-7 (dv); the models against the unsharded xla core, logits, loss and any gradient leaf: 1.7e-6 (llama,
# context=4), 2.7e-6 (qwen3.5, context=2 x fsdp=2). The negative controls move the kernel's output by 2.1.
KERNEL_ATOL = 2e-5
MODEL_ATOL = 2e-5
LEAK = 1e-2  # what a negative control must move some value by, at least

# ------------------------------------------------------------------------------------------- the kernel

T_K = 64
SHARDS = 4
# (N, K, H, Hv): GQA groups of 2, value dims 6 against query/key dims 8; chunks of 64 / 8 = 8 rows, blocks of 5
# (padded); the window crosses chunk edges; segments: documents across the edges.
DIMS, WINDOW, SOFTCAP, BLOCK = (4, 2, 8, 6), 11, 5.0, 5


def _kernel_inputs():
  N, K, H, Hv = DIMS
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(2, N, T_K, H)), jnp.float32)  # heads-first rows, every core's
  k = jnp.asarray(rng.normal(size=(2, K, T_K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, K, T_K, Hv)), jnp.float32)
  # Row 0: documents crossing the chunk edges (every 8); row 1: one document.
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3, 4], [13, 30, 9, 12]), np.ones(T_K, int)]))
  return q, k, v, seg


def _kernel_run(attention, grads: bool = True, mesh=None):
  """((out, dq, dk, dv) of `attention` (flash_attention's signature) on the inputs, one jit, or (out,) without
  grads; the compiled HLO text). With a mesh: q, k, v sharded over its context axis."""
  q, k, v, seg = _kernel_inputs()
  if mesh is not None:
    seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "context"))
    q, k, v = (jax.device_put(x, seq) for x in (q, k, v))
  fn = lambda q, k, v: attention(q, k, v, seg, scale=DIMS[2] ** -0.5, softcap=SOFTCAP, window=WINDOW,  # noqa: E731
                                 block=BLOCK)

  def value_and_grads(q, k, v):
    if not grads:
      return (fn(q, k, v),)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(jnp.cos(3.0 * out))
  compiled = jax.jit(value_and_grads).lower(q, k, v).compile()
  return [np.asarray(a) for a in compiled(q, k, v)], compiled.as_text()


@functools.cache
def _flash():
  return _kernel_run(FA.flash_attention)[0]


def _context_mesh(shards: int = SHARDS, mode: str = "explicit"):
  return make_mesh(load_config(f"cpu_devices={shards}", f"mesh.context={shards}", f"shard_mode={mode}"))


def _ring(grads: bool = True):
  """The ring's _kernel_run on mesh.context=SHARDS (explicit)."""
  mesh = _context_mesh()
  with jax.set_mesh(mesh):
    return _kernel_run(RA.ring_attention, grads, mesh)


_ring_once = functools.cache(_ring)


def test_ring_equals_flash_on_the_whole_sequence():
  errs = [float(np.max(np.abs(a - b))) for a, b in zip(_ring_once()[0], _flash())]
  print(f"max |ring - flash| out, dq, dk, dv = {errs}")
  assert max(errs) < KERNEL_ATOL, errs


@pytest.mark.parametrize("patch, wrong", [
  # The rebalancing offset skipped: device r's rows are taken as chunks 2r, 2r + 1 (contiguous) though they
  # hold chunks r and 2C - 1 - r.
  ("chunk_ids", lambda real: lambda r, C: (2 * r, 2 * r + 1)),
  # K/V sent the wrong way round: the blocks arriving are not device r - step's.
  ("ring_perm", lambda real: lambda C: [(i, (i - 1) % C) for i in range(C)]),
])
def test_a_broken_ring_fails_the_comparison(monkeypatch, patch, wrong):
  monkeypatch.setattr(RA, patch, wrong(getattr(RA, patch)))
  err = float(np.max(np.abs(_ring(grads=False)[0][0] - _flash()[0])))
  print(f"broken {patch}: max |ring - flash| out = {err}")
  assert err > LEAK


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
         "model.head_dim=8", "model.mlp_dim=64", "model.vocab_size=64")
# qwen3.5-tiny shrunk as tests/test_gdn_context.py does: one linear-attention and one gated full-attention layer.
QWEN = ("model=qwen3.5-tiny", "model.num_layers=2", "model.full_attention_interval=2", "model.embed_dim=32",
        "model.mlp_dim=64", "model.vocab_size=64", "model.parts.gdn.chunk_size=16", "model.parts.gdn.key_head_dim=8",
        "model.parts.gdn.value_head_dim=8", "model.head_dim=8")
MODELS = {"llama": LLAMA, "qwen3.5": QWEN}
T = 64
COMMON = ("train.compute_dtype=float32", "train.per_device_batch_size=1", f"train.seq_len={T}")
UNSHARDED = ("cpu_devices=1",)  # attention_impl=auto: xla at this length on CPU, the reference
RING = ("attention_impl=flash", "context_attention=ring")
MESHES = {"context4": ("cpu_devices=4", "mesh.context=4", "shard_mode=explicit"),
          "context2_fsdp2_auto": ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2", "shard_mode=auto")}
# The two sharded programs: mesh.context=4 under explicit, context=2 x fsdp=2 under auto.
PROGRAMS = [("llama", "context4", 4), ("qwen3.5", "context2_fsdp2_auto", 2)]


def _batch(vocab: int) -> dict:
  """Two rows of packed documents spanning the chunk edges (every 8 positions at context=4), one starting exactly
  on one (32), and padding (segment 0, no loss)."""
  return packed_batch(vocab, T, ((0, T // 3, T // 2, T), (0, 5 * T // 8 + 3, T - 6)))


@functools.cache
def _params(model: str):
  cfg = load_config(*MODELS[model], *COMMON, *UNSHARDED)
  return jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), make_mesh(cfg)))


@functools.cache
def _model_run(model: str, *over: str):
  """(logits, loss, grads) as numpy, the compiled HLO and the StableHLO text: the model's forward and
  grads_and_loss, one jit (llama; qwen3.5's logits are None, its loss and gradients checked, a compile saved)."""
  cfg = load_config(*MODELS[model], *COMMON, *over)
  registry.validate(cfg)
  mesh = make_mesh(cfg)
  p = jax.device_put(_params(model), param_shardings(cfg, mesh))
  with jax.set_mesh(mesh):
    put = placed_batch(mesh, _batch(cfg.model.vocab_size))

    def step(p, b):
      logits = decoder.forward(cfg, p, b["inputs"], b["positions"], b["segment_ids"]) if model == "llama" else None
      return (logits,) + grads_and_loss(cfg, p, b)[:2]
    lowered = jax.jit(step).lower(p, put)
    compiled = lowered.compile()
    logits, loss, grads = compiled(p, put)
  return (None if logits is None else np.asarray(logits), float(loss), jax.tree.map(np.asarray, grads),
          compiled.as_text(), lowered.as_text(debug_info=True))


def _errors(got, want) -> dict[str, float]:
  """Max |diff| of the real positions' logits, the loss and each gradient leaf (by its path)."""
  real = _batch(2)["segment_ids"] > 0  # padding's logits are free
  errs = max_diffs(got[1:3], want[1:3])
  if got[0] is not None:
    errs["logits"] = float(np.max(np.abs(got[0] - want[0])[real]))
  return errs


@pytest.mark.parametrize("model, mesh, shards", PROGRAMS)
def test_ring_model_equals_unsharded(model, mesh, shards):
  errs = _errors(_model_run(model, *RING, *MESHES[mesh]), _model_run(model, *UNSHARDED))
  print(f"{model} {mesh}: max |diff| {max(errs.values()):.3g} (logits {errs.get('logits')})")
  assert len(errs) > 10  # logits, loss and every parameter's gradient
  assert max(errs.values()) < MODEL_ATOL, {k: v for k, v in errs.items() if v >= MODEL_ATOL}


def _collectives(hlo: str, scope: str) -> dict[str, list[dict]]:
  counts, _ = hlo_counts(hlo)
  return {kind: [c for c in d["calls"] if scope in (c["scope"] or "")] for kind, d in counts["collectives"].items()}


def _has_length(shape: str, T: int) -> bool:
  """A collective's result shape (e.g. f32[2,64,2,8]{...}) has a dimension of T or more (T padded: XLA pads
  flash's block-padded length to a multiple of the shards)."""
  return any(int(d) >= T for d in shape.split("[")[1].split("]")[0].split(",") if d)


@pytest.mark.parametrize("model, mesh, shards", PROGRAMS)
def test_ring_program_gathers_no_keys_or_values(model, mesh, shards):
  """In the compiled ring programs, attention's collectives never carry the whole sequence: no all-gather (or
  any collective) of T rows in the attention layers, and the ring's collective-permutes are there, each at most a
  device's own rows (two chunks, T / C) of one of q, K, V or their gradients. The explicit-sharding promise holds:
  no blocked transpose-of-dot pair (a shard_map manual over `context` alone put an open sharding constraint after
  every op inside it: 24 blocked pairs on llama2-tiny, context=2)."""
  m = load_config(*MODELS[model], *COMMON).model
  hlo = _model_run(model, *RING, *MESHES[mesh])[3]
  calls = _collectives(hlo, "full_attn" if model == "qwen3.5" else "attn")
  whole = [(kind, c["shape"], c["scope"]) for kind, cs in calls.items() for c in cs if _has_length(c["shape"], T)]
  assert not whole, whole
  ring = [c for c in calls["collective-permute"] if "ring_attention" in c["scope"]]
  assert ring, calls["collective-permute"]
  own = 2 * (T // shards) * m.num_heads * m.head_dim * 4  # B = 2 rows of T / C positions, q's width, float32
  assert all(c["bytes_per_call"] <= own for c in ring), [(c["shape"], c["bytes_per_call"]) for c in ring]
  shlo = stablehlo_counts(_model_run(model, *RING, *MESHES[mesh])[4], ())[0]
  assert shlo["transpose_of_dot"]["blocked"] == 0 < shlo["transpose_of_dot"]["adjacent"], shlo["transpose_of_dot"]


def test_the_gather_form_gathers_keys_and_values():
  """The control of the check above: flash_attention left to XLA's partitioner with the sequence sharded over
  context (what context_attention=gather compiles; forward only) all-gathers rows of the whole T (padded); the
  ring kernel's program (forward and backward) moves chunks only."""
  mesh = _context_mesh(mode="auto")
  with jax.set_mesh(mesh):
    texts = {"gather": _kernel_run(FA.flash_attention, False, mesh)[1], "ring": _ring_once()[1]}
  whole = {name: [c["shape"] for cs in _collectives(hlo, "").values() for c in cs if _has_length(c["shape"], T_K)]
           for name, hlo in texts.items()}
  assert whole["gather"] and not whole["ring"], whole
  assert _collectives(texts["ring"], "ring_attention")["collective-permute"]


def test_the_key_resolves_and_reports():
  """ring runs where training shards the sequence with the flash core; the reports say so; T must split into
  2 x mesh.context chunks (one ConfigError line naming the keys)."""
  assert attention_impl(load_config(*LLAMA, *RING, "mesh.context=2"), "cpu") == "ring"
  assert attention_impl(load_config(*LLAMA, "attention_impl=flash", "mesh.context=2", "context_attention=gather"),
                        "cpu") == "flash"
  assert attention_impl(load_config(*LLAMA, *RING), "cpu") == "flash"  # one shard: nothing to pass around
  assert attention_impl(load_config(*LLAMA, "mesh.context=2"), "cpu") == "xla"  # the materialized reference gathers
  assert load_config().context_attention == "ring"
  # A length that does not split into 2 x shards chunks (meshlm.forward on any prompt) runs the gather.
  assert resolve_context("flash", "ring", 2, 68) == "ring" and resolve_context("flash", "ring", 4, 68) == "flash"
  assert resolve_context("flash", "ring", 2, 64, mode="prefill") == "flash"
  with pytest.raises(ConfigError, match=r"^context_attention=ring: train.seq_len=68 .*multiple of 8"):
    registry.validate(load_config(*LLAMA, "train.seq_len=68", "mesh.context=4", "cpu_devices=4"))
  registry.validate(load_config(*LLAMA, "train.seq_len=68", "mesh.context=4", "cpu_devices=4",
                                "context_attention=gather"))
  with pytest.raises(ConfigError, match=r"^context_attention: .*'ring' or 'gather'"):
    load_config("context_attention=allgather")
