"""The layout estimate (analysis/layout.py), `meshlm compile --fit=layout` and `meshlm train`'s refusal of a layout
that cannot fit.

Two compiles on fake CPU devices (the search's, a tiny MoE); the rest reads abstract shapes only, at real scale
where docs/compile.md has the compiled figures to hold the estimate to.
"""
from __future__ import annotations

import importlib.util

import pytest

from meshlm.analysis import layout as LO
from meshlm.cli import main
from meshlm.commands.resolve import load_config
from meshlm.commands.train import layout_refusal
from meshlm.errors import ConfigError
from test_compile import compile_json  # tests/ is on the path (no __init__.py)

GiB = 1 << 30
MOE = "model.parts.moe."
TINY = ["model=qwen3-moe-tiny", "train.per_device_batch_size=2"]
Q397 = ["model=qwen3.5-397b-a17b", "train.seq_len=16384", "train.per_device_batch_size=1", "remat=full"]
COMPACT = [f"{MOE}kernel_fsdp=embed", f"{MOE}ep_impl=compact", f"{MOE}ep_buffer_factor=2.75"]


def est(*overrides: str, devices: int = 256):
  return LO.estimate(load_config(*overrides), devices, "tpu")


@pytest.fixture(scope="module")
def fit_report():
  # Room for anything this tiny model does: the search's first layout fits, and it stops there.
  return compile_json(*TINY, "topology=cpu:4", "hbm_gib=4", "--fit=layout", "--no-census")


def test_fit_layout_stops_at_the_first_layout_that_fits(fit_report):
  fit = fit_report["fit"]
  assert fit["search"] == "layout" and len(fit["tried"]) == 1 and fit["tried"][0]["fits"] is True
  assert fit["best"] == fit["ranked"][0]["overrides"] == fit["tried"][0]["overrides"]  # the first ranked, compiled
  assert fit_report["exit"] == 0 and fit_report["programs"]["train"]["memory"]["fits"] is True
  # The ranking is by the estimate (every layout fits 4 GiB by it here), and the estimate tells the layouts apart.
  peaks = [c["estimate"]["peak"] for c in fit["ranked"]]
  assert peaks == sorted(peaks) and len(fit["ranked"]) == min(8, fit["candidates"]) and fit["candidates"] >= 4
  assert all(c["estimate"]["peak"] <= 4 * GiB for c in fit["ranked"])


def test_the_printed_command_round_trips_through_the_config_loader(fit_report):
  fit = fit_report["fit"]
  words = fit["command"].split()
  assert words[:2] == ["meshlm", "train"]
  cfg = load_config(*words[2:])
  c = fit_report["config"]
  assert cfg.mesh.sizes() == c["mesh"]
  # the compiled program is the printed command's: its MoE knobs as the report's tries set them
  for o in fit["best"]:
    key, _, value = o.partition("=")
    if key.startswith(MOE):
      got = _knob(cfg, key.removeprefix(MOE))
      assert str(got).lower() == value.lower() or (got is None and value == "null")


def _knob(cfg, name):
  from meshlm.models.ffns import moe
  return getattr(moe.knobs(cfg.model), name)


def test_estimate_arguments_are_the_compiled_arguments(fit_report):
  """The estimate's parameters and AdamW state per device are the compiled step's argument bytes by input, exactly
  (XLA:CPU pads nothing), and its floor is under the compiled peak."""
  overrides = [*TINY, *fit_report["fit"]["best"]]
  e = LO.estimate(load_config(*overrides), 4, "cpu")
  mem = fit_report["programs"]["train"]["memory"]
  args = mem["arguments_by_input"]
  assert e.terms["params"] == args["params"] and e.terms["params"] > 0
  assert e.terms["opt_state"] + 8 == args["opt_state"]  # AdamW's two int32 counts (its own and its schedule's)
  assert e.floor <= mem["peak_bytes"]


def test_no_layout_fits_stops_after_fit_compiles():
  report = compile_json(*TINY, "topology=cpu:4", "hbm_gib=4", "temp_gib=0.0001", "fit_compiles=1", "--fit=layout",
                        "--no-census")
  fit = report["fit"]
  assert fit["best"] is None and len(fit["tried"]) == 1 and fit["tried"][0]["fits"] is False
  assert fit["tried"][0]["peak_bytes"] <= 4 * GiB  # the peak fits; the temporaries' limit is what refused it
  assert report["exit"] == 1 and report["programs"] == {}


@pytest.mark.parametrize("args, msg", [
    (["model=qwen3-moe-tiny", "topology=cpu:4", "temp_gib=1"], "only --fit=layout"),
    (["model=qwen3-moe-tiny", "topology=cpu:4", "hbm_gib=1", "--fit=layout", "--program", "train,rl"], "one step"),
    (["model=qwen3-moe-tiny", "topology=cpu:4", "hbm_gib=1", "--fit=layout", "fit_compiles=0"], "positive"),
])
def test_fit_layout_usage_errors(args, msg, capsys):
  assert main(["compile", *args]) == 2
  err = capsys.readouterr().err
  assert msg in err and len(err.strip().splitlines()) == 1


def test_the_397b_layouts_rank_as_they_compiled():
  """docs/compile.md's full-depth 397B train steps at 16,384 tokens per device (compact, factor 2.75), in the order of
  their compiled peaks: expert=16 with the reduce barrier 74.39 GiB, expert=8 with it 74.89, expert=16 without it
  76.90, expert=8 without it 81.90; the gather dispatch at fsdp=128 with kernel_fsdp=experts needed 802.74 GiB."""
  e16, e8 = ["mesh.expert=16", "mesh.context=2", "mesh.fsdp=8"], ["mesh.expert=8", "mesh.context=2", "mesh.fsdp=16"]
  barrier = [f"{MOE}grad_reduce_barrier=true"]
  peaks = [est(*Q397, *e16, *COMPACT, *barrier).peak, est(*Q397, *e8, *COMPACT, *barrier).peak,
           est(*Q397, *e16, *COMPACT).peak, est(*Q397, *e8, *COMPACT).peak]
  assert peaks == sorted(peaks) and len(set(peaks)) == 4
  wide = est(*Q397, "mesh.fsdp=128", "mesh.context=2", f"{MOE}kernel_fsdp=experts")
  assert 700 * GiB < wide.peak < 900 * GiB and wide.terms["dispatch"] > 0.9 * wide.peak
  # the arguments the compiles reported: parameters 5.78 GiB, AdamW state 11.56 per device
  e = est(*Q397, *e16, *COMPACT, *barrier)
  assert round(e.terms["params"] / GiB, 2) == 5.78 and round(e.terms["opt_state"] / GiB, 2) == 11.56


def test_the_floor_is_under_every_compiled_peak():
  """The refusal's floor never exceeds what compiled: the 397B rows (74.39 GiB the least) and DeepSeek-V3 on
  v5p-512 at expert=8 fsdp=32 (68.63 GiB), from docs/compile.md."""
  e16 = ["mesh.expert=16", "mesh.context=2", "mesh.fsdp=8", *COMPACT, f"{MOE}grad_reduce_barrier=true"]
  assert est(*Q397, *e16).floor <= 74.39 * GiB
  dsv3 = est("model=deepseek-v3", "train.seq_len=4096", "train.per_device_batch_size=1", "remat=full",
             "mesh.expert=8", "mesh.fsdp=32")
  assert dsv3.floor <= 68.63 * GiB
  assert round(dsv3.terms["params"] / GiB, 2) == 9.77  # the compiled arguments' parameters


def test_train_refuses_a_layout_that_cannot_fit_and_names_the_fix():
  # 397B replicated over mesh.data: every device would hold 1/8 of the parameters and their AdamW state.
  bad = load_config(*Q397, "mesh.data=32", "mesh.fsdp=8")
  why = layout_refusal(bad, 256, int(94.74 * GiB))
  assert why is not None and "mesh.data=32" in why and "mesh.fsdp" in why
  # The control: the layout that compiled at 74.39 GiB is not refused, nor is anything without a device memory.
  good = load_config(*Q397, "mesh.expert=16", "mesh.context=2", "mesh.fsdp=8", *COMPACT)
  assert layout_refusal(good, 256, int(94.74 * GiB)) is None
  assert layout_refusal(bad, 256, None) is None


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_train_refusal_on_tpu_topology_devices():
  """refuse_unfit_layout reads the device memory of a TPU topology's (compile-only) devices itself."""
  from meshlm.commands.train import refuse_unfit_layout
  from meshlm.parallel import topology as TP
  devices = TP.devices(TP.parse("v5p:2x2x1"))
  # llama3-8b whole on each of 4 devices (mesh.data=4): 8e9 x 12 bytes of parameters and AdamW state per device
  with pytest.raises(ConfigError, match="mesh.data=4"):
    refuse_unfit_layout(load_config("model=llama3-8b", "mesh.data=4", "mesh.fsdp=1"), devices)
  refuse_unfit_layout(load_config("model=llama3-8b", "mesh.fsdp=4", "remat=full"), devices)  # fits: no error


def test_rank_reorders_with_what_a_compile_showed_the_estimate_misses():
  """After a compile over its estimate, the layouts that no longer fit by estimate plus that excess go behind the
  ones that still do; and one the temporaries' limit leaves no room for goes behind too."""
  cands = LO.candidates(Q397, 256, "tpu", load_config)
  hbm = int(94.74 * GiB)
  first = LO.rank(cands, hbm)
  assert [c.estimate.peak for c in first] == sorted(c.estimate.peak for c in first)
  # an excess that leaves only the lowest estimates fitting
  cut = sorted(c.estimate.peak for c in cands)[3]
  again = LO.rank(cands, hbm, offset=hbm - cut)
  assert {id(c) for c in again[:4]} == {id(c) for c in first[:4]}
  over = [c for c in again if c.estimate.peak + hbm - cut > hbm]
  assert again[-len(over):] == sorted(over, key=lambda c: (c.estimate.peak, c.drops, c.context))
  roomless = LO.rank(cands, hbm, temp_room=0)  # no estimate less its arguments fits in no room
  assert [c.estimate.peak for c in roomless] == [c.estimate.peak for c in first]
