"""nn/gdn.py: the chunked gated delta rule against the recurrence (outputs, final state, every gradient),
packed documents against each document alone, the within-chunk triangular inverse against float64, and
the refusals. Float32 throughout; tiny shapes, one jit per shape config (module-level caches)."""
from __future__ import annotations

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.nn import gdn
from meshlm.parallel.mesh import make_mesh
from meshlm.parallel.sharding import is_explicit

# max |chunked - reference| / max |reference| per array (o, final state, and the gradients w.r.t. q, k, v,
# g, beta, initial state). Measured at most 9.5e-7 over every case below (T = 500, chunk 64: the
# gradients of beta and of the initial state); the bound leaves 5x.
RULE_RTOL = 5e-6
# Packed against alone, max abs difference in o and every gradient (the 1e-5). Measured 1.4e-6.
PACKED_ATOL = 1e-5
# Packed rows without the reset (segment_ids=None) must differ from alone by more than this in o.
NO_RESET_MIN_DIFF = 1e-2
# The inverse against a float64 numpy inverse of the same float32 A, max abs (the 1e-6).
# Measured at most 2.9e-8, every variant, at chunk 64 (dropping one column's update: 0.16 to 0.39).
INVERSE_ATOL = 1e-6
# The adversarial case (|A|_inf ~ 44): max abs error / max |X64|. Measured 3.2e-8 for right_looking.
ADVERSARIAL_RTOL = 1e-5

B, K, N, H, J = 2, 1, 2, 8, 8


def rule_inputs(T, *, b=B, k_heads=K, n=N, h=H, j=J, seed=0):
  """q, k L2-normalized (q scaled), v, g <= 0, beta in (0, 1), an initial state, and cotangents for o and
  the final state. Made in numpy, then placed: an eager jnp op would compile one small program per shape."""
  r = np.random.default_rng(seed)
  f = lambda *s: r.standard_normal(s).astype(np.float32)
  unit = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))  # gdn.l2_normalize's
  q = unit(f(b, T, k_heads, h)) * np.float32(h ** -0.5)
  k = unit(f(b, T, k_heads, h))
  v = f(b, T, n, j)
  g = -r.uniform(0.01, 0.7, (b, T, n)).astype(np.float32)
  beta = r.uniform(0.05, 0.95, (b, T, n)).astype(np.float32)
  s0 = np.float32(0.5) * f(b, n, h, j)
  put = lambda *xs: tuple(jnp.asarray(x) for x in xs)
  return put(q, k, v, g, beta, s0), put(f(b, T, n, j), f(b, n, h, j))


def several_docs(T):
  """Row 0: one document. Row 1: three documents (boundaries at T/3 and 2T/3) then a padding tail."""
  ids = np.ones((B, T), np.int32)
  ids[1, T // 3:] = 2
  ids[1, 2 * T // 3:] = 3
  ids[1, T - T // 10:] = 0
  return jnp.asarray(ids)


@functools.cache
def rule_fn(impl, chunk_size, with_ids, with_state):
  """jit: (args, ids, cotangents) -> (o, final state, grads w.r.t. q, k, v, g, beta, initial state)."""
  def run(args, ids, cots):
    def f(q, k, v, g, beta, s0):
      return gdn.gated_delta_rule(q, k, v, g, beta, segment_ids_BT=ids if with_ids else None,
                                  initial_state_BNHJ=s0 if with_state else None, impl=impl, chunk_size=chunk_size)
    (o, S), vjp = jax.vjp(f, *args)
    return o, S, vjp(cots)
  return jax.jit(run)


def rel_err(x, ref):
  x, ref = np.asarray(x), np.asarray(ref)
  return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


CASES = [(1, 32, True, True), (63, 32, True, True), (64, 32, True, True), (65, 32, True, True),
         (150, 32, True, True), (150, 32, False, False), (500, 64, True, True)]


@pytest.mark.parametrize("T,chunk,with_ids,with_state", CASES)
def test_chunked_equals_reference(T, chunk, with_ids, with_state):
  args, cots = rule_inputs(T, seed=T)
  ids = several_docs(T)
  got = rule_fn("chunked", chunk, with_ids, with_state)(args, ids, cots)
  want = rule_fn("reference", chunk, with_ids, with_state)(args, ids, cots)
  names = ["o", "final state"] + [f"d{n}" for n in ("q", "k", "v", "g", "beta", "initial state")]
  got, want = [got[0], got[1], *got[2]], [want[0], want[1], *want[2]]
  assert got[0].dtype == args[2].dtype and got[1].dtype == jnp.float32
  errs = {n: rel_err(a, b) for n, a, b in zip(names, got, want) if with_state or n != "dinitial state"}
  assert max(errs.values()) < RULE_RTOL, errs


def test_more_value_heads_than_key_heads():
  # N = 3 K: value head n reads key head n // 3, for q and k alike.
  args, cots = rule_inputs(40, k_heads=2, n=6, seed=7)
  ids = several_docs(40)
  run = lambda impl: jax.jit(lambda a, i: gdn.gated_delta_rule(*a[:5], segment_ids_BT=i, initial_state_BNHJ=a[5],
                                                                impl=impl, chunk_size=16))(args, ids)
  (o, S), (o_ref, S_ref) = run("chunked"), run("reference")
  assert rel_err(o, o_ref) < RULE_RTOL and rel_err(S, S_ref) < RULE_RTOL


# ------------------------------------------------------------------------- packed equals alone

PACKED_T, PACKED_CHUNK = 80, 16
# (id, length) runs. Row 0: a boundary inside chunk 0, one on the chunk edge at 16, a zero-length id (3)
# skipped, a document across the edge at 32, a padding-only segment, a document across the edges at 48
# and 64, padding to the end. Row 1: leading padding, a document ending on the edge at 32, a one-token
# document, a document to the row's end (its final state is compared).
PACKED_ROWS = [[(1, 5), (2, 11), (4, 20), (0, 4), (5, 25), (0, 15)],
               [(0, 3), (7, 29), (8, 1), (9, 47)]]


def packed_layout():
  ids = np.concatenate([np.concatenate([np.full(n, i, np.int32) for i, n in row]) for row in PACKED_ROWS])
  docs = []  # (row, start, length, id)
  for b, row in enumerate(PACKED_ROWS):
    t = 0
    for i, n in row:
      if i != 0:
        docs.append((b, t, n, i))
      t += n
  return jnp.asarray(ids.reshape(len(PACKED_ROWS), PACKED_T)), docs


@functools.cache
def packed_fn(with_ids):
  def run(args, ids, cots):
    f = lambda q, k, v, g, beta, s0: gdn.gated_delta_rule_chunked(
        q, k, v, g, beta, segment_ids_BT=ids if with_ids else None, initial_state_BNHJ=s0, chunk_size=PACKED_CHUNK)
    (o, S), vjp = jax.vjp(f, *args)
    return o, S, vjp(cots)
  return jax.jit(run)


@pytest.fixture(scope="module")
def packed_and_alone():
  """The packed rows, each document alone (row d: document d at position 0, zeros after, no segment ids;
  the initial state only for the document that opens a row at t = 0), and the packed rows without ids."""
  ids, docs = packed_layout()
  (q, k, v, g, beta, s0), (co, cs) = rule_inputs(PACKED_T, seed=3)
  packed = packed_fn(True)((q, k, v, g, beta, s0), ids, (co, cs))
  no_reset = packed_fn(False)((q, k, v, g, beta, s0), ids, (co, cs))

  def alone_rows(x):
    x = np.asarray(x)
    rows = np.zeros((len(docs),) + x.shape[1:], x.dtype)
    for d, (b, t, n, _) in enumerate(docs):
      rows[d, :n] = x[b, t:t + n]
    return jnp.asarray(rows)
  s0_alone = np.stack([np.asarray(s0[b]) * (t == 0) for b, t, _, _ in docs])
  cs_alone = np.stack([np.asarray(cs[b]) * (t + n == PACKED_T) for b, t, n, _ in docs])
  alone_args = tuple(alone_rows(x) for x in (q, k, v, g, beta)) + (jnp.asarray(s0_alone),)
  alone = packed_fn(False)(alone_args, None, (alone_rows(co), jnp.asarray(cs_alone)))
  as_np = lambda out: jax.tree.map(np.asarray, out)
  return docs, as_np(packed), as_np(alone), as_np(no_reset)


def test_packed_equals_alone(packed_and_alone):
  docs, (o, S, grads), (o1, S1, grads1), _ = packed_and_alone
  worst = {}
  for d, (b, t, n, i) in enumerate(docs):
    pairs = {"o": (o[b, t:t + n], o1[d, :n])}
    for name, gp, ga in zip(("dq", "dk", "dv", "dg", "dbeta"), grads[:5], grads1[:5]):
      pairs[name] = (gp[b, t:t + n], ga[d, :n])
    if t == 0:
      pairs["dinitial state"] = (grads[5][b], grads1[5][d])
    if t + n == PACKED_T:
      pairs["final state"] = (S[b], S1[d])
    for name, (x, y) in pairs.items():
      worst[(i, name)] = float(np.max(np.abs(x - y)))
  assert max(worst.values()) < PACKED_ATOL, {key: e for key, e in worst.items() if e >= PACKED_ATOL}
  assert {(9, "final state"), (1, "dinitial state")} <= set(worst)  # both were compared


def test_packed_without_the_reset_differs(packed_and_alone):
  # The negative control: with segment_ids=None the state leaks from one document into the next.
  docs, _, (o1, _, _), (o_leak, _, _) = packed_and_alone
  leaks = [float(np.max(np.abs(o_leak[b, t:t + n] - o1[d, :n]))) for d, (b, t, n, _) in enumerate(docs) if t > 0]
  assert min(leaks) > NO_RESET_MIN_DIFF, leaks


def test_all_zero_q_and_k_rows_stay_finite():
  T = 40
  r = np.random.default_rng(1)
  q_raw, k_raw = (r.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
  q_raw[:, 5:9], k_raw[:, 7:20] = 0.0, 0.0
  (_, _, v, g, beta, _), _ = rule_inputs(T)

  def loss(q_raw, k_raw, v, g, beta):
    q = gdn.l2_normalize(q_raw) * H ** -0.5
    k = gdn.l2_normalize(k_raw)
    o, S = gdn.gated_delta_rule_chunked(q, k, v, g, beta, segment_ids_BT=several_docs(T), chunk_size=16)
    return jnp.sum(o) + jnp.sum(S), o
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(q_raw, k_raw, v, g, beta)
  assert np.all(np.isfinite(np.asarray(o)))
  assert all(np.all(np.isfinite(np.asarray(x))) for x in grads)


@pytest.mark.parametrize("chunk", [48, 0, 3])
def test_chunk_size_not_a_power_of_two_is_refused(chunk):
  (q, k, v, g, beta, _), _ = rule_inputs(8)
  with pytest.raises(ConfigError, match=rf"model\.parts\.gdn\.chunk_size={chunk}: .*power of two"):
    gdn.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk)


def test_unknown_impl_and_inverse_are_refused():
  (q, k, v, g, beta, _), _ = rule_inputs(8)
  with pytest.raises(ValueError, match="impl='naive'"):
    gdn.gated_delta_rule(q, k, v, g, beta, impl="naive")
  with pytest.raises(ValueError, match="inverse='lu'"):
    gdn.gated_delta_rule_chunked(q, k, v, g, beta, inverse="lu")


# --------------------------------------------------------------------------- the triangular inverse

def wy_matrix(W, M=6, h=16, seed=0, aligned=0.0):
  """A [M, W, W] of the WY shape: strict_tril(beta_i (k_i . k_j) exp(gamma_i - gamma_j)), k L2-normalized,
  beta in (0, 1). aligned > 0 draws every k near one direction (large |A|_inf: the adversarial case)."""
  r = np.random.default_rng(seed)
  k = r.standard_normal((M, W, h))
  if aligned:
    k = r.standard_normal((M, 1, h)) + k / aligned
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  beta = r.uniform(0.05, 0.95, (M, W)) if not aligned else r.uniform(0.45, 0.85, (M, W))
  g = -r.uniform(0.01, 0.3, (M, W)) if not aligned else -r.uniform(0.0, 0.01, (M, W))
  gamma = np.cumsum(g, axis=1)
  a = beta[:, :, None] * np.einsum("mih,mjh->mij", k, k) * np.exp(gamma[:, :, None] - gamma[:, None, :])
  return np.tril(a, -1).astype(np.float32)


def inverse64(a):
  eye = np.eye(a.shape[-1])
  return np.linalg.inv(eye + a.astype(np.float64))


@functools.cache
def inverse_fn(variant):
  if variant == "drop_one_column":
    return jax.jit(lambda a: gdn._inverse_right_looking(a, skip_column=a.shape[-1] // 2))
  return jax.jit(lambda a: gdn.unit_lower_inverse(a, variant))


@pytest.mark.parametrize("W", [8, 16, 32, 64])
def test_inverse_matches_float64(W):
  a = wy_matrix(W, seed=W)
  want = inverse64(a)
  errs = {v: float(np.max(np.abs(np.asarray(inverse_fn(v)(jnp.asarray(a)), np.float64) - want)))
          for v in gdn.INVERSES}
  assert max(errs.values()) < INVERSE_ATOL, errs
  # The negative control: dropping one column's update must fail the same check.
  dropped = float(np.max(np.abs(np.asarray(inverse_fn("drop_one_column")(jnp.asarray(a)), np.float64) - want)))
  assert dropped > 100 * INVERSE_ATOL, dropped


def test_right_looking_is_a_rolled_loop_with_the_unrolled_chains_numbers():
  """The default inverse runs its W - 1 column updates as a loop of INVERSE_UNROLL columns per trip: bit for bit
  the unrolled chain (the same multiply and subtract per element), in a program a fraction of its size (unrolled,
  it was 64% of the qwen3.5-397b period's HLO)."""
  def unrolled(a):  # the reference: the chain as written out
    x = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    for j in range(a.shape[-1] - 1):
      x = x - a[..., :, j:j + 1] * x[..., j:j + 1, :]
    return x
  a = jnp.asarray(wy_matrix(64, M=3, seed=7))
  ours, ref = jax.jit(gdn._inverse_right_looking).lower(a).compile(), jax.jit(unrolled).lower(a).compile()
  assert np.array_equal(np.asarray(ours(a)), np.asarray(ref(a)))
  subtracts = lambda c: len(re.findall(r" subtract\(", c.as_text()))  # noqa: E731
  assert "while(" in ours.as_text() and subtracts(ours) <= 2 * gdn.INVERSE_UNROLL + 1 < 63 <= subtracts(ref)


def adversarial_errors():
  a = wy_matrix(64, M=4, seed=11, aligned=8.0)
  norm = float(np.max(np.sum(np.abs(a), axis=-1)))
  want = inverse64(a)
  errs = {}
  for v in gdn.INVERSES:
    x = np.asarray(inverse_fn(v)(jnp.asarray(a)), np.float64)
    errs[v] = float(np.max(np.abs(x - want)) / np.max(np.abs(want))) if np.all(np.isfinite(x)) else np.inf
  return norm, errs


def test_adversarial_inverse_stays_finite_and_close():
  norm, errs = adversarial_errors()
  assert 30 < norm < 50, norm  # |A|_inf around 40, as reported on trained qwen layers
  assert np.isfinite(errs[gdn.DEFAULT_INVERSE]) and errs[gdn.DEFAULT_INVERSE] < ADVERSARIAL_RTOL, errs
  # The record (docs/performance-log.md): right_looking, solve_triangular and blocked pass (measured 3e-8,
  # 3e-8, 1.2e-7); doubling, through powers of A, is off by about 1e5 of max |X|.
  assert {v for v, e in errs.items() if not e < ADVERSARIAL_RTOL} == {"doubling"}, errs


def test_inverse_backward_matches_autodiff_of_solve_triangular():
  # unit_lower_inverse's one custom backward, against JAX's own derivative of the triangular solve.
  a = jnp.asarray(wy_matrix(16, M=3, seed=5))
  c = jnp.asarray(np.random.default_rng(2).standard_normal(a.shape), jnp.float32)
  ours = jax.jit(jax.grad(lambda a: jnp.sum(c * gdn.unit_lower_inverse(a, "right_looking"))))(a)
  theirs = jax.jit(jax.grad(lambda a: jnp.sum(c * gdn._inverse_solve_triangular(a))))(a)
  theirs = jnp.tril(theirs, -1)  # A's upper part and diagonal are not free
  assert rel_err(ours, theirs) < RULE_RTOL


# ------------------------------------------------------------------------------ no layout copies

def _computations(hlo: str) -> dict[str, str]:
  return {m.group(1): m.group(2) for m in re.finditer(r"\n(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)}


def _loop_copies(hlo: str) -> dict[str, Counter]:
  """Per while body: the copy and transpose ops in it and in the fusions it calls. Keyed "forward" or
  "backward" by the body's op names (JAX names the backward's ops transpose(jvp(...)))."""
  comps = _computations(hlo)
  out = {}
  for body in re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo):
    kind = "backward" if "transpose(jvp(" in comps[body] else "forward"
    count, seen, stack = Counter(), set(), [body]
    while stack:
      name = stack.pop()
      if name in seen or name not in comps:
        continue
      seen.add(name)
      for line in comps[name].split("\n"):
        op = re.search(r"= [^ ]+ ([\w\-]+)\(", line)
        if op and op.group(1) in ("copy", "transpose"):
          count[op.group(1)] += 1
        stack += re.findall(r"calls=%?([\w.\-]+)", line)
    out[kind] = count
  return out


def test_no_layout_copies_of_the_chunk_states():
  # Forward + backward at a small shape (U = 8 chunks of 32, N = 4, H = J = 16). What the compiled HLO
  # holds (XLA:CPU, jax 0.12): the forward loop copies only its carry (the state and the counter, as
  # every while loop does) and transposes nothing; the backward loop's 3 transposes are of [B, N, W, J]
  # cotangents of delta (XLA's dot emits [J, W]), fused into the adds that sum them; the stacked chunk
  # states [U, B, N, J, H] and their cotangent are never copied or transposed.
  T, W = 256, 32
  (q, k, v, g, beta, s0), (co, cs) = rule_inputs(T, b=1, k_heads=2, n=4, h=16, j=16)

  def loss(q, k, v, g, beta, s0):
    o, S = gdn.gated_delta_rule_chunked(q, k, v, g, beta, segment_ids_BT=jnp.ones((1, T), jnp.int32),
                                        initial_state_BNHJ=s0, chunk_size=W)
    return jnp.sum(co[:1] * o) + jnp.sum(cs[:1] * S)
  hlo = jax.jit(jax.grad(loss, argnums=range(6))).lower(q, k, v, g, beta, s0).compile().as_text()
  loops = _loop_copies(hlo)
  assert set(loops) == {"forward", "backward"}, loops
  assert loops["forward"] == Counter(copy=2), loops
  assert loops["backward"]["transpose"] <= 3, loops
  states = r"f32\[8,1,4,16,16\]\{[^}]*\}"
  moved = re.findall(rf"%[\w.\-]*(?:copy|transpose)[\w.\-]* = {states}|= {states} (?:copy|transpose)\(", hlo)
  assert not moved, moved


# ------------------------------------------------------------------------------ context parallelism

# Context-parallel against unsharded, max abs difference in o, the final state and every gradient (the
# issue's 1e-5). Measured at most 4.8e-7.
CP_ATOL = 1e-5


def cp_ids(T):
  """Row 0: one document over every shard. Row 1: resets inside shards, documents across shard edges, a
  padding tail."""
  ids = np.ones((B, T), np.int32)
  ids[1, 20:], ids[1, 50:90], ids[1, 90:] = 2, 3, 0
  return jnp.asarray(ids)


def _explicit_vjp(rule, ids, chunk):
  """jit: (args, cots) -> (o, final state, grads); the cotangents resharded to the outputs' types, as a
  loss's backward would hand them over under explicit sharding."""
  def f(args, cots):
    (o, S), vjp = jax.vjp(lambda *a: rule(*a[:5], segment_ids_BT=ids, initial_state_BNHJ=a[5], chunk_size=chunk),
                          *args)
    if is_explicit():
      cots = tuple(jax.sharding.reshard(c, jax.typeof(x).sharding.spec) for c, x in zip(cots, (o, S)))
    return o, S, vjp(cots)
  return jax.jit(f)


# (mesh.context, T, chunk): at context=2 the other 2 devices go to fsdp (context=2 x fsdp=2) and the
# rows are sharded over it (explicit sharding); that case's shards (48 positions) are not whole chunks of 32.
# Whole chunks on context=2 x fsdp=2 (T = 128, chunks of 16) is tests/test_gdn_context.py's
# test_sharded_sequence_equals_unsharded[context2_fsdp2_explicit]: this rule inside the model, packed documents
# across the shard edge, the loss and every gradient against unsharded within the same 1e-5.
@pytest.mark.parametrize("context,T,chunk", [(4, 128, 16), (2, 96, 32)])
def test_context_parallel_equals_unsharded(context, T, chunk):
  args, cots = rule_inputs(T, seed=4)
  ids = cp_ids(T)
  want = _explicit_vjp(gdn.gated_delta_rule_chunked, ids, chunk)(args, cots)
  mesh = make_mesh(load_config("cpu_devices=4", f"mesh.context={context}", "shard_mode=explicit"))
  with jax.set_mesh(mesh):
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp" if context == 2 else None))
    args, cots = jax.device_put((args, cots), rows)
    got = _explicit_vjp(gdn.gated_delta_rule_context_parallel, jax.device_put(ids, rows), chunk)(args, cots)
    assert got[0].sharding.spec[:2] == (("fsdp" if context == 2 else None), "context")  # o: rows and T sharded
  names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dinitial state"]
  errs = {n: max_abs(a, b) for n, a, b in zip(names, [got[0], got[1], *got[2]], [want[0], want[1], *want[2]])}
  assert max(errs.values()) < CP_ATOL, errs


def test_chunked_with_rows_sharded_over_fsdp():
  # The chunked rule inside a model: rows sharded (explicit), T = 70 not a whole number of chunks (the
  # padded tail touches only T).
  T, chunk = 70, 16
  args, cots = rule_inputs(T, seed=6)
  ids = several_docs(T)
  want = _explicit_vjp(gdn.gated_delta_rule_chunked, ids, chunk)(args, cots)
  mesh = make_mesh(load_config("cpu_devices=2", "mesh.fsdp=2", "shard_mode=explicit"))
  with jax.set_mesh(mesh):
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    args, cots = jax.device_put((args, cots), rows)
    got = _explicit_vjp(gdn.gated_delta_rule_chunked, jax.device_put(ids, rows), chunk)(args, cots)
    assert got[0].sharding.spec[0] == "fsdp"
  assert max(max_abs(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))) < CP_ATOL
