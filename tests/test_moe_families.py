"""The MoE families (mixtral, qwen3_moe): config checks, layer plans, HF import/export of per-expert
tensors, the router losses in the train step, and short training runs.

HF parity of the MoE fixtures (logits and every layer's hidden state against transformers) runs in
tests/test_hf.py with the other fixtures; measured (JAX 0.10.2, XLA:CPU, float32), the largest rel
error is 7.0e-7 (qwen3-moe-sparse2), against test_hf's TOL of 3e-6. Here: controls that a wrong
routing setting fails that parity, and the router statistics against transformers' own.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from meshlm import forward, hf, init_params
from meshlm.config import load_config
from meshlm.errors import ConfigError
from meshlm.hf import io as hf_io
from meshlm.models import decoder
from meshlm.models.params import init_params
from meshlm.models.model import Model
from meshlm.models.ffns.moe import knobs
from meshlm.models.plans import periodic_plan
from meshlm.models.qwen3_moe import layer_kinds
from meshlm.nn.moe import load_balancing_loss

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MOE_FIXTURES = ("mixtral", "qwen3-moe", "qwen3-moe-nonorm", "qwen3-moe-sparse2")
TOL = 3e-6  # test_hf.py's parity tolerance
F32 = ("train.compute_dtype=float32", "cpu_devices=1")


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_forward(cfg, params, ids, **kw):
  with jax.set_mesh(jax.tree.leaves(params)[0].sharding.mesh):
    return jax.jit(lambda p, x: forward(cfg, p, x, **kw))(params, ids)


# --- bad input: one line, exit 2, nothing written ---------------------------------------------------

def cli_error(argv: list[str], capsys) -> str:
  from meshlm.cli import main
  assert main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "Traceback" not in err[0], err
  return err[0]


def test_top_k_larger_than_the_experts_is_refused(tmp_path, capsys):
  err = cli_error(["train", "model=mixtral-tiny", "model.parts.moe.num_experts_per_tok=5",
                   f"run_dir={tmp_path / 'run'}"], capsys)
  assert "model.parts.moe.num_experts_per_tok: 5 is larger than num_experts=4" in err, err
  assert not (tmp_path / "run").exists()


def test_mesh_expert_must_divide_the_experts(tmp_path, capsys):
  err = cli_error(["train", "model=mixtral-tiny", "cpu_devices=3", "mesh.fsdp=1", "mesh.expert=3",
                   f"run_dir={tmp_path / 'run'}"], capsys)
  assert err == ("meshlm: error: mesh.expert=3 does not divide model.parts.moe.num_experts=4; pick a mesh.expert "
                 "that divides 4")
  assert not (tmp_path / "run").exists()
  # A mesh built elsewhere and handed to the step is checked too.
  from meshlm.parallel.mesh import make_mesh
  from meshlm.train.step import build_train_step
  # (an MoE config with 6 experts builds it; mesh.expert=2 on a dense model is refused at load)
  mesh = make_mesh(load_config("model=mixtral-tiny", "model.parts.moe.num_experts=6", "cpu_devices=3", "mesh.fsdp=1",
                               "mesh.expert=3"))
  with pytest.raises(ConfigError, match=r"^mesh.expert=3 does not divide model.parts.moe.num_experts=4"):
    build_train_step(load_config("model=mixtral-tiny", "cpu_devices=3"), mesh)


@pytest.mark.parametrize("override, message", [
    ("model.parts.moe.num_experts=0", "model.parts.moe.num_experts: Input should be greater than 0 (got 0)"),
    ("model.parts.moe.norm_topk_prob=false", "model.parts.moe.norm_topk_prob=false: mixtral always renormalizes"),
    ("model.norm_topk_prob=false", "model.parts.moe.norm_topk_prob=false: mixtral always renormalizes"),  # old key
])
def test_mixtral_refuses_what_it_cannot_be(override, message, tmp_path, capsys):
  err = cli_error(["train", "model=mixtral-tiny", override, f"run_dir={tmp_path / 'run'}"], capsys)
  assert err.startswith(f"meshlm: error: {message}"), err
  assert not (tmp_path / "run").exists()


def test_qwen3_moe_checks_its_plans_keys():
  """mlp_only_layers is the family's layer plan, not a knob of the moe part: qwen3_moe checks it, naming the key
  (control: the last layer). The moe section's own checks are tests/test_part_config.py's."""
  import meshlm
  with pytest.raises(ConfigError, match=r"^model.mlp_only_layers: layer 4 is not in \[0, model.num_layers=4\)"):
    meshlm.load_config("model=qwen3-moe-tiny", "model.mlp_only_layers=[4]")
  meshlm.load_config("model=qwen3-moe-tiny", "model.mlp_only_layers=[3]")


# --- layer plans ---------------------------------------------------------------------------------

def kinds_of(num_layers: int, step: int, only: list[int], experts: int = 8) -> str:
  cfg = load_config("model=qwen3-moe-tiny", f"model.num_layers={num_layers}", f"model.decoder_sparse_step={step}",
                    f"model.mlp_only_layers={only}", f"model.parts.moe.num_experts={experts}")
  return "".join(k[0] for k in layer_kinds(cfg.model))


def test_qwen3_moe_layer_kinds_follow_transformers():
  # transformers' Qwen3MoeDecoderLayer: MoE iff i not in mlp_only_layers and (i + 1) % step == 0.
  assert kinds_of(4, 1, []) == "mmmm"
  assert kinds_of(5, 2, []) == "dmdmd"
  assert kinds_of(6, 3, [5]) == "ddmddd"
  assert kinds_of(4, 1, [0, 2]) == "dmdm"
  assert kinds_of(3, 1, [0, 1, 2]) == "ddd"


@pytest.mark.parametrize("kinds, prefix, period", [
    ("mmmm", 0, 1),  # qwen3-moe-30b-a3b: one scan of period 1
    ("dmmm", 1, 1),  # qwen3-moe-tiny: the dense layer unrolled, then a scan
    ("dmdmd", 0, 2),  # two kinds in one period, plus a remainder layer
    ("ddmddd", 3, 1),  # cheapest: 3 unrolled, then a period of 1
])
def test_periodic_plan(kinds, prefix, period):
  lp = periodic_plan(tuple({"d": "dense", "m": "moe"}[k] for k in kinds), ("global",) * len(kinds))
  assert (lp.prefix, lp.period) == (prefix, period)
  body = lp.kinds[lp.prefix:lp.prefix + lp.groups * lp.period]
  assert body == lp.kinds[lp.prefix:lp.prefix + lp.period] * lp.groups  # the scan repeats one period


# Shapes that compile in seconds, for either family's tiny preset.
SMALL = ("model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=24",
         "model.parts.moe.mlp_dim=8", "model.vocab_size=64", "model.parts.moe.num_experts=4")
TINY_QWEN = ("model=qwen3-moe-tiny", *SMALL)


def test_irregular_layout_scans_like_it_unrolls():
  """A layout with no short period (dense, moe, dense, moe, moe, moe): the scanned plan computes what the
  plain unrolled loop does, layer by layer."""
  base = (*TINY_QWEN, *F32, "model.num_layers=6", "model.mlp_only_layers=[0,2]")
  scanned, unrolled = load_config(*base), load_config(*base, "scan_layers=false")
  lp = decoder.plan(scanned)
  assert "".join(k[0] for k in lp.kinds) == "dmdmmm" and (lp.prefix, lp.period) == (3, 1)
  params = init_params(scanned, jax.random.key(1))
  ids = np.random.default_rng(0).integers(0, 64, (2, 11))
  a, ha = jax.jit(lambda p, x: forward(scanned, p, x, return_hidden=True))(params, ids)
  b, hb = jax.jit(lambda p, x: forward(unrolled, p, x, return_hidden=True))(params, ids)
  assert rel(a, b) <= 1e-6 and max(rel(ha[i], hb[i]) for i in range(6)) <= 1e-6


NEW_TOKENS = 5
PROMPTS = ([1, 2, 3, 4], [5, 6])


def generation_rows(out) -> tuple[list[list[int]], list[list[float]]]:
  """(tokens, log-probs) per row of a generate() result, as lists cut at each row's length."""
  return out.token_lists(), out.logprob_lists()


@functools.cache  # once per preset for the module: the negative control reuses the good run
def cached_generation(preset: str, *extra: str):
  """(cfg, params, per-row tokens, per-row log-probs) of greedy meshlm.generate (prefill + cached
  decode); mixtral-tiny's window (shrunk to 4) slides within the 9 positions."""
  import meshlm
  cfg = load_config(f"model={preset}", *F32, *SMALL, *(("model.sliding_window=4",) if preset == "mixtral-tiny" else ()),
                    *extra)
  params = init_params(cfg, jax.random.key(2))
  tokens, logprobs = generation_rows(meshlm.generate(cfg, params, list(PROMPTS), max_new_tokens=NEW_TOKENS,
                                                     temperature=0))
  return cfg, params, tokens, logprobs


def teacher_forced_logprobs(cfg, params, news) -> list[np.ndarray]:
  """Per row, log p(new[j] | prompt + new[:j]) from one forward over prompt + new (right-padded): causal
  attention and per-token routing make position i's logits those of the prefix up to i."""
  seqs = [list(p) + list(n) for p, n in zip(PROMPTS, news)]
  block = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for i, seq in enumerate(seqs):
    block[i, :len(seq)] = seq
  logp = np.asarray(jax.nn.log_softmax(jax.jit(lambda p, t: forward(cfg, p, t))(params, block), axis=-1))
  return [np.array([logp[i, len(p) - 1 + j, t] for j, t in enumerate(n)])
          for i, (p, n) in enumerate(zip(PROMPTS, news))]


# Cached sampling against recomputing, for every MoE family: tests/test_conformance.py. Its negative control here:
def test_a_decode_routing_bug_is_caught(monkeypatch):
  """Negative control: the decode step's MoE layers weigh their experts wrongly (norm_topk flipped for
  one-token inputs; prefill is untouched). The greedy tokens stay the same here, so a tokens-only
  check passes; the log-probs after the first token no longer match the teacher-forced forward."""
  import meshlm
  from meshlm.models import api
  from meshlm.nn import moe
  # One MoE layer: the wrong weighing shows in one, and every layer more is compiled into prefill, decode and the
  # teacher-forced forward, for the good run and the bug each.
  cfg, params, tokens, _ = cached_generation("qwen3-moe-tiny", "model.num_layers=1", "model.mlp_only_layers=[]")
  real = moe.moe_mlp

  def decode_routes_wrongly(p, x_BTD, ctx, knobs, opts, **kw):
    if x_BTD.shape[1] == 1:
      knobs = knobs.model_copy(update=dict(norm_topk_prob=not knobs.norm_topk_prob))
    return real(p, x_BTD, ctx, knobs, opts, **kw)
  monkeypatch.setattr(moe, "moe_mlp", decode_routes_wrongly)
  api.clear_programs()
  try:
    bad_tokens, bad = generation_rows(meshlm.generate(cfg, params, list(PROMPTS), max_new_tokens=NEW_TOKENS,
                                                      temperature=0))
  finally:
    api.clear_programs()
  monkeypatch.undo()
  assert bad_tokens == tokens
  want = teacher_forced_logprobs(cfg, params, bad_tokens)
  np.testing.assert_allclose([row[0] for row in bad], [row[0] for row in want], atol=1e-5, rtol=0)  # prefill's
  assert max(np.abs(np.array(b[1:]) - w[1:]).max() for b, w in zip(bad, want)) > 1e-3


# --- HF import / export -----------------------------------------------------------------------------

def test_moe_fixtures_cover_the_routing_variants():
  """test_hf.py runs parity, exact export and config checks on every fixture dir; these are the MoE ones."""
  cfgs = {n: json.loads((FIXTURES / n / "config.json").read_text()) for n in MOE_FIXTURES}
  assert cfgs["mixtral"]["model_type"] == "mixtral" and cfgs["mixtral"]["sliding_window"] == 8
  qwen = {n: c for n, c in cfgs.items() if c["model_type"] == "qwen3_moe"}
  assert {c["norm_topk_prob"] for c in qwen.values()} == {True, False}
  assert any(c["decoder_sparse_step"] == 2 for c in qwen.values())
  assert any(c["mlp_only_layers"] for c in qwen.values())
  # Odd sizes: 5 experts of width 22 on a width of 45.
  assert all(c["hidden_size"] == 45 and c["num_local_experts"] == 5 for c in cfgs.values())


@pytest.mark.parametrize("name, wrong", [
    ("qwen3-moe", "model.parts.moe.norm_topk_prob=false"),
    ("qwen3-moe-nonorm", "model.parts.moe.norm_topk_prob=true"),
    ("qwen3-moe", "model.parts.moe.num_experts_per_tok=3"),
    ("mixtral", "model.parts.moe.num_experts_per_tok=1"),
])
def test_wrong_routing_fails_parity(name, wrong):
  """Negative controls: the parity check tells each routing setting from the right one."""
  ref = np.load(FIXTURES / name / "reference.npz")
  cfg, params = hf.load(FIXTURES / name, *F32, wrong)
  logits, hidden = run_forward(cfg, params, ref["input_ids"], return_hidden=True)
  err = max([rel(logits, ref["logits"])] + [rel(hidden[i], ref["hidden"][i]) for i in range(hidden.shape[0])])
  assert err > 10 * TOL, f"{name} with {wrong}: rel error {err:.2e} would pass"


def logsumexp(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_router_statistics_match_transformers(name):
  """The load-balancing loss equals transformers' aux_loss (load_balancing_loss_func over all MoE layers),
  and each layer's z-loss the mean squared logsumexp of transformers' router logits."""
  ref = np.load(FIXTURES / name / "reference.npz")
  cfg, params = hf.load(FIXTURES / name, *F32)
  _, side = run_forward(cfg, params, ref["input_ids"], return_side=True)
  lb, want = float(load_balancing_loss(side)), float(ref["aux_loss"])
  assert abs(lb - want) <= 1e-5 * want, (lb, want)
  # Control: the mean of the per-layer losses (fractions and probabilities not averaged over the layers
  # first) is a different number, which this check tells apart.
  per_layer = float(jnp.mean(side["moe_load_balance_loss"]))
  assert abs(per_layer - want) > 1e-4 * want, (per_layer, want)
  z = np.mean(logsumexp(ref["router_logits"]) ** 2, axis=-1)  # [M]
  np.testing.assert_allclose(np.asarray(side["moe_z_loss"]), z, rtol=1e-5)
  assert side["moe_z_loss"].shape == (ref["router_logits"].shape[0],)  # one per MoE layer, model order


def copy_fixture(name: str, tmp_path: Path) -> Path:
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  return dst


def test_missing_expert_tensor_is_named(tmp_path, capsys):
  src = copy_fixture("mixtral", tmp_path)
  tensors = load_file(src / "model.safetensors")
  tensors.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
  save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
  message = "missing tensor model.layers.1.block_sparse_moe.experts.3.w3.weight (expected shape [22, 45])"
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                     .replace(")", r"\)")):
    hf.load(src, "cpu_devices=1")
  err = cli_error(["convert", "hf-to-meshlm", str(src), str(tmp_path / "out"), "cpu_devices=1"], capsys)
  assert err == f"meshlm: error: {message}"
  assert not (tmp_path / "out").exists()


def reads(monkeypatch, *overrides: str) -> tuple[dict, dict]:
  """(params, {HF tensor name: times read}) of a qwen3-moe load."""
  counts: dict[str, int] = {}
  real = hf_io._Reader.read

  def counting(self, name, index=None):
    counts[name] = counts.get(name, 0) + 1
    return real(self, name, index)

  monkeypatch.setattr(hf_io._Reader, "read", counting)
  _, params = hf.load(FIXTURES / "qwen3-moe", *overrides)
  monkeypatch.undo()
  return params, counts


def test_each_device_reads_only_its_experts(monkeypatch):
  """mesh.expert=5, and fsdp=5 with the experts on fsdp (model.parts.moe.kernel_fsdp=experts): each device
  holds one expert of each kernel and reads only that expert's tensors (once each over the whole load);
  with the experts whole on every device (fsdp=5 shards embed: kernel_fsdp=embed), every device
  reads every expert's tensor."""
  for mesh, axis in ((("mesh.fsdp=1", "mesh.expert=5"), "expert"),
                     (("mesh.fsdp=5", "model.parts.moe.kernel_fsdp=experts"), "fsdp")):
    params, counts = reads(monkeypatch, "cpu_devices=5", *mesh)
    gate = params["layers"]["moe"]["moe"]["gate"]
    assert gate.shape == (2, 5, 45, 22) and gate.sharding.spec[1] == axis
    experts = {n: c for n, c in counts.items() if ".experts." in n}
    assert len(experts) == 2 * 5 * 3 and set(experts.values()) == {1}
  _, counts = reads(monkeypatch, "cpu_devices=5", "mesh.fsdp=5", "model.parts.moe.kernel_fsdp=embed")
  assert {c for n, c in counts.items() if ".experts." in n} == {5}


def test_layer_axis_1_holds_the_same_experts(tmp_path):
  """param_scan_axis=1 puts the layer axis after the experts ([E, L, D, F]); import and export follow."""
  _, p0 = hf.load(FIXTURES / "mixtral", "cpu_devices=1")
  cfg1, p1 = hf.load(FIXTURES / "mixtral", "cpu_devices=1", "param_scan_axis=1")
  for k in ("gate", "up", "down", "router"):
    a, b = np.asarray(p0["layers"]["moe"]["moe"][k]), np.asarray(p1["layers"]["moe"]["moe"][k])
    assert np.array_equal(np.moveaxis(b, 1, 0), a), k
  w = load_file(FIXTURES / "mixtral" / "model.safetensors")
  # HF w2 [D, F] of layer 1, expert 4 -> meshlm down [F, D]
  assert np.array_equal(np.asarray(p1["layers"]["moe"]["moe"]["down"])[4, 1],
                        w["model.layers.1.block_sparse_moe.experts.4.w2.weight"].T)
  out = load_file(hf.save(cfg1, p1, tmp_path / "export") / "model.safetensors")
  assert sorted(out) == sorted(w) and all(np.array_equal(out[k], w[k]) for k in w)


# --- the router losses in the train step ------------------------------------------------------------

def tiny_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((rows, seq), np.int32),
          "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
          "loss_mask": (rng.random((rows, seq)) < 0.8).astype(np.float32)}


def test_router_losses_enter_the_loss():
  from meshlm.nn.head_loss import materialized_logprobs
  from meshlm.train.step import next_token_loss
  base = (*TINY_QWEN, *F32)
  plain = load_config(*base)
  coefs = load_config(*base, "model.parts.moe.router_aux_loss_coef=0.3", "model.parts.moe.router_z_loss_coef=0.02")
  params = init_params(plain, jax.random.key(0))
  batch = {k: jnp.asarray(v) for k, v in tiny_batch(64, 2, 9).items()}
  n = jnp.sum(batch["loss_mask"])

  def with_router(router):
    moe = dict(params["layers"]["moe"], moe=dict(params["layers"]["moe"]["moe"], router=router))
    return dict(params, layers=dict(params["layers"], moe=moe))

  def loss_and_router_grad(cfg):
    # The gradient of the router alone: the other kernels' weight gradients are not compiled.
    fn = jax.jit(jax.value_and_grad(lambda r: next_token_loss(cfg, with_router(r), batch, n), has_aux=True))
    (loss, metrics), grad = fn(params["layers"]["moe"]["moe"]["router"])
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)

  loss0, m0, g0 = loss_and_router_grad(plain)
  loss1, m1, g1 = loss_and_router_grad(coefs)
  assert m0 == {} and set(m1) == {"moe_aux_loss", "moe_z_loss"}
  logits, side = jax.jit(lambda p: forward(plain, p, batch["inputs"], batch["positions"], batch["segment_ids"],
                                           return_side=True))(params)
  ce = float(-jnp.sum(materialized_logprobs(logits, batch["targets"])[0] * batch["loss_mask"]) / n)
  lb, z = float(load_balancing_loss(side)), float(jnp.mean(side["moe_z_loss"]))
  assert side["moe_z_loss"].shape == (3,)  # the three MoE layers of qwen3-moe-tiny
  np.testing.assert_allclose([loss0, m1["moe_aux_loss"], m1["moe_z_loss"]], [ce, lb, z], rtol=1e-6)
  np.testing.assert_allclose(loss1, ce + 0.3 * lb + 0.02 * z, rtol=1e-6)
  # Their gradient reaches the router: with the losses on, the router gradient changes.
  assert not np.allclose(g0, g1, rtol=1e-3, atol=0)


def test_micro_batches_weigh_router_losses_by_their_tokens():
  """Summed over micro-batches, the logged router losses are the token-weighted mean of each
  micro-batch's own (not their sum), as the cross-entropy sums to the batch's."""
  from meshlm.train.step import grads_and_loss, next_token_loss
  over = (*TINY_QWEN, "train.compute_dtype=float32", "model.parts.moe.router_aux_loss_coef=0.1",
          "model.parts.moe.router_z_loss_coef=0.01", "train.per_device_batch_size=4")
  cfg1, cfg2 = load_config(*over), load_config(*over, "train.micro_batches=2")
  params = init_params(cfg1, jax.random.key(0))
  batch = tiny_batch(64, 4, 9, seed=3)
  # Every leaf frozen: the metrics are the micro-batches' forwards, and no backward is compiled.
  none = jax.tree.map(lambda _: False, params)
  _, _, metrics = jax.jit(lambda p, b: grads_and_loss(cfg2, p, b, trainable=none))(
      params, {k: jnp.asarray(v) for k, v in batch.items()})
  # grads_and_loss puts rows i, M + i, ... in micro-batch i.
  halves = [{k: jnp.asarray(v[i::2]) for k, v in batch.items()} for i in range(2)]
  own_loss = jax.jit(lambda p, h: next_token_loss(cfg1, p, h, jnp.sum(h["loss_mask"]))[1])
  own = [own_loss(params, h) for h in halves]
  share = [float(jnp.sum(h["loss_mask"])) / float(np.sum(batch["loss_mask"])) for h in halves]
  for key in ("moe_aux_loss", "moe_z_loss"):
    want = sum(s * float(o[key]) for s, o in zip(share, own))
    assert float(metrics[key]) == pytest.approx(want, rel=1e-5), key


# --- training ---------------------------------------------------------------------------------------

# One MoE preset through the CLI (mixtral on an expert-parallel mesh); qwen3-moe-tiny trains in test_conformance (fsdp=4)
# and test_rl (the GRPO demo's model), the hybrids' MoE in test_qwen3_next through the CLI.
@pytest.mark.parametrize("preset, mesh", [("mixtral-tiny", ("cpu_devices=2", "mesh.fsdp=1", "mesh.expert=2"))])
def test_tiny_moe_presets_train(preset, mesh, tmp_path):
  """`meshlm train model=<preset>` on the stdlib corpus: the loss falls, and the router losses are logged
  to metrics.jsonl under their names."""
  from meshlm.cli import main
  steps = 25
  run = tmp_path / "run"
  assert main(["train", f"model={preset}", *mesh, f"train.steps={steps}", "train.seq_len=32",
               "train.per_device_batch_size=4", "train.warmup_steps=5", "train.sample_tokens=0",
               "model.parts.moe.router_aux_loss_coef=0.01", "model.parts.moe.router_z_loss_coef=0.001",
               f"run_dir={run}"]) == 0
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  losses = [r["loss"] for r in records]
  assert all(np.isfinite(losses))
  # Byte-level, untrained: about ln(512) = 6.2; a few dozen steps on Python source take it well below.
  assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
  # E * sum_e f_e p_e: k when balanced; each expert takes at most every token (f_e <= 1), so at most E.
  experts = knobs(load_config(f"model={preset}").model).num_experts
  aux = [r["moe_aux_loss"] for r in records]
  assert all(0 < a <= experts for a in aux), aux
  assert all(r["moe_z_loss"] > 0 for r in records)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_the_sort_permutation(remat):
  """Under remat the backward replays the layer unless told otherwise; the decoder's policies save the
  names the moe part declares (Compute.remat_save_names: the sort permutation), so forward + backward
  sorts once, not twice."""
  from meshlm.models import decoder
  from meshlm.models.model import Model
  from moe_helpers import count_sorts
  cfg = load_config("model=qwen3-moe-tiny", "cpu_devices=1", f"remat={remat}", "train.compute_dtype=float32",
                    "train.seq_len=16")
  params = init_params(cfg, jax.random.key(0))
  toks = np.zeros((1, 16), np.int32)
  grad = lambda: jax.grad(lambda p: decoder.forward(cfg, p, toks).sum())  # a new function: no trace cache
  assert count_sorts(grad(), params) == 1  # the scanned MoE body's one sort
  nothing = property(lambda M: jax.checkpoint_policies.nothing_saveable)  # a policy that saves nothing: the control
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Model, "remat_policy", nothing)
    assert count_sorts(grad(), params) == 2
