"""The checks every registered family passes, through the public API exactly as the README calls it
(meshlm.init_params, forward, generate, hf.save, hf.load; no mesh argument, no jit of our own), as functions of
a config. tests/test_conformance.py runs them over the registry (every family, every tiny preset, one HF fixture
per family) in this process and in a process with 1 device; tests/test_adding_a_part.py runs them on
docs/adding-a-part.md's worked example. A check raises AssertionError naming what differs.

One forward program serves the generate, packed-document and round-trip checks: every forward here is a [3, T]
block with explicit positions and segment ids (right-padded rows are segment 1, then padding 0).
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np

import meshlm
from meshlm.analysis.census import field, stablehlo_counts
from meshlm.train.step import build_train_step

# Three prompts of different lengths, right-padded into one prefill block; the longest spans a GDN chunk (64)
# and every sliding window of the tiny presets (at most 64); with NEW tokens every row decodes past its window.
LENGTHS = (5, 17, 66)
NEW = 60
T = max(LENGTHS) + NEW  # the forward block: the longest prompt and its completion
# Two packed documents: the second crosses the GDN chunk boundary at 64 and is longer than any window.
DOCS = (45, 81)
LOGPROB_ATOL = 1e-5  # float32 reassociation between the cached decode and one forward (measured: see the test file)
# A greedy token may differ from the forward's argmax only where the forward's top two are this close (a float32
# tie, which the cached and the uncached paths may break differently); every other token must be the argmax.
TIE = 1e-5
# Relative to the largest |logit| of the documents alone: float32 reassociation (the attention sums over another
# set of masked keys, GDN chunks split elsewhere). Measured at most 3.9e-6 (the qwen3.5-moe fixture; the tiny
# presets 0 to 3e-7); a document that reads another moves logits by 1e-2 or more.
PACKED_RTOL = 1e-5

# explicit == auto: a few float32 train steps on fsdp=4, from the same parameters and batches.
PARITY_STEPS = 3
PARITY_SEQ = 96  # longer than every tiny preset's sliding window
PARITY_BASE = ("cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1", f"train.seq_len={PARITY_SEQ}",
               "train.compute_dtype=float32", "train.warmup_steps=0", "train.learning_rate=3e-3")
PARITY_ATOL = 1e-5  # float32 reassociation; the injected sharding bug of test_conformance moves the loss by 0.1


def prompts(cfg) -> list[list[int]]:
  rng = np.random.default_rng(1)
  return [[int(t) for t in rng.integers(0, cfg.model.vocab_size, n)] for n in LENGTHS]


def right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """[3, T] tokens, positions and segment ids (1 on each row's tokens, 0 after) of right-padded rows."""
  toks, pos, seg = (np.zeros((len(rows), T), np.int32) for _ in range(3))
  for i, r in enumerate(rows):
    toks[i, :len(r)], pos[i, :len(r)], seg[i, :len(r)] = r, np.arange(len(r)), 1
  return toks, pos, seg


def logits_of(cfg, params, block, **kw) -> tuple[np.ndarray, dict]:
  """meshlm.forward on a [3, T] block: (float32 logits, side outputs as numpy)."""
  logits, side = meshlm.forward(cfg, params, *block, return_side=True, **kw)
  return np.asarray(logits, np.float32), {k: np.asarray(v) for k, v in side.items()}


def greedy(cfg, params) -> meshlm.models.generate.Generation:
  return meshlm.generate(cfg, params, prompts(cfg), max_new_tokens=NEW, stop_tokens=())


def check_generate_equals_recompute(cfg, params, out=None) -> dict:
  """Greedy generate (stop_tokens=()) against one forward over prompt + completion, which is uncached greedy
  decoding at every step at once (the model is causal): each token is the forward's argmax (but for a float32
  tie, counted), log-probs within LOGPROB_ATOL. Returns {"ties", "max_logprob_diff"}."""
  out = greedy(cfg, params) if out is None else out
  ps, news = prompts(cfg), out.token_lists()
  assert [len(n) for n in news] == [NEW] * len(ps), f"lengths {[len(n) for n in news]}, want {NEW} each"
  logits, _ = logits_of(cfg, params, right_padded([p + n for p, n in zip(ps, news)]))
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  ties, worst = 0, 0.0
  for b, (p, new) in enumerate(zip(ps, news)):
    for j, tok in enumerate(new):
      r = len(p) - 1 + j  # the position whose logits chose new[j]
      best = int(np.argmax(logits[b, r]))
      if tok != best:
        gap = float(logits[b, r, best] - logits[b, r, tok])
        assert gap <= TIE, (f"row {b} (prompt of {len(p)}), new token {j}: generate drew {tok}, recomputing gives "
                            f"{best} (logit gap {gap:.3g} > {TIE})")
        ties += 1
    diff = np.abs(np.asarray(out.logprob_lists()[b]) - [logp[b, len(p) - 1 + j, t] for j, t in enumerate(new)])
    worst = max(worst, float(diff.max()))
    assert worst <= LOGPROB_ATOL, f"row {b}: log-probs differ from the forward's by {diff.max():.3g} > {LOGPROB_ATOL}"
  return {"ties": ties, "max_logprob_diff": worst}


def packed_block(cfg) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Rows: [doc 1 | doc 2 | padding] with segment ids 1, 2, 0 and each document's positions from 0; doc 1
  alone; doc 2 alone (padded after it, which a causal model never reads)."""
  rng = np.random.default_rng(2)
  d1, d2 = (rng.integers(0, cfg.model.vocab_size, n) for n in DOCS)
  toks, pos, seg = right_padded([list(d1) + list(d2), list(d1), list(d2)])
  a = DOCS[0]
  seg[0, a:a + DOCS[1]] = 2
  pos[0, a:a + DOCS[1]] = np.arange(DOCS[1])
  return toks, pos, seg


def check_packed_documents(cfg, params) -> float:
  """Each packed document gets the logits it has alone: the max |diff| relative to the largest |logit| alone
  (at most PACKED_RTOL)."""
  logits, _ = logits_of(cfg, params, packed_block(cfg))
  a, b = DOCS
  alone = (logits[1, :a], logits[2, :b])
  diff = max(float(np.abs(logits[0, :a] - alone[0]).max()), float(np.abs(logits[0, a:a + b] - alone[1]).max()))
  rel = diff / max(float(np.abs(alone[0]).max()), float(np.abs(alone[1]).max()))
  assert rel <= PACKED_RTOL, (f"a packed document's logits differ from its logits alone by {diff:.3g} "
                              f"({rel:.3g} of the largest, > {PACKED_RTOL})")
  return rel


def check_hf_round_trip(cfg, params, path, tokens=None, over: tuple[str, ...] = ()) -> None:
  """hf.save, then hf.load with the same execution settings: every leaf, and the logits, bit-identical (of
  packed_block, or of `tokens` [B, T] called as the README calls forward)."""
  meshlm.hf.save(cfg, params, path)
  cfg2, params2 = meshlm.hf.load(path, f"train.compute_dtype={cfg.train.compute_dtype}",
                                 f"scan_layers={str(cfg.scan_layers).lower()}", *over)
  flat, flat2 = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (params, params2))
  assert [p for p, _ in flat] == [p for p, _ in flat2], "the loaded tree's leaves are not the saved tree's"
  for (p, a), (_, b) in zip(flat, flat2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))
  if tokens is None:
    want, got = (logits_of(c, p, packed_block(cfg))[0] for c, p in ((cfg, params), (cfg2, params2)))
  else:
    want, got = (np.asarray(meshlm.forward(c, p, tokens)) for c, p in ((cfg, params), (cfg2, params2)))
  np.testing.assert_array_equal(got, want, err_msg="logits after hf.save -> hf.load")


def check_replay(cfg, params, out) -> float:
  """generate's recorded expert ids (out.expert_ids, the replay layout) fed back as forced_expert_ids give the
  logits of the forward that routes by itself, bit for bit. Returns the fraction of fed (token, layer) routings
  on which the sampler and the forward agree (at least 0.99: only float32 ties of the router may differ)."""
  ps, news = prompts(cfg), out.token_lists()
  block = right_padded([p + n for p, n in zip(ps, news)])
  free, side = logits_of(cfg, params, block)
  free_ids = np.moveaxis(side["moe_expert_ids"], 0, 2)  # [B, T, L_moe, k]
  rec = out.expert_ids[:, :T]
  fed = rec[..., 0, 0] >= 0  # [B, T]
  assert fed.sum() == sum(len(p) + NEW - 1 for p in ps), "the recorded ids do not cover every fed token"
  same = np.all(rec == free_ids, axis=-1)[fed]  # [fed tokens, L_moe]
  agree = float(same.mean())
  assert agree >= 0.99, f"the sampler routed {1 - agree:.1%} of the fed tokens' layers unlike the forward"
  # Every token forced: the recorded ids where fed, the forward's own elsewhere (padding, the last token), so the
  # expert groups hold the same rows in both forwards (a padding row routed elsewhere moves the grouped matmul's
  # blocks, and with them float32 sums, by an ulp).
  forced, side2 = logits_of(cfg, params, block, forced_expert_ids=np.where(fed[:, :, None, None], rec, free_ids))
  rows = [b for b in range(len(ps)) if np.all(np.all(rec[b] == free_ids[b], axis=-1)[fed[b]])]
  assert rows, "no row was routed alike by the sampler and the forward"
  np.testing.assert_array_equal(forced[rows], free[rows], err_msg="logits with the recorded ids forced")
  np.testing.assert_array_equal(np.moveaxis(side2["moe_expert_ids"], 0, 2)[rows][fed[rows]], rec[rows][fed[rows]])
  return agree


# --- explicit == auto on fsdp=4 ---------------------------------------------------------------------

def parity_batches(vocab: int, rows: int, steps: int = PARITY_STEPS, seq: int = PARITY_SEQ):
  """`steps` batches of random tokens, two packed documents per row, a ragged loss mask."""
  rng = np.random.default_rng(0)
  for _ in range(steps):
    toks = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    cut = rng.integers(seq // 4, 3 * seq // 4, rows)[:, None]
    col = np.arange(seq)[None, :]
    yield {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.where(col < cut, 1, 2).astype(np.int32),
           "positions": np.where(col < cut, col, col - cut).astype(np.int32),
           "loss_mask": (rng.random((rows, seq)) < 0.9).astype(np.float32)}


def lowered_step(overrides: tuple[str, ...], mode: str, run: tuple = PARITY_BASE):
  """(the train step, its lowering, its StableHLO census counts under explicit; {} under auto) on `run`'s settings
  (PARITY_BASE; REAL_PAIR: the settings real runs use)."""
  cfg = meshlm.load_config(*overrides, *run, f"shard_mode={mode}")
  window, T = cfg.model.sliding_window, cfg.train.seq_len
  assert window is None or window < T, f"sliding window {window} >= the trained sequence {T}"
  step = build_train_step(cfg)
  lowered = step.lower()
  census = {}
  if mode == "explicit":
    counts, pairs, _ = stablehlo_counts(lowered.as_text(debug_info=True))
    counts["transpose_of_dot"]["pairs"] = [{k: p[k] for k in ("kind", "between", "scope", "shape")} for p in pairs
                                           if p["kind"] == "blocked"]
    census = {"stablehlo": counts}
  return step, lowered, census


def run_steps(step, lowered, steps: int) -> dict[str, np.ndarray]:
  """{"loss", "grad_norm"} of `steps` steps of the lowered step from a fresh state (key 0), on parity_batches."""
  run = lowered.compile()
  state = step.init_state(jax.random.key(0))
  out = {"loss": [], "grad_norm": []}
  with jax.set_mesh(step.mesh):
    for batch in parity_batches(step.cfg.model.vocab_size, step.global_batch, steps, step.cfg.train.seq_len):
      state, metrics = run(state, step.put_batch(batch))
      for k in out:
        out[k].append(float(metrics[k]))
  return {k: np.asarray(v) for k, v in out.items()}


def stepped_pair(a, b, steps: int = PARITY_STEPS) -> dict[str, dict[str, np.ndarray]]:
  """{"a": {"loss", "grad_norm"}, "b": ...}: arm a's `steps` steps from a fresh state (key 0), as run_steps runs
  them, and arm b's step from each of a's states (a copy, put in b's shardings), on parity_batches. a, b: (step,
  compiled step).

  Two arms compared step by step from one state, not along their own trajectories: float32 reassociation moves
  a gradient element by an ulp, and AdamW's first update g / (|g| + 1e-8) turns an ulp of a near-zero element
  into up to 2 x the learning rate on its parameter. mixtral-tiny's explicit and auto states differed by 4.4e-5
  after one step that gave both the same loss and gradient norm bit for bit; a router's top-2 flipped at the
  next step, and the losses parted by 6.2e-5 (PARITY_ATOL is 1e-5)."""
  (sa, run_a), (sb, run_b) = a, b
  state = sa.init_state(jax.random.key(0))
  out = {arm: {"loss": [], "grad_norm": []} for arm in ("a", "b")}
  for batch in parity_batches(sa.cfg.model.vocab_size, sa.global_batch, steps, sa.cfg.train.seq_len):
    with jax.set_mesh(sb.mesh):
      _, mb = run_b(jax.device_put(state, sb.state_shardings(), may_alias=False), sb.put_batch(batch))
    with jax.set_mesh(sa.mesh):
      state, ma = run_a(state, sa.put_batch(batch))
    for arm, m in (("a", ma), ("b", mb)):
      for k in out[arm]:
        out[arm][k].append(float(m[k]))
  return {arm: {k: np.asarray(v) for k, v in got.items()} for arm, got in out.items()}


def assert_parity(explicit: np.ndarray, auto: np.ndarray) -> None:
  assert explicit.shape == auto.shape and explicit.shape[0] in (PARITY_STEPS, REAL_STEPS), explicit.shape
  assert np.all(np.isfinite(explicit)) and np.all(np.isfinite(auto))
  np.testing.assert_allclose(explicit, auto, rtol=0, atol=PARITY_ATOL)


def assert_pair(got: dict[str, dict[str, np.ndarray]]) -> None:
  """stepped_pair's arms: losses within PARITY_ATOL, gradient norms within PARITY_ATOL of each other (relative)."""
  assert_parity(got["a"]["loss"], got["b"]["loss"])
  np.testing.assert_allclose(got["a"]["grad_norm"], got["b"]["grad_norm"], rtol=PARITY_ATOL, atol=0,
                             err_msg="gradient norms")


def explicit_and_auto(overrides: tuple[str, ...], run: tuple | None = None) -> tuple:
  """(stepped_pair with a = explicit, b = auto; explicit's census), under the settings real runs use (REAL_PAIR,
  REAL_STEPS steps) unless `run` names others (PARITY_BASE: PARITY_STEPS)."""
  run = REAL_PAIR if run is None else run
  (se, le, census), (sa, la, _) = (lowered_step(overrides, mode, run) for mode in ("explicit", "auto"))
  steps = REAL_STEPS if run == REAL_PAIR else PARITY_STEPS
  return stepped_pair((se, le.compile()), (sa, la.compile()), steps), census


def check_explicit_equals_auto(overrides: tuple[str, ...], pair=None) -> dict:
  """Explicit's steps and auto's step from each of its states (explicit_and_auto): losses within PARITY_ATOL and
  gradient norms within PARITY_ATOL (relative), the steps really training, and no blocked transpose-of-dot pair
  under explicit. pair: explicit_and_auto's result (it may be a cache)."""
  got, census = pair or explicit_and_auto(overrides)
  assert_pair(got)
  explicit, auto = got["a"]["loss"], got["b"]["loss"]
  assert len(set(explicit.tolist())) == len(explicit), f"the losses do not move: {explicit.tolist()}"
  blocked = field(census, "stablehlo.transpose_of_dot.blocked")
  assert blocked == 0, (f"explicit: {blocked} blocked transpose-of-dot pairs (want 0): "
                       f"{census['stablehlo']['transpose_of_dot']['pairs']}")
  return {"max_loss_diff": float(np.max(np.abs(explicit - auto))),
          "max_grad_norm_rdiff": float(np.max(np.abs(got["a"]["grad_norm"] / got["b"]["grad_norm"] - 1))),
          "losses": explicit.tolist()}


@functools.cache
def family_of_fixture(path: str) -> str:
  """The meshlm family an HF fixture directory loads as."""
  from meshlm.hf import io
  from meshlm.hf.adapters import ADAPTERS
  import importlib
  adapter = io.family_for(io.read_hf_config(Path(path)), path)
  return next(name for name, module in ADAPTERS.items() if importlib.import_module(module).ADAPTER is adapter)


# --- the settings real runs use: rematerialized scanned layers, flash, the blockwise loss, the GDN kernel ------

REAL_STEPS = 2
REAL_SEQ = 72  # past every tiny preset's sliding window and a GDN chunk (64); the loss's last block is ragged
# gdn_impl=pallas: the Gated DeltaNet layers run the Pallas kernels (in interpret mode here), as they do on TPU.
REAL_RUN = ("scan_layers=true", "attention_impl=flash", "loss_impl=blockwise", "loss_block=32", "gdn_impl=pallas",
            f"train.seq_len={REAL_SEQ}", "train.compute_dtype=float32", "train.warmup_steps=0",
            "train.learning_rate=3e-3", "shard_mode=explicit")
# Every arm steps on the same global batch of 2 rows, so on the same batches. The rows run REAL_ARMS (each remat
# policy once, one on each mesh: the full matrix of both policies on both meshes and remat=none cost 527 s of CPU
# for the 13 tiny presets, measured; these two about half of it); REFERENCE is remat=none on one device.
REAL_ARMS = {"full": ("remat=full", "cpu_devices=1", "train.per_device_batch_size=2"),
             "dots_fsdp2": ("remat=dots", "cpu_devices=2", "mesh.fsdp=2", "train.per_device_batch_size=1")}
REFERENCE = ("remat=none", "cpu_devices=1", "train.per_device_batch_size=2")
# explicit == auto where real runs train: the dots_fsdp2 arm (REAL_RUN's shard_mode replaced by the pair's).
REAL_PAIR = (*REAL_RUN, *REAL_ARMS["dots_fsdp2"])
# Remat recomputes the same float32 operations, but XLA fuses the rematerialized program otherwise: on one mesh
# losses within REMAT_ATOL and gradient norms within REMAT_GRAD_RTOL (relative) of another arm's (measured against
# remat=none: 0 on 10 presets, at most 4.8e-7 and 1.5e-6 on the GDN hybrids); across meshes, where the sums run in
# another order, PARITY_ATOL for both (measured at most 1.4e-6 and 5.8e-7).
REMAT_ATOL = 1e-6
REMAT_GRAD_RTOL = 5e-6
# gdn_impl=pallas against gdn_impl=jax along their own REAL_STEPS steps: the kernel sums in another order (float32
# products of 1e-7 relative), which AdamW's first update g / (|g| + 1e-8) can magnify on a near-zero gradient element.
# Losses within GDN_KERNEL_ATOL, gradient norms within it relative (the 1e-4).
GDN_KERNEL_ATOL = 1e-4


def real_run_metrics(overrides: tuple[str, ...]) -> dict[str, np.ndarray]:
  """{"loss", "grad_norm"} of REAL_STEPS train steps under REAL_RUN and `overrides` (which win: gdn_impl=jax)."""
  cfg = meshlm.load_config(*REAL_RUN, *overrides)
  step = build_train_step(cfg)
  return run_steps(step, step.lower(), REAL_STEPS)


def _devices(arm: tuple[str, ...]) -> str:
  return next(o for o in arm if o.startswith("cpu_devices="))


def check_real_runs_agree(runs: dict[str, dict[str, np.ndarray]], arms: dict[str, tuple[str, ...]]) -> dict:
  """Every run finite; each run's losses and gradient norms those of the first (arms: each run's overrides, for
  its device count). Returns the largest differences from the first."""
  (first, ref), *rest = runs.items()
  out = {}
  for arm, got in runs.items():
    for k, v in got.items():
      assert v.shape == (REAL_STEPS,) and np.all(np.isfinite(v)), f"{arm}: {k} {v.tolist()}"
  for arm, got in rest:
    same = _devices(arms[arm]) == _devices(arms[first])
    atol, rtol = (REMAT_ATOL, REMAT_GRAD_RTOL) if same else (PARITY_ATOL, PARITY_ATOL)
    loss = float(np.max(np.abs(got["loss"] - ref["loss"])))
    grad = float(np.max(np.abs(got["grad_norm"] / ref["grad_norm"] - 1)))
    assert loss <= atol, f"{arm}: losses {got['loss'].tolist()}, {first}'s {ref['loss'].tolist()} (> {atol})"
    assert grad <= rtol, (f"{arm}: gradient norms {got['grad_norm'].tolist()}, {first}'s "
                          f"{ref['grad_norm'].tolist()} (relative > {rtol})")
    out[arm] = {"loss": loss, "grad_norm": grad}
  return out


# --- one layer's attending part alone (tests/test_attention_conformance.py, tests/test_attention_tpu.py) ---------

def attending(cfg) -> list[tuple[str, str]]:
  """(kind, context) of each distinct (attending mixer, attention context) of cfg's plan, in layer order: the first
  layer of that kind in that context whose mixer attends (Instrument.attention_width set)."""
  from meshlm.models.model import resolve
  M = resolve(cfg)
  seen: dict = {}
  for kind, context in zip(M.plan.kinds, M.plan.contexts):
    mixer = M.family.kinds[kind].mixer
    if mixer.instrument.attention_width is not None:
      seen.setdefault((mixer.name, context), (kind, context))
  return list(seen.values())


def part_step(cfg, kind: str, context: str):
  """(fn, specs): the mixer's half of one layer of `kind` under `context` alone, as the model runs it (Kind.half:
  the pre-norm, the part, the post-norm where the kind has one, the residual; its parameters prepared as the layer
  loop prepares them; the context the decoder makes for the batch: the attention core resolved for the mesh's
  platform, rows and segment ids; rematerialized per cfg.remat), forward and backward:
  fn(p, x [B, T, D], positions [B, T], segment_ids [B, T], ct [B, T, D]) -> (y, dp, dx), the VJP of ct.
  specs: that half's one-layer ParamSpecs ([1, ...] stacks, layer axis leading). Call fn under the row's mesh."""
  import jax.numpy as jnp
  from meshlm import spec as S
  from meshlm.models import decoder
  from meshlm.models.model import resolve
  M = resolve(cfg)
  k = M.family.kinds[kind]
  keys = k.half_keys(0)
  specs = S.stack({n: s for n, s in k.spec(M.m).items() if n in keys}, 1, 0)
  dt = jnp.dtype(cfg.train.compute_dtype)

  def fn(p, x, positions, segment_ids, ct):
    ctx = decoder.context(M, positions, segment_ids).as_context(context)
    if k.mixer.compute.prepare is not None:
      p = dict(p, **{k.mixer.key: k.mixer.compute.prepare(p[k.mixer.key], specs[k.mixer.key], dt)})

    def apply(p, x):
      return k.half(0, jax.tree.map(lambda a: a[0], p), x, ctx)[0]
    if cfg.remat != "none":  # as the layer loop runs a layer (models/layers._Run.layer_fn)
      apply = jax.checkpoint(apply, policy=M.remat_policy)
    y, vjp = jax.vjp(apply, p, x.astype(dt))
    return (y, *vjp(ct.astype(y.dtype)))
  return fn, specs


def part_arguments(cfg, specs, mesh, T: int, rows: int) -> list:
  """part_step's abstract arguments on mesh: the parameters (param dtype) and x, positions, segment ids and the
  cotangent of `rows` rows per device of T positions, sharded as the model's."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from meshlm import spec as S
  from meshlm.parallel.sharding import ACT, logical_spec
  B = rows * mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  D = cfg.model.embed_dim
  named = lambda axes, shape: NamedSharding(mesh, logical_spec(axes, shape, mesh))  # noqa: E731
  p = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(cfg.train.param_dtype),
                                                  sharding=named(s.axes, s.shape)), specs, is_leaf=S.is_spec)
  act = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=named(ACT, (B, T, D)))
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=named(ACT[:2], (B, T)))
  return [p, act, ids, ids, act]
