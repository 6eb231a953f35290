"""Expert parallelism (nn/moe/expert_parallel.py's `dispatch_gather`): the MoE layer with its experts sharded over mesh.expert.

- The layer under EP equals the unsharded layer (forward and every gradient, float32, within 1e-6) on
  expert=2 x fsdp=2 and data=2 x expert=2 under both shard modes, with the batch split over the expert
  axis (all-gather in, reduce-scatter out), on expert=2 with the batch not split (psum), and with
  ragged_dot; the expert kernels' gradients stay sharded on experts. A wrong local-expert offset fails
  the same check.
- dispatch(expert_offset=) alone: two halves of the experts add up to the whole, and rows of other
  experts get no grouped-matmul blocks.
- The compiled step never moves a whole expert kernel: no collective of the full [E, D, F] shape
  (the fsdp=4 layer without EP has them: control), and each shard_map sees E / ep experts.
- The whole model (mixtral-tiny, one layer), STEPS train steps in float32 with both router losses
  on: explicit equals auto on expert=2 x fsdp=2 (the experts on both axes, model.moe_kernel_fsdp's
  default), and EP (expert=2 x fsdp=2) equals no EP (fsdp=4 with model.moe_kernel_fsdp=embed),
  max |loss diff| <= 1e-5, the aux losses compared too. On data=2 x expert=2 explicit = auto is held by
  its parts: the MoE layer there (the batch split over data x expert, both router losses in the loss)
  equals the unsharded layer under both modes above, and the dense layers on a batch split over data
  and a second axis are tests/test_train.py's data2_fsdp2 explicit = auto.
The layer-level tests lay the kernels out as model.moe_kernel_fsdp=embed does (EP over mesh.expert
only, FSDP on embed); tests/test_moe_kernel_fsdp.py covers the experts dim over fsdp.
"""
import functools
import re

import jax
import jax.extend  # jax.extend.core.jaxprs_in_params below: jax does not import the submodule itself
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshlm.config import load_config
from meshlm.nn import moe
from meshlm.nn.moe import expert_parallel, gmm
from meshlm.nn.dense import dense
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import logical_spec
from meshlm.train.step import build_train_step
from moe_helpers import settings

B, T, D, F, E, K = 4, 7, 24, 20, 8, 2  # B = 4 splits over data x expert; T odd
TOL = 1e-6  # float32 reassociation, max |diff| / max(1, max |reference|) per leaf


def _inputs(seed: int = 0):
  """x and params routing unevenly: expert 0 takes every token, experts E-2 and E-1 none (so one
  shard's group is full and another has empty experts)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  x[..., 0] = np.abs(x[..., 0]) + 1.0
  router = (0.1 * rng.standard_normal((D, E))).astype(np.float32)
  router[0, 0], router[0, E - 2], router[0, E - 1] = 3.0, -8.0, -8.0
  p = {"router": router,
       "gate": (rng.standard_normal((E, D, F)) / np.sqrt(D)).astype(np.float32),
       "up": (rng.standard_normal((E, D, F)) / np.sqrt(D)).astype(np.float32),
       "down": (rng.standard_normal((E, F, D)) / np.sqrt(F)).astype(np.float32)}
  return jnp.asarray(x), jax.tree.map(jnp.asarray, p)


SPEC = moe.moe_spec(D, E, F, kernel_fsdp="embed")
CTX = type("Ctx", (), {"dense": staticmethod(functools.partial(dense, kernel_order=True))})


def _loss(y, side):
  c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
  return jnp.sum(c * y) / y.shape[0] + side["moe_load_balance_loss"] + 0.1 * side["moe_z_loss"]


def _layer(**kw):
  def f(p, x):
    y, side = moe.moe_mlp(p, x, CTX, *settings(E, K, norm_topk_prob=True, **kw))
    return _loss(y, side), y
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


def _rel_diffs(out, ref) -> dict:
  (loss, y), (gp, gx) = out
  (rloss, ry), (rgp, rgx) = ref
  pairs = {"loss": (loss, rloss), "y": (y, ry), "d_x": (gx, rgx)} | {f"d_{k}": (gp[k], rgp[k]) for k in rgp}
  return {k: float(jnp.max(jnp.abs(a - b)) / max(1.0, float(jnp.max(jnp.abs(b))))) for k, (a, b) in pairs.items()}


def _mesh(axes: dict, mode: str):
  n = int(np.prod(list(axes.values())))
  # An MoE preset: mesh.expert on a dense model is refused at load.
  return make_mesh(load_config("model=mixtral-tiny", f"cpu_devices={n}", "mesh.fsdp=1",
                               *(f"mesh.{a}={s}" for a, s in axes.items()),
                               f"shard_mode={mode}"))


def run_sharded(axes: dict, mode: str, rows: int = B, **kw):
  """(outputs, grads' types, compiled HLO text) of the layer's value_and_grad on a mesh, params and x
  placed as the model places them."""
  x, p = _inputs()
  mesh = _mesh(axes, mode)
  with jax.set_mesh(mesh):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
    ps = {k: put(v, SPEC[k].axes) for k, v in p.items()}
    xs = put(x[:rows], ("batch", "length", "act_embed"))
    compiled = jax.jit(_layer(**kw)).lower(ps, xs).compile()
    out = compiled(ps, xs)
    types = {k: str(jax.typeof(v)) for k, v in out[1][0].items()}
    shardings = {k: v.sharding.spec for k, v in out[1][0].items()}
  return out, types, shardings, compiled.as_text()


@pytest.fixture(scope="module")
def unsharded():
  x, p = _inputs()
  f = jax.jit(_layer())
  return {rows: f(p, x[:rows]) for rows in (B, 3)}


EP_MESHES = {"expert2": {"expert": 2}, "expert2-fsdp2": {"expert": 2, "fsdp": 2},
             "data2-expert2": {"data": 2, "expert": 2}}
_runs: dict = {}


def sharded(name: str, mode: str, rows: int = B, **kw):
  key = (name, mode, rows, tuple(sorted(kw.items())))
  if key not in _runs:
    _runs[key] = run_sharded(EP_MESHES[name], mode, rows, **kw)
  return _runs[key]


# expert=2 alone runs the expert2-fsdp2 arm's dispatch (the same expert axis, the batch gathered over it) without
# the kernels' fsdp gather: its own mesh has the psum path (3 rows) below.
@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("name", ["expert2-fsdp2", "data2-expert2"])
def test_ep_equals_unsharded(unsharded, name, mode):
  out, types, shardings, _ = sharded(name, mode)
  diffs = _rel_diffs(out, unsharded[B])
  print(name, mode, diffs)
  assert set(diffs) == {"loss", "y", "d_x", "d_router", "d_gate", "d_up", "d_down"}
  assert max(diffs.values()) <= TOL, diffs
  # The expert kernels' gradients come back sharded on experts, as the kernels are stored.
  for k in ("gate", "up", "down"):
    assert shardings[k][0] == "expert", (k, shardings[k])
    if mode == "explicit":
      assert f"{E}@expert" in types[k], types[k]


def test_ep_with_the_batch_not_split_over_experts(unsharded):
  """3 rows do not split over expert=2: every device of the group holds the same tokens, computes its
  experts' part, and a psum adds the parts (no gather of the tokens, no scatter). The one all-gather is the
  router kernel's: its embed dim is sharded over expert, as every non-expert parameter's (parallel/sharding.RULES)."""
  out, _, _, hlo = sharded("expert2", "explicit", rows=3)
  assert not re.search(r"reduce-scatter", hlo)  # the psum path
  gathered = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo)
  assert gathered and set(gathered) == {f"f32[{D},{E}]"}, gathered
  diffs = _rel_diffs(out, unsharded[3])
  assert max(diffs.values()) <= TOL, diffs


def test_ep_with_ragged_dot(unsharded):
  """ragged_dot gives zeros past its groups' rows: the non-local slots cost no group there either."""
  out, _, _, _ = sharded("expert2-fsdp2", "explicit", grouped_matmul="ragged")
  diffs = _rel_diffs(out, unsharded[B])
  assert max(diffs.values()) <= TOL, diffs


def test_a_wrong_local_expert_offset_fails(unsharded, monkeypatch):
  """Negative control: each shard computing its neighbour's expert ids with its own kernels."""
  real = expert_parallel.local_expert_offset
  monkeypatch.setattr(expert_parallel, "local_expert_offset",
                      lambda n, axes: (real(n, axes) + n) % E)  # shard i takes the ids of shard i + 1
  try:
    out, _, _, _ = run_sharded(EP_MESHES["expert2-fsdp2"], "explicit")
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  diffs = _rel_diffs(out, unsharded[B])
  print("wrong offset:", diffs)
  assert diffs["y"] > 1e-2 and diffs["d_gate"] > 1e-2


# --- no whole expert kernel on any device ---------------------------------------------------------------

def _collective_results(hlo: str) -> list[str]:
  """The result types of the compiled module's collectives ("f32[4,24,20]{2,1,0}", tuples whole)."""
  kinds = r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
  return [m.group(1) for m in re.finditer(rf"= (.+?) (?:{kinds})(?:-start)?\(", hlo)]


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_no_whole_expert_kernel_moves(mode):
  _, _, _, hlo = sharded("expert2-fsdp2", mode)
  results = _collective_results(hlo)
  whole = [r for r in results if f"[{E},{D},{F}]" in r or f"[{E},{F},{D}]" in r]
  assert not whole, whole
  # What moves instead: each device's E / ep experts, gathered over fsdp ([4, 24, 20] from [4, 12, 20]).
  assert any(f"[{E // 2},{D},{F}]" in r for r in results), results


def test_the_kernel_check_sees_a_whole_kernel_without_ep():
  """Control for the check above: fsdp=4 without EP gathers each expert kernel whole."""
  _, _, _, hlo = run_sharded({"fsdp": 4}, "explicit")
  results = _collective_results(hlo)
  assert any(f"[{E},{D},{F}]" in r for r in results), results


def test_each_shard_map_holds_its_experts_only():
  x, p = _inputs()
  mesh = _mesh(EP_MESHES["expert2-fsdp2"], "explicit")
  with jax.set_mesh(mesh):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, logical_spec(axes, a.shape, mesh)))  # noqa: E731
    jaxpr = jax.make_jaxpr(_layer())({k: put(v, SPEC[k].axes) for k, v in p.items()},
                                     put(x, ("batch", "length", "act_embed")))
  inner = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "shard_map":
        inner.append([tuple(v.aval.shape) for v in eqn.params["jaxpr"].invars])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  assert inner, "no shard_map in the layer"
  for shapes in inner:
    assert (E // 2, D, F) in shapes and (E // 2, F, D) in shapes, shapes
    assert not {(E, D, F), (E, F, D)} & set(shapes), shapes


# --- the whole model: explicit equals auto, EP equals no EP ----------------------------------------------

# 8 steps, each with its own batch, from one init: the step's every path (dispatch, both router losses, the
# update of EP-sharded kernels) runs from the second step on trained weights; more steps repeat the same code.
# One layer: a second (unrolled) layer is the same code compiled again; its kernels read in place from their stacks
# under expert parallelism are tests/test_stack_rows.py's (fsdp2 experts).
STEPS = 8
SEQ_LEN = 32
MODEL_BASE = ("cpu_devices=4", "model.num_layers=1", "train.per_device_batch_size=1", f"train.seq_len={SEQ_LEN}",
              "train.compute_dtype=float32", "train.warmup_steps=0", "train.learning_rate=3e-3",
              "model.parts.moe.router_aux_loss_coef=0.1", "model.parts.moe.router_z_loss_coef=0.01")
MODEL_MESHES = {"expert2-fsdp2": ("mesh.fsdp=2", "mesh.expert=2"),
                "fsdp4": ("mesh.fsdp=4", "model.parts.moe.kernel_fsdp=embed")}  # no EP: the kernels gathered
PARITY_ATOL = 1e-5
METRICS = ("loss", "moe_aux_loss", "moe_z_loss")


def _batches(vocab: int, rows: int):
  rng = np.random.default_rng(0)
  for _ in range(STEPS):
    toks = rng.integers(0, vocab, (rows, SEQ_LEN + 1)).astype(np.int32)
    yield {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((rows, SEQ_LEN), np.int32),
           "positions": np.broadcast_to(np.arange(SEQ_LEN, dtype=np.int32), (rows, SEQ_LEN)).copy(),
           "loss_mask": (rng.random((rows, SEQ_LEN)) < 0.9).astype(np.float32)}


def train_metrics(preset: str, mesh: str, mode: str) -> dict[str, np.ndarray]:
  """Loss and router losses of STEPS train steps (compiled once) from the same init and batches."""
  cfg = load_config(f"model={preset}", *MODEL_BASE, *MODEL_MESHES[mesh], f"shard_mode={mode}")
  step = build_train_step(cfg)
  state = step.init_state(jax.random.key(0))
  out = {k: [] for k in METRICS}
  for batch in _batches(cfg.model.vocab_size, step.global_batch):
    state, metrics = step(state, step.put_batch(batch))
    for k in METRICS:
      out[k].append(float(metrics[k]))
  return {k: np.asarray(v) for k, v in out.items()}


_trained: dict = {}


def trained(preset: str, mesh: str, mode: str) -> dict[str, np.ndarray]:
  if (preset, mesh, mode) not in _trained:
    _trained[preset, mesh, mode] = train_metrics(preset, mesh, mode)
  return _trained[preset, mesh, mode]


def max_diff(a: dict, b: dict) -> float:
  """The largest of: max |loss diff| (the loss holds both router losses times their coefficients) and
  max |diff| / |value| of the router losses themselves (their values reach ~6: the z-loss is a squared
  logsumexp, so 1e-5 absolute there is float32 rounding, not a bug)."""
  loss = float(np.max(np.abs(a["loss"] - b["loss"])))
  aux = max(float(np.max(np.abs(a[k] - b[k]) / np.abs(b[k]))) for k in METRICS[1:])
  return max(loss, aux)


MODEL_PRESETS = ["mixtral-tiny"]


@pytest.mark.slow  # 2 compiles of a whole train step and STEPS steps each
# mixtral-tiny on expert=2 x fsdp=2 (whose explicit run test_model_ep_equals_no_ep reuses). The EP dispatch is the
# moe part's, the same for every MoE family; qwen3-moe-tiny's mixed dense and MoE layers train under both modes in
# test_conformance (the suite's budget). data=2 x expert=2: by its parts (the module docstring; two compiles fewer).
@pytest.mark.parametrize("preset, mesh", [("mixtral-tiny", "expert2-fsdp2")])
def test_model_explicit_equals_auto_under_ep(preset, mesh):
  explicit, auto = trained(preset, mesh, "explicit"), trained(preset, mesh, "auto")
  print(f"{preset} {mesh}: explicit vs auto, {STEPS} steps: max |diff| = {max_diff(explicit, auto):.3g} "
        f"(losses {np.round(explicit['loss'], 4).tolist()})")
  for k in METRICS:
    assert np.all(np.isfinite(explicit[k])) and np.all(explicit[k] > 0), k
  assert len(set(explicit["loss"].tolist())) == STEPS  # it trains: every step's loss differs
  assert max_diff(explicit, auto) <= PARITY_ATOL


@pytest.mark.slow  # one more train step (fsdp=4); the EP run is shared with the test above
@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_model_ep_equals_no_ep(preset):
  ep, no_ep = trained(preset, "expert2-fsdp2", "explicit"), trained(preset, "fsdp4", "explicit")
  print(f"{preset}: expert=2 x fsdp=2 vs fsdp=4, {STEPS} steps: max |diff| = {max_diff(ep, no_ep):.3g}")
  assert max_diff(ep, no_ep) <= PARITY_ATOL
  # Control: one step of training apart is far outside the tolerance, so the check can fail.
  shifted = {k: np.roll(v, 1) for k, v in no_ep.items()}
  assert max_diff(ep, shifted) > 100 * PARITY_ATOL


# --- the local dispatch on its own (no mesh) ---------------------------------------------------------------

def test_local_dispatches_sum_to_the_whole_and_skip_other_experts(monkeypatch):
  """dispatch(expert_offset=o) with experts [o, o + E/2) only: the two halves add up to the whole
  dispatch, and the grouped matmul gives rows of other experts no block (they cost nothing)."""
  x, p = _inputs()
  x_ND = x.reshape(-1, D)
  logits = x_ND @ p["router"]
  _, w, ids = moe.route(logits, K, True)
  s = settings(E, K, grouped_matmul="blocks", block_rows=4)
  want = jax.jit(lambda x, ids, w, p: moe.dispatch(x, ids, w, p["gate"], p["up"], p["down"], *s)[0])(x_ND, ids, w, p)
  live = []
  real = gmm.block_layout

  def counted(*a):  # each grouped matmul's live blocks, in program order
    out = real(*a)
    jax.debug.callback(lambda n: live.append(int(n)), jnp.sum(out[3]), ordered=True)
    return out
  monkeypatch.setattr(gmm, "block_layout", counted)
  half = E // 2
  parts = jax.jit(lambda x, ids, w, p: [
      moe.dispatch(x, ids, w, *(p[k][o:o + half] for k in ("gate", "up", "down")), *s,
                   expert_offset=jnp.int32(o))[0] for o in (0, half)])(x_ND, ids, w, p)
  jax.effects_barrier()
  np.testing.assert_allclose(parts[0] + parts[1], want, rtol=0, atol=1e-6)
  counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
  # Two grouped matmuls (gate|up, down) per half; each uses ceil(rows / 4) blocks per local expert.
  need = [int(np.sum(-(-counts[o:o + half] // 4))) for o in (0, half)]
  assert live == [need[0], need[0], need[1], need[1]], (live, need)
  assert counts[:half].sum() != counts[half:].sum()  # uneven halves: the counts tell them apart
