"""The optimizer and the loop's records: the non-finite guard, clipping, weight decay, checkpoint.keep,
the on_step seam and the TensorBoard output.

The optimizer is checked against a numpy AdamW written from the paper's update rule; each check is
also run against a deliberately wrong variant, which must fail it. One short in-process run of the
real loop (one compile) serves the loop-level checks.
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.config import load_config
from meshlm.train.optimizer import make_optimizer, schedule
from meshlm.train.step import guarded_update

ROOT = Path(__file__).resolve().parents[1]

# --- the non-finite guard ------------------------------------------------------------------------

def _tree(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
          "scale": jnp.asarray(1 + 0.1 * rng.standard_normal(3), jnp.float32)}


def _check_guard(update) -> None:
  """A bad loss or a bad gradient anywhere leaves params and optimizer state exactly as they were and
  says nonfinite; a good step moves them."""
  opt = make_optimizer(load_config("train.warmup_steps=0").train)
  params = _tree()
  opt_state = opt.init(params)
  grads = _tree(1)
  nan_in_grads = dict(grads, kernel=grads["kernel"].at[2, 1].set(jnp.nan))
  inf_in_grads = dict(grads, scale=grads["scale"].at[0].set(-jnp.inf))
  cases = {"nan only in the grads": (jnp.float32(2.5), nan_in_grads),
           "inf in the grads": (jnp.float32(2.5), inf_in_grads),
           "inf loss": (jnp.float32(jnp.inf), grads),
           "nan loss": (jnp.float32(jnp.nan), grads)}
  step = jax.jit(lambda p, s, l, g: update(opt, p, s, l, g))
  for name, (loss, g) in cases.items():
    new_params, new_state, metrics = step(params, opt_state, loss, g)
    assert bool(metrics["nonfinite"]), name
    for a, b in zip(jax.tree.leaves((new_params, new_state)), jax.tree.leaves((params, opt_state))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  new_params, new_state, metrics = step(params, opt_state, jnp.float32(2.5), grads)
  assert not bool(metrics["nonfinite"])
  assert float(metrics["grad_norm"]) == pytest.approx(float(np.sqrt(sum(np.sum(np.square(g)) for g in grads.values()))))
  assert not np.array_equal(np.asarray(new_params["kernel"]), np.asarray(params["kernel"]))


def test_guard_skips_nan_or_inf_in_the_loss_or_only_in_the_gradients():
  _check_guard(guarded_update)


def test_guard_negative_control_a_loss_only_guard_fails():
  """A guard that looks at the loss alone lets a NaN gradient through with a finite loss: the check
  above must catch it."""
  import optax

  def loss_only(opt, params, opt_state, loss, grads):
    updates, new_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(loss)
    keep = lambda new, old: jnp.where(finite, new, old)
    return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state),
            {"loss": loss, "grad_norm": optax.tree.norm(grads), "nonfinite": ~finite})
  with pytest.raises(AssertionError, match="nan only in the grads"):
    _check_guard(loss_only)


# --- AdamW: clipping and decoupled weight decay ---------------------------------------------------

OPT = ("train.steps=10", "train.warmup_steps=2", "train.learning_rate=1e-2", "train.min_lr_ratio=0.1",
       "train.weight_decay=0.3", "train.grad_clip=0.5", "train.b1=0.8", "train.b2=0.9")


def _reference_adamw(t, params: dict, grads_seq: list[dict], clip=True, decoupled=True) -> list[dict]:
  """Numpy AdamW (Loshchilov & Hutter): clip the global norm, Adam moments with bias correction, then
  p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p). `clip`/`decoupled` off give the wrong variants."""
  lr = schedule(t)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  out = []
  for i, g in enumerate(grads_seq):
    g = {k: np.asarray(x, np.float64) for k, x in g.items()}
    if not decoupled:  # L2 in the gradient: the decay goes through the Adam moments
      g = {k: g[k] + t.weight_decay * p[k] for k in g}
    norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
    if clip and norm > t.grad_clip:
      g = {k: x * (t.grad_clip / norm) for k, x in g.items()}
    for k in p:
      m[k] = t.b1 * m[k] + (1 - t.b1) * g[k]
      v[k] = t.b2 * v[k] + (1 - t.b2) * g[k] ** 2
      mhat, vhat = m[k] / (1 - t.b1 ** (i + 1)), v[k] / (1 - t.b2 ** (i + 1))
      u = mhat / (np.sqrt(vhat) + 1e-8) + (t.weight_decay * p[k] if decoupled else 0)
      p[k] = p[k] - float(lr(i)) * u
    out.append(dict(p))
  return out


def _grads_seq() -> list[dict]:
  """Four steps' gradients with global norms of about 40, 0.1, 8 and 0.3 against grad_clip=0.5: some
  clipped, some not, so Adam's moments see the clipped scale."""
  rng = np.random.default_rng(3)
  out = []
  for scale in (10.0, 0.025, 2.0, 0.075):
    out.append({"kernel": scale * rng.standard_normal((4, 3)), "scale": scale * rng.standard_normal(3)})
  return out


def _meshlm_adamw(t, params: dict, grads_seq: list[dict]) -> list[dict]:
  opt = make_optimizer(t)
  p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  state = opt.init(p)
  out = []
  # Jitted, as the train step runs it (op by op, its ops compiled some 30 programs).
  update = jax.jit(lambda p, s, g: guarded_update(opt, p, s, jnp.float32(1.0), g))
  for g in grads_seq:
    p, state, metrics = update(p, state, {k: jnp.asarray(x, jnp.float32) for k, x in g.items()})
    assert not bool(metrics["nonfinite"])
    out.append({k: np.asarray(x, np.float64) for k, x in p.items()})
  return out


def _max_rel_diff(a: list[dict], b: list[dict]) -> float:
  return max(float(np.max(np.abs(x[k] - y[k]) / (np.abs(y[k]) + 1e-3))) for x, y in zip(a, b) for k in x)


# float32 against float64; a missing clip or a coupled decay moves parameters by 1e-3 or more.
ADAMW_RTOL = 1e-5


def test_clipped_adamw_with_decoupled_decay_matches_the_reference():
  t = load_config(*OPT).train
  params = _tree(5)
  got = _meshlm_adamw(t, params, _grads_seq())
  ref = _reference_adamw(t, params, _grads_seq())
  worst = _max_rel_diff(got, ref)
  wrong = {"no clipping": _max_rel_diff(got, _reference_adamw(t, params, _grads_seq(), clip=False)),
           "L2 decay through Adam": _max_rel_diff(got, _reference_adamw(t, params, _grads_seq(), decoupled=False))}
  print(f"AdamW vs numpy reference: max rel diff {worst:.3g}; wrong variants: "
        + ", ".join(f"{k} {v:.3g}" for k, v in wrong.items()))
  assert worst < ADAMW_RTOL
  for name, diff in wrong.items():  # negative controls: the test tells each wrong optimizer apart
    assert diff > 100 * ADAMW_RTOL, (name, diff)


def test_gradient_clipping_scales_the_gradient_to_the_global_norm():
  """Adam's first moment after one step is (1 - b1) * g, with g the clipped gradient: g * clip / |g|
  above the limit, g itself below it."""
  t = load_config(*OPT).train
  opt = make_optimizer(t)
  params = {k: jnp.asarray(v, jnp.float32) for k, v in _tree(5).items()}
  for g in _grads_seq()[:2]:
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in g.values()))
    factor = min(1.0, t.grad_clip / norm)
    _, state = jax.jit(lambda g: opt.update(g, opt.init(params), params))(
        {k: jnp.asarray(x, jnp.float32) for k, x in g.items()})
    adam = state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...) -> ScaleByAdamState
    for k in g:
      np.testing.assert_allclose(np.asarray(adam.mu[k]), (1 - t.b1) * g[k] * factor, rtol=1e-5, err_msg=k)


def test_weight_decay_reaches_every_parameter_decoupled_from_the_gradient():
  """With zero gradients Adam's step is 0, so each parameter moves by exactly -lr * wd * p: the decay
  reaches every leaf of llama2-tiny (matrices, embeddings and norm scales alike) and does not pass
  through the Adam moments (which stay zero)."""
  from meshlm.train.step import build_train_step
  cfg = load_config("model=llama2-tiny", *OPT, "train.warmup_steps=0", "cpu_devices=1")
  state = build_train_step(cfg).init_state(jax.random.key(0))  # the real parameter tree
  opt = make_optimizer(cfg.train)
  before = jax.tree.map(np.asarray, state.params)
  zeros = jax.tree.map(jnp.zeros_like, state.params)
  new_params, new_state, _ = jax.jit(lambda p, s, g: guarded_update(opt, p, s, jnp.float32(1.0), g))(
      state.params, state.opt_state, zeros)
  lr = float(schedule(cfg.train)(0))
  assert lr == pytest.approx(1e-2)
  leaves = jax.tree_util.tree_leaves_with_path(before)
  assert len(leaves) > 5
  for (path, p0), p1 in zip(leaves, jax.tree.leaves(new_params)):
    expected = np.asarray(p0, np.float64) * (1 - lr * cfg.train.weight_decay)
    np.testing.assert_allclose(np.asarray(p1), expected, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert not np.array_equal(np.asarray(p1), np.asarray(p0)), jax.tree_util.keystr(path)
  for moment in jax.tree.leaves(new_state):
    if moment.ndim:
      assert not np.any(np.asarray(moment)), "the decay must not enter Adam's moments"


# --- the loop: on_step, checkpoint.keep, TensorBoard ---------------------------------------------

# One layer of llama2-tiny's two: the loop's records, checkpoints and resume see the model's state whole.
LOOP = ("model=llama2-tiny", "model.num_layers=1", "cpu_devices=2", "mesh.fsdp=2", "train.compute_dtype=float32",
        "train.seq_len=16", "train.per_device_batch_size=1", "train.steps=5", "train.warmup_steps=0",
        "train.sample_tokens=0", "data.source=synthetic", "train.log_every=1")


class _Drawn:
  """What the end-of-run sample sees of a Generation."""
  def token_lists(self):
    return [[ord("x")] * 3]


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
  """5 steps, a checkpoint after every step with checkpoint.keep=2, on_step recording its calls; the
  end-of-run sample's generate replaced by a recorder (SAMPLES)."""
  import meshlm.models.generate as gen
  from meshlm.train.loop import train
  run_dir = tmp_path_factory.mktemp("loop")
  cfg = load_config(*LOOP, "checkpoint.every=1", "checkpoint.keep=2", "train.sample_tokens=4",
                    "train.sample_temperature=0.6", f"run_dir={run_dir}")
  calls = []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(gen, "generate", lambda cfg, params, prompts, **kw: SAMPLES.append(kw) or _Drawn())
    result = train(cfg, show_progress=False, on_step=calls.append)
  return result, run_dir, calls


SAMPLES: list = []


def test_the_end_sample_is_drawn_at_its_temperature_with_the_run_seed(loop_run):
  """train.sample_temperature and train.seed reach generate (a tiny model's greedy sample ends in repeats)."""
  result, _, _ = loop_run
  assert [(c["temperature"], c["seed"], c["max_new_tokens"]) for c in SAMPLES] == [(0.6, 0, 4)]
  assert result.sample == "The xxx"  # the prompt for a corpus other than the stdlib, then the drawn tokens


def test_on_step_is_called_once_per_step_in_order(loop_run):
  result, _, calls = loop_run
  assert calls == list(range(5)) and len(result.losses) == 5


def test_checkpoint_keep_prunes_to_the_newest(loop_run):
  _, run_dir, _ = loop_run
  on_disk = sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())
  assert on_disk == [4, 5]  # saved after every one of 5 steps, the last 2 kept


def _tfrecords(path: str):
  """The records of a TensorBoard event file: [len u64][crc u32][data][crc u32], repeated."""
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (n,) = struct.unpack_from("<Q", data, pos)
    yield data[pos + 12:pos + 12 + n]
    pos += 12 + n + 4


def read_scalars(run_dir) -> dict[str, dict[int, float]]:
  from tensorboardX.proto.event_pb2 import Event
  out: dict[str, dict[int, float]] = {}
  files = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
  assert files, f"no event file under {run_dir}/tensorboard"
  for path in files:
    for rec in _tfrecords(path):
      ev = Event.FromString(rec)
      for v in ev.summary.value:
        out.setdefault(v.tag, {})[ev.step] = v.simple_value
  return out


def test_tensorboard_holds_the_metrics_of_every_step(loop_run):
  _, run_dir, _ = loop_run
  with open(run_dir / "metrics.jsonl") as f:
    records = [json.loads(ln) for ln in f if ln.strip()]
  scalars = read_scalars(run_dir)
  assert {"loss", "grad_norm", "step_time_s", "tokens_per_s"} <= set(scalars)
  for key in ("loss", "grad_norm", "tokens_per_s"):
    assert sorted(scalars[key]) == [r["step"] for r in records] == list(range(1, 6)), key
    for r in records:  # TensorBoard keeps float32
      assert scalars[key][r["step"]] == np.float32(r[key]), (key, r["step"])
  # Negative control: the reader tells different values apart.
  assert scalars["loss"][1] != scalars["loss"][5]


# --- the loop core, shared by trainers (meshlm.train.loop.Loop) ----------------------------------

class _FakeCkpt:
  dir = "ckpt"

  def __init__(self, every):
    self.every, self.saved = every, []

  def should_save(self, step, last):
    return step % self.every == 0 or step == last

  def save(self, step, state, rng, data_state, counters):
    self.saved.append((step, state, data_state))


def _core_run(queue_ahead: bool, steps: int = 5, every: int = 3):
  """Runs Loop.run with a Python step (no compile): returns (events, records, checkpoints saved)."""
  from meshlm.train.loop import Loop
  from rich.console import Console
  events, records = [], []

  class Writer:
    def write(self, r):
      events.append(("R", r["step"] - 1))  # the step's index (records count the updates done, from 1)
      records.append(r)

    def close(self):
      pass

  def step_fn(state, batch):
    events.append(("D", batch))
    return state + 1, {"loss": 1.0 / (state + 1), "grad_norm": 0.5, "nonfinite": False, "aux": 2.0 * state}

  def fetch(i):
    events.append(("F", i))
    return i

  cfg = load_config("model=llama2-tiny", f"train.steps={steps}", "train.log_every=1")
  ckpt = _FakeCkpt(every)
  loop = Loop(cfg, step_fn, ckpt, Console(file=io.StringIO()), lambda *a, **k: None, Writer(), 1,
              show_progress=False, queue_ahead=queue_ahead)
  out = loop.run(0, 0, None, {"nonfinite_in_a_row": 0, "nonfinite_total": 0}, fetch=fetch, position=lambda: {})
  assert out.stop_reason == "done" and out.state == steps
  return events, records, ckpt.saved


def test_loop_core_logs_the_loss_metrics_under_their_names():
  _, records, saved = _core_run(True)
  assert [r["aux"] for r in records] == [0.0, 2.0, 4.0, 6.0, 8.0]
  assert [s[0] for s in saved] == [3, 5]


def test_loop_core_without_queue_ahead_fetches_each_batch_after_the_last_step_is_read():
  """An on-policy trainer's batch depends on the newest parameters: batch i is fetched only once step
  i - 1 has finished (its metrics read and any checkpoint saved)."""
  events, _, saved = _core_run(False)
  D, R, F = (lambda n: ("D", n)), (lambda n: ("R", n)), (lambda n: ("F", n))
  assert events == [F(0), D(0), R(0), F(1), D(1), R(1), F(2), D(2), R(2), F(3), D(3), R(3), F(4), D(4), R(4)]
  queued, _, _ = _core_run(True)
  assert queued.index(F(1)) < queued.index(R(0))  # the default queues ahead: a control that it differs
  assert [s[0] for s in saved] == [3, 5]


# --- resuming: other settings are refused, naming the keys; the documented ones may change ---------

def test_resume_with_other_settings_is_refused_naming_the_keys(loop_run, tmp_path):
  """Before, a changed learning rate on a finished run said "nothing to do", and on an unfinished one
  it trained on with the new value and no word."""
  import shutil

  from meshlm.errors import ConfigError
  from meshlm.train.loop import train
  _, src, _ = loop_run
  run_dir = tmp_path / "run"
  shutil.copytree(src, run_dir)
  record = (run_dir / "config.yaml").read_bytes()
  cfg = load_config(*LOOP, "checkpoint.every=1", "checkpoint.keep=2", f"run_dir={run_dir}",
                    "train.learning_rate=1e-4", "train.seed=7", "train.steps=6")
  with pytest.raises(ConfigError) as e:
    train(cfg, show_progress=False)
  assert str(e.value) == (
      f"run_dir={run_dir}: resuming its checkpoint at step 5 with settings other than its config.yaml "
      "(train.learning_rate is 0.0001 here but 0.003 there; train.seed is 7 here but 0 there); put them back, "
      f"or use a new run_dir (checkpoint.load_params_from={run_dir} starts one from its parameters). Only the keys "
      "README.md's 'Stopping and resuming' lists may change on resume")
  assert (run_dir / "config.yaml").read_bytes() == record
  assert sorted(n for n in os.listdir(run_dir / "checkpoints") if n.isdigit()) == ["4", "5"]


def test_resume_may_change_the_steps_and_the_cadence(loop_run, tmp_path):
  """Negative control of the refusal: more steps, another log and checkpoint cadence resume."""
  import shutil

  from meshlm.train.loop import train
  _, src, _ = loop_run
  run_dir = tmp_path / "run"
  shutil.copytree(src, run_dir)
  cfg = load_config(*LOOP, "checkpoint.every=3", "checkpoint.keep=3", "train.log_every=2", "train.steps=6",
                    f"run_dir={run_dir}")
  result = train(cfg, show_progress=False)
  assert result.start_step == 5 and len(result.losses) == 1 and result.stop_reason == "done"
  assert "steps: 6" in (run_dir / "config.yaml").read_text()


def test_resumable_keys_are_config_keys():
  """A renamed key would quietly turn its entry off: each entry must name a key (or a section)."""
  from meshlm.config import to_yaml
  from meshlm.config.resume import RESUMABLE
  from meshlm.train.run_dir import _flat
  import yaml
  keys = _flat(yaml.safe_load(to_yaml(load_config(*LOOP))))
  for entry in RESUMABLE:
    assert (entry in keys if not entry.endswith(".*") else any(k.startswith(entry[:-1]) for k in keys)), entry


def _resume_rows(readme: str) -> list[set[str]]:
  """The key sets of the README's "Stopping and resuming" table, one per row, each `section.*` expanded."""
  from meshlm.config.keys import leaf_keys
  from meshlm.config.resume import matches
  section = readme.split("## Stopping and resuming", 1)[1].split("\n## ", 1)[0]
  rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
  every = [k.name for k in leaf_keys()]
  return [{k for tok in re.findall(r"`([^`]+)`", row) for k in ([tok] if not tok.endswith(".*") else
                                                                 [n for n in every if matches(n, (tok,))])}
          for row in rows]


def _declared_rows() -> list[set[str]]:
  """config/resume.py's rows (expanded as the README's), then the registered parts' COMPUTE knobs."""
  from meshlm.config.keys import leaf_keys
  from meshlm.config.resume import RESUMABLE_ROWS, matches
  from meshlm.models.registry import part_sections
  every = [k.name for k in leaf_keys()]
  rows = [{n for n in every if matches(n, keys)} for keys, _ in RESUMABLE_ROWS]
  return rows + [{f"model.parts.{name}.{knob}" for name, sec in part_sections().items() for knob in getattr(sec, "COMPUTE", ())}]


def test_the_readme_resume_table_and_help_are_the_declaration():
  """The README's table lists config/resume.py's rows in order and, last, every part section's COMPUTE knobs
  (all 7 of moe's); `meshlm train --help` and `meshlm rl --help` mark exactly those keys; docs/config.md states no key's resumability
  (it points to the table). Control: the README as it was, with 3 of moe's 7 knobs in prose, fails."""
  from meshlm.cli import command_help
  readme = (ROOT / "README.md").read_text()
  want = _declared_rows()
  assert _resume_rows(readme) == want
  assert any("ep_buffer_factor" in k for k in want[-1]) and len([k for k in want[-1] if ".moe." in k]) == 8
  old = readme.replace(", `model.parts.moe.ep_impl`, `model.parts.moe.ep_buffer_factor`"
                       ", `model.parts.moe.grad_reduce_barrier`", "")
  assert old != readme and _resume_rows(old) != want
  marked = {line.split()[0] for cmd in ("train", "rl") for line in command_help(cmd).splitlines()
            if line.endswith("(may change on resume)")}
  assert marked == set().union(*want)
  config_md = (ROOT / "docs" / "config.md").read_text()
  assert len(re.findall(r"(?i)on resume|resumes under|\bresumes\b", config_md)) == 2  # the pointer; run_dir's row

