"""The dense kernels' cast to the compute dtype stays in the layer loop (issue 55 item 4): every part casts its float32
kernels through `Context.cast` (nn/kernel_cast.in_layer: `cast_bits`, integer rounding, bit-identical to astype)
in training and prefill, so XLA:TPU's bfloat16 propagation holds no whole-stack bf16 copy of them beside the float32
parameters; decode keeps astype (its token loop converts the weights once and reads bf16 per token). The values
and gradient are astype's (cast_bits' own bit patterns: tests/test_moe_kernel_cast.py); here the train step's losses
bit for bit, and a TPU compile of the scanned train step with and without it."""
from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm.models.decoder import context

import conformance as C


def test_the_cast_is_per_layer_in_training_and_prefill_and_astype_in_decode():
  cfg = meshlm.load_config("model=llama2-tiny", "train.compute_dtype=bfloat16", "cpu_devices=1")
  w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)), jnp.float32)
  pos = jnp.zeros((1, 4), jnp.int32)
  jaxprs = {}
  for mode in ("train", "prefill", "decode"):
    kw = {} if mode == "train" else {"cache_len": 8, "lengths_B": jnp.array([4])}
    ctx = context(cfg, pos if mode != "decode" else pos[:, :1], mode=mode, **kw)
    out = ctx.cast(w, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32))
    jaxprs[mode] = str(jax.make_jaxpr(lambda w: ctx.cast(w, jnp.bfloat16))(w))
  for mode in ("train", "prefill"):
    assert "bitcast_convert_type" in jaxprs[mode], jaxprs[mode]
  assert "bitcast_convert_type" not in jaxprs["decode"] and "convert_element_type" in jaxprs["decode"]
  # float32 compute: nothing to round, astype.
  assert ctx.cast(w, jnp.float32) is w or np.array_equal(np.asarray(ctx.cast(w, jnp.float32)), np.asarray(w))


def _bf16_losses(preset: str, *keys: str) -> tuple[np.ndarray, str]:
  """(the losses of conformance's parity steps with bf16 compute, the step's StableHLO)."""
  from meshlm.analysis.golden import shrink
  from meshlm.train.step import build_train_step
  base = tuple(o for o in C.PARITY_BASE if not o.startswith("train.compute_dtype="))
  cfg = meshlm.load_config(f"model={preset}", *shrink(preset), *base, "train.compute_dtype=bfloat16", *keys)
  step = build_train_step(cfg)
  lowered = step.lower()
  return C.run_steps(step, lowered, C.PARITY_STEPS)["loss"], lowered.as_text()


@pytest.mark.parametrize("preset", ["llama2-tiny", "qwen3.5-tiny", "deepseek-v3-tiny"])
def test_bf16_train_steps_are_the_astype_steps_bit_for_bit(preset):
  """Train steps with bf16 compute on fsdp=4 (explicit): gqa and the glu (llama2), gated_gqa and gdn (qwen3.5),
  mla (deepseek-v3), against every part casting with astype (layer_cast=astype, the reference)."""
  got, text = _bf16_losses(preset)
  want, ref_text = _bf16_losses(preset, "layer_cast=astype")
  # The two programs differ where it matters: integer rounding in one, converts only in the other.
  assert "bitcast_convert" in text and "bitcast_convert" not in ref_text
  assert np.all(np.isfinite(want)) and len(set(want.tolist())) == len(want)  # each step's batch and update
  np.testing.assert_array_equal(got, want)


# gate/up, down, k/v, o; not q: its stack is gathered once before the scan in the compute dtype, by design
# (models/mixers/gqa.prepare, nn/gather_once.py).
KERNEL_STACK = re.compile(r"bf16\[4,(?:512,1024|1024,512|512,2,128|4,128,512)\]")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")
def test_tpu_train_step_holds_no_bf16_copy_of_the_dense_stacks():
  """4 scanned llama layers (embed 512, mlp 1024, 4 heads and 2 KV heads of 128), bf16 compute, compiled for v5p:
  no bf16 value of a whole kernel stack [4, ...]; with astype (the control) XLA:TPU hoists them, glu and attention."""
  from meshlm.commands.compile import _train
  from meshlm.parallel import topology as TP
  from meshlm.parallel.mesh import make_mesh
  keys = ("model=llama2-tiny", "model.num_layers=4", "model.embed_dim=512", "model.mlp_dim=1024",
          "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=128", "train.compute_dtype=bfloat16",
          "train.seq_len=64", "train.per_device_batch_size=1", "remat=full", "attention_impl=xla", "scan_layers=true")
  devices = TP.devices(TP.parse("v5p:1x1x1"))

  def stacks(*extra: str) -> set[str]:
    cfg = meshlm.load_config(*keys, *extra)
    lowered, _, _ = _train(cfg, make_mesh(cfg, devices))
    return set(KERNEL_STACK.findall(lowered.compile().as_text()))
  assert stacks() == set()
  assert stacks("layer_cast=astype") == {"bf16[4,512,1024]", "bf16[4,1024,512]", "bf16[4,512,2,128]", "bf16[4,4,128,512]"}
