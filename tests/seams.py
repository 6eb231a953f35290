"""Seams the tests own, for the training loop, and helpers several test files share (random_batch, packed_batch,
placed_batch, max_diffs, compiled_grads, own_shard_only): nothing here is read by the production code.

In-process tests use `Poisoned` (pass it as `train(..., data=...)`) and `train(..., on_step=...)`.
Subprocess tests run this file, the real `meshlm train` with these seams added:

  python tests/seams.py [--nan-at=I,J,...] [--sigterm-at=I] [--block-checkpoints-at=I] [--hang-save-at=N]
                        key=value ...

  --nan-at               the batches of those steps (counted from this invocation's first) get a NaN
                         loss mask, so the step's loss and gradients are NaN; the compiled step is unchanged
  --sigterm-at           once step I's metrics are read, the process sends itself SIGTERM
  --block-checkpoints-at once step I's metrics are read, checkpoint.dir is made unwritable, root
                         included: its parent folder becomes a regular file (see block)
  --hang-save-at         the write of checkpoint N stops before its final rename and never finishes;
                         "hang-save N" on stdout says it is there (the test then kills the process)
"""
from __future__ import annotations

import os
import signal
import sys

import numpy as np


class Poisoned:
  """A data iterator whose batches at the given indices (counted from the first `next`) have a NaN
  loss mask. get_state/set_state/tokenizer pass through, so the loop checkpoints it as usual."""

  def __init__(self, data, steps):
    self.data, self.steps, self.n = data, frozenset(steps), 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self.data)
    if self.n in self.steps:
      batch = dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.nan))
    self.n += 1
    return batch

  def __getattr__(self, name):
    return getattr(self.data, name)


def block(path: str) -> None:
  """Makes the directory `path` unwritable for every user, root included, on any filesystem (chmod
  does not stop root, and chattr +i needs root and a filesystem that supports it): its parent folder
  is replaced by a regular file, so creating anything at `path` fails with ENOTDIR. The parent must
  be the caller's own folder holding nothing but `path`, itself empty (nothing saved there yet)."""
  parent = os.path.dirname(os.path.abspath(path))
  held = os.listdir(parent) if os.path.isdir(parent) else []
  if held not in ([], [os.path.basename(path)]) or (os.path.isdir(path) and os.listdir(path)):
    raise RuntimeError(f"block({path}): its parent must hold only it, and it nothing; found {held}")
  if os.path.isdir(path):
    os.rmdir(path)
  if os.path.isdir(parent):
    os.rmdir(parent)
  with open(parent, "w") as f:
    f.write("blocks the folder of the same name\n")


def _hang_save_at(step: int) -> None:
  import asyncio
  from orbax.checkpoint._src.path import atomicity
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def hanging(self):
    if self._final_path.name == str(step):
      print(f"hang-save {step}", flush=True)
      await asyncio.Event().wait()  # never set: the write stays in flight until the process is killed
    return await finalize(self)
  atomicity.AtomicRenameTemporaryPath.finalize = hanging

def random_batch(step):
  """One fixed random batch of next-token data (seed 0), placed by the train step's put_batch."""
  rng = np.random.default_rng(0)
  B, T = step.global_batch, step.cfg.train.seq_len
  toks = rng.integers(0, step.cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
  return step.put_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((B, T), np.float32),
                         "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                         "segment_ids": np.ones((B, T), np.int32)})


def packed_batch(vocab: int, T: int, rows: tuple[tuple[int, ...], ...]) -> dict:
  """A next-token batch of random tokens (seed 0) that packs documents: row i holds [c0, c1) | [c1, c2) | ... for
  its cuts rows[i] (segment ids 1, 2, ...; positions from 0 in each), padding (segment 0, no loss) past the last."""
  rng = np.random.default_rng(0)
  toks = rng.integers(0, vocab, (len(rows), T + 1)).astype(np.int32)
  seg = np.zeros((len(rows), T), np.int32)
  pos = np.zeros((len(rows), T), np.int32)
  for row, cuts in enumerate(rows):
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
      seg[row, a:b], pos[row, a:b] = i + 1, np.arange(b - a)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "positions": pos,
          "loss_mask": (seg > 0).astype(np.float32)}


def placed_batch(mesh, batch: dict) -> dict:
  """A numpy batch on `mesh`, each field sharded as the train step's BATCH_SPEC lays it out."""
  import jax
  from jax.sharding import NamedSharding
  from meshlm.parallel.sharding import logical_spec
  from meshlm.train.step import BATCH_SPEC
  return {k: jax.device_put(v, NamedSharding(mesh, logical_spec(BATCH_SPEC[k].axes(), v.shape, mesh)))
          for k, v in batch.items()}


def max_diffs(got: tuple, want: tuple) -> dict[str, float]:
  """Max |diff| of the loss and of each gradient leaf (by its path) between two (loss, grads) pairs."""
  import jax
  (lg, gg), (lw, gw) = got, want
  flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), gg, gw))[0]
  return {"loss": abs(lg - lw), **{jax.tree_util.keystr(k): v for k, v in flat}}


def own_shard_only(attention, shards: int):
  """An attention core (nn/attention.gqa_attention's signature) whose queries see only the keys of their own
  sequence shard: what a context-parallel attention that never gathers K/V computes (a negative control)."""
  import jax.numpy as jnp

  def attend(q, k, v, mask, **kw):
    t = jnp.arange(q.shape[2]) // (q.shape[2] // shards)  # q [B, N, T, H]
    return attention(q, k, v, mask & (t[:, None] == t[None, :]), **kw)
  return attend


def compiled_grads(cfg):
  """(loss, grads, the compiled program) of the train step's loss and gradients for cfg, on random_batch,
  from a fresh init (seed 0), compiled once."""
  import jax
  from meshlm.train import step as ST
  jax.clear_caches()
  step = ST.build_train_step(cfg)
  state = step.init_state(jax.random.key(0))
  batch = random_batch(step)
  with jax.set_mesh(step.mesh):
    fn = jax.jit(lambda p, b: ST.grads_and_loss(step.cfg, p, b, step.loss_fn, step.batch_spec, step.trainable)[:2])
    compiled = fn.lower(state.params, batch).compile()
    loss, grads = compiled(state.params, batch)
  return loss, grads, compiled


def main(argv: list[str]) -> int:
  seams = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
  args = [a for a in argv if not a.startswith("--")]
  import meshlm.train.data as data_mod
  import meshlm.train.loop as loop
  from meshlm.train.checkpoint import checkpoint_dir
  if "nan-at" in seams:
    nan_at, make_dataset = [int(s) for s in seams["nan-at"].split(",")], data_mod.make_dataset
    data_mod.make_dataset = lambda *a, **k: Poisoned(make_dataset(*a, **k), nan_at)
  if "hang-save-at" in seams:
    _hang_save_at(int(seams["hang-save-at"]))
  real_train = loop.train

  def train(cfg, **kw):
    def on_step(i: int) -> None:
      if str(i) == seams.get("sigterm-at"):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the loop looks at the flag
      if str(i) == seams.get("block-checkpoints-at"):
        block(checkpoint_dir(cfg))
    return real_train(cfg, on_step=on_step, **kw)
  loop.train = train  # cli.cmd_train imports it when it runs
  from meshlm.cli import main as cli_main
  return cli_main(["train", *args])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
