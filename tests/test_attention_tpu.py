"""Every published preset's attention compiled for TPU with the default keys, from the registry (issue 61 item 4),
and a kernel's scoped-VMEM refusal as a one-line verdict (item 5).

What is compiled: the splash kernel with the operands the model passes it, forward and backward, for v5e:1x1 (and
v5p:1x1x1 at the tightest shape) on this CPU through libtpu: the attending half of one layer as the model runs it (tests/conformance.py
part_step: the pre-norm, the projections, the q/k norms and RoPE, the kernel, the output projection, the residual;
segment ids, the batch rows per device the block rule reads, the backward `auto` picks, remat=full, bfloat16).
Not the kernel alone: the kernel's scoped VMEM depends on the program around it. Measured for v5e (JAX 0.12.0.1,
libtpu 0.0.50.1; gemma3-4b's attention, seq 2048, 4 rows, every block 1024, fused backward), the dkv kernel needs:
alone 14.45 MiB, inside the part alone 14.44, inside the attention half of its layer 16.62 (over the 16 MiB
limit), inside its whole layer 17.69, inside a one-layer model 16.44 (the chip's own error, issue 61); the half at
embed_dim 256 fits. So the check compiles the half at the preset's own widths.

Shapes, deduplicated: one per splash shape the block rule tells apart (the mixer, its q/k and v head dims, soft-capped
or not; nn/splash_rule.Rule reads nothing else of a model), taken from the published preset with the widest
embed_dim (the half's VMEM grew with it), its first attending layer (the windowed one where it has both), at the
(seq, rows) of 8,192 tokens per device (2048 x 4, 4096 x 2, 8192 x 1: issue 61's chip rows) where the rule's own
estimate is closest to the chip's scoped VMEM. Control: the rule before 26c9503 (every block 1024, fused up to two
blocks) on gemma3-4b's shape is refused, with the verdict naming the dkv kernel.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json

import jax
import pytest

from meshlm.config import load_config, preset_names
from meshlm.models.model import resolve
from meshlm.nn import splash_rule as SR

import conformance as C

tpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                         reason="libtpu is not installed (pip install 'meshlm[tpu]'; make test installs it)")
TOPOLOGIES = ("v5e:1x1", "v5p:1x1x1")
SHAPES = ((2048, 4), (4096, 2), (8192, 1))  # (seq, rows per device): 8,192 tokens per device
TRAIN = ("train.compute_dtype=bfloat16", "remat=full", "attention_impl=auto")
# The rule before 26c9503: every block 1024, fused where the padded sequence is at most two blocks.
OLD_RULE = tuple(f"{k}=1024" for k in SR.KEYS)


@functools.cache
def _shape(preset: str):
  """(kind, context, the mixer's name, its attention Shape) of the preset's first attending layer, the windowed one
  where it has both."""
  cfg = load_config(f"model={preset}")
  M = resolve(cfg)
  layers = C.attending(cfg)
  kind, context = next((kc for kc in layers if kc[1] == "local"), layers[0])
  mixer = M.family.kinds[kind].mixer
  return kind, context, mixer.name, mixer.instrument.attention_shape(M.m)


def tightness(preset: str, T: int, rows: int) -> float:
  """The rule's own estimate of its blocks' largest phase at (T, rows) over the scoped VMEM (v5e's)."""
  s = _shape(preset)[3]
  rule = SR.Rule(T, rows=rows)
  b = rule.blocks(s.qk_dim, s.v_dim, s.softcap is not None)
  phases = [("fwd", (b.q, b.kv, b.kv_compute), False), ("dkv", (b.q_dkv, b.kv_dkv, b.kv_dkv_compute), b.fused)]
  phases += [] if b.fused else [("dq", (b.q_dq, b.kv_dq, b.kv_dq), False)]
  return max(SR.estimate(phase, *bs, s.qk_dim, s.v_dim, 2, True, s.softcap is not None, fused, rows)
             for phase, bs, fused in phases) / rule.vmem


@functools.cache
def shapes() -> dict[tuple, tuple[str, int, int]]:
  """{(mixer, qk, v, soft-capped): (preset, seq, rows)}: the rule's distinct splash shapes over the published
  presets, each from the preset with the widest embed_dim (then the first by name), at its tightest (seq, rows)."""
  out: dict = {}
  for preset in sorted(p for p in preset_names() if not p.endswith("-tiny")):
    _, _, mixer, s = _shape(preset)
    key = (mixer, s.qk_dim, s.v_dim, s.softcap is not None)
    D = load_config(f"model={preset}").model.embed_dim
    if key not in out or D > load_config(f"model={out[key]}").model.embed_dim:
      out[key] = preset
  return {k: (p, *max(SHAPES, key=lambda ts: tightness(p, *ts))) for k, p in out.items()}


def compile_half(preset: str, T: int, rows: int, topology: str, *keys: str) -> dict | None:
  """Compiles the attending half of one layer of `preset` (conformance.part_step) for `topology`: None when it
  compiles, else the compiler's scoped-VMEM figures (analysis/aot.vmem_figures; another error propagates)."""
  from meshlm.analysis.aot import vmem_figures
  from meshlm.parallel import topology as TP
  from meshlm.parallel.mesh import make_mesh
  cfg = load_config(f"model={preset}", f"train.seq_len={T}", f"train.per_device_batch_size={rows}", *TRAIN, *keys)
  mesh = make_mesh(cfg, TP.devices(TP.parse(topology)))
  kind, context, _, _ = _shape(preset)
  fn, specs = C.part_step(cfg, kind, context)
  args = C.part_arguments(cfg, specs, mesh, T, rows)
  with jax.set_mesh(mesh):
    try:
      jax.jit(fn).lower(*args).compile()
    except Exception as e:
      found = vmem_figures(str(e))
      if found is None:
        raise
      return found
  return None


def rows() -> list[tuple[tuple, str]]:
  """(shape key, topology): every shape for v5e, and the one where the rule is tightest (then the first) for v5p
  too (the same 16 MiB of scoped VMEM, another chip's Mosaic): the compiles are the module's time."""
  got = shapes()
  tightest = max(sorted(got), key=lambda k: tightness(*got[k]))
  return [(k, TOPOLOGIES[0]) for k in sorted(got)] + [(tightest, TOPOLOGIES[1])]


ROWS = [pytest.param(key, topology, id=f"{key[0]}-{key[1]}-{key[2]}{'-softcap' if key[3] else ''}-{topology}")
        for key, topology in rows()]


@tpu
@pytest.mark.ci_must_run
@pytest.mark.parametrize("key, topology", ROWS)
def test_every_published_attention_compiles_for_tpu_with_the_default_keys(key, topology):
  from meshlm.analysis.aot import vmem_line
  preset, T, rows = shapes()[key]
  refused = compile_half(preset, T, rows, topology)
  assert refused is None, f"{preset} (seq {T}, {rows} rows) for {topology}: {vmem_line(refused)}"


def test_the_shapes_come_from_the_registry():
  """Every published preset's attending mixer is in a row (gqa with and without the soft-cap, gated_gqa, MLA's
  192/128), each row at one of the chip rows' shapes; gemma3-4b stands for head_dim 256 without a soft-cap."""
  got = shapes()
  mixers = {_shape(p)[2] for p in preset_names() if not p.endswith("-tiny")}
  assert {k[0] for k in got} == mixers and {"gqa", "gated_gqa", "mla"} <= mixers
  assert ("mla", 192, 128, False) in got and ("gqa", 256, 256, True) in got
  assert got[("gqa", 256, 256, False)][0] == "gemma3-4b"
  assert all((T, rows) in SHAPES for _, T, rows in got.values())
  assert [t for _, t in rows()] == ["v5e:1x1"] * len(got) + ["v5p:1x1x1"]


@tpu
@pytest.mark.ci_must_run
def test_the_rule_before_26c9503_is_refused_by_name():
  """The control: gemma3-4b at the chip's refused shape (seq 2048, 4 rows) with every block 1024 and the fused
  backward (the old rule at two blocks) is refused for v5e, the verdict naming the splash dkv kernel and a smaller
  dkv block; the preset with the default keys compiles at the rule's tightest shape (the test above)."""
  from meshlm.analysis.aot import vmem_line
  preset, T, rows = shapes()[("gqa", 256, 256, False)][0], 2048, 4  # the chip's refusal (issue 61): seq 2048, 4 rows
  assert preset == "gemma3-4b"
  refused = compile_half(preset, T, rows, "v5e:1x1", *OLD_RULE,
                         f"splash_backward={'fused' if SR.padded_length(T) <= 2048 else 'split'}")
  assert refused is not None and refused["required_bytes"] > refused["limit_bytes"] == 16 << 20, refused
  assert vmem_line(refused).startswith("splash dkv kernel needs "), vmem_line(refused)
  assert refused["advice"]["key"] == "sa_block_kv_dkv_compute=512", refused


# --- a kernel's scoped-VMEM refusal is a verdict (item 5) ---------------------------------------------------------

# The chip's own refusal (issue 61: gemma3-4b's widths, seq 2048, 4 rows, meshlm 8d4fb04), as XLA:TPU words it.
REFUSAL = (
    "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\n"
    "Ran out of memory in memory space vmem while allocating on stack for %splash_mha_dkv_segmented_no_residuals.1 = "
    "(bf16[4,2,8,2048,256]{4,3,2,1,0:T(8,128)(2,1)}) custom-call(%copy-done.165), custom_call_target=\"tpu_custom_call\", "
    "frontend_attributes={kernel_metadata={\n\"xprof_metadata\":\"{\\\"block_q_dkv\\\": 1024, \\\"block_kv_dkv\\\": "
    "1024, \\\"block_kv_dkv_compute\\\": 1024, \\\"q_layout\\\": 1}\"\n}}. Scoped allocation with size 16.44M and "
    "limit 16.00M exceeded scoped vmem limit by 448.0K.")


def test_the_refusal_reads_as_the_kernel_the_phase_and_the_key():
  from meshlm.analysis.aot import oom_figures, vmem_figures, vmem_line
  v = vmem_figures(REFUSAL)
  assert v["kernel"] == "splash_mha_dkv_segmented_no_residuals" and v["limit_bytes"] == 16 << 20
  assert vmem_line(v) == ("splash dkv kernel needs 16.44 MiB of scoped VMEM, the chip has 16.00: set "
                          "sa_block_kv_dkv_compute=512")
  assert oom_figures(REFUSAL) is None and vmem_figures("RESOURCE_EXHAUSTED: exceeds available HBM") is None
  # Its compute block at the lanes already: the query block is next; another kernel: its name and no key.
  assert SR.vmem_advice("splash_mha_fwd_residuals", {"block_q": 512, "block_kv_compute": 128})["key"] == "sa_block_q=256"
  assert SR.vmem_advice("splash_mha_dq", {"block_q_dq": 256, "block_kv_dq": 256})["key"] == "sa_block_kv_dq=128"
  other = vmem_figures(REFUSAL.replace("splash_mha_dkv_segmented_no_residuals", "ragged_dot"))
  assert vmem_line(other).startswith("kernel ragged_dot needs 16.44 MiB of scoped VMEM")


def test_train_exits_on_the_refusal_in_one_line(monkeypatch, tmp_path, capsys):
  """meshlm train whose step the compiler refuses for VMEM (on a TPU): the one line, exit 2 (as a layout refused
  for HBM), no traceback."""
  from meshlm import cli
  from meshlm.train import loop

  def refused(*a, **kw):
    raise RuntimeError(REFUSAL)
  monkeypatch.setattr(loop, "train", refused)
  code = cli.main(["train", "model=llama2-tiny", "cpu_devices=1", f"run_dir={tmp_path / 'run'}", "train.steps=1"])
  err = capsys.readouterr().err
  assert code == 2 and "Traceback" not in err, err
  assert err.strip().splitlines()[-1] == ("meshlm: error: splash dkv kernel needs 16.44 MiB of scoped VMEM, the chip "
                                          "has 16.00: set sa_block_kv_dkv_compute=512"), err


def test_fit_layout_stops_at_the_first_refusal():
  """--fit=layout: a layout refused for a kernel's VMEM ends the search (no layout changes a kernel's block), the
  verdict in its record and its lines."""
  from meshlm.analysis.aot import Chip, vmem_figures
  from meshlm.commands import compile as CC
  calls = []

  def step_report(program, cfg, with_census):
    calls.append(cfg.mesh.sizes())
    return {"compile_s": 1.0, "memory": {"fits": False, "peak_bytes": None, "vmem": vmem_figures(REFUSAL)}}
  chip = Chip("TPU v5", "tpu", 4, 1, 95 << 30, "compiler", None, None)
  record, overrides, best = CC._fit_layout(["model=mixtral-tiny"], "train", 4, chip, {}, step_report)
  assert len(calls) == 1 and record["candidates"] > 1 and (overrides, best) == (None, None)
  assert record["vmem"]["advice"]["key"] == "sa_block_kv_dkv_compute=512"
  lines = CC.render_layout(record)
  assert lines[-1] == ("  fit=layout: stopped: splash dkv kernel needs 16.44 MiB of scoped VMEM, the chip has 16.00: "
                       "set sa_block_kv_dkv_compute=512"), lines


@tpu
@pytest.mark.ci_must_run
def test_compile_names_the_kernel_and_the_key_of_a_forced_overflow():
  """`meshlm compile` of a small model for v5e with a dkv block set too large (2048 at head_dim 256): the program
  does not fit, one line of its report names the splash dkv kernel and the key, exit 1, as for an HBM overflow."""
  from meshlm.cli import main
  from meshlm.commands.compile import render
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = main(["compile", "model=llama2-tiny", "model.num_layers=1", "model.head_dim=256", "model.num_heads=2",
                 "model.num_kv_heads=1", "train.seq_len=2048", "train.per_device_batch_size=1",
                 "train.compute_dtype=bfloat16", "topology=v5e:1x1", "sa_block_q_dkv=2048", "sa_block_kv_dkv=2048",
                 "sa_block_kv_dkv_compute=2048", "--no-census", "--json"])
  report = json.loads(out.getvalue())
  assert code == 1 and report["programs"]["train"]["memory"]["fits"] is False, report
  lines = [ln for ln in render(report).splitlines() if "scoped VMEM" in ln]
  assert len(lines) == 1 and lines[0].startswith("  splash dkv kernel needs ") and lines[0].endswith(
      "MiB of scoped VMEM, the chip has 16.00: set sa_block_kv_dkv_compute=1024"), lines
