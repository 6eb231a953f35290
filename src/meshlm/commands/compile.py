"""`meshlm compile key=value ... topology=NAME`: the programs meshlm would run, compiled for a topology.

The train step (`--program train`, through train/step.py's build_train_step, as `meshlm train` builds it), the
RL step (`rl`: rl/step.py's build_rl_step, as `meshlm rl`) and the sampler's prefill and decode loop (`prefill`,
`decode`: models/generate.py's, as `meshlm generate` and the RL rollouts) are lowered from abstract inputs on the
topology's devices with the config's mesh and compiled for that chip; nothing is allocated or run.
analysis/aot.py reports on each. docs/compile.md has the fields and the measured rows.
"""
from __future__ import annotations

import math
import sys

from meshlm.commands.resolve import load_config
from meshlm.errors import ConfigError

USAGE = ("meshlm compile [key=value ...] topology=NAME [hbm_gib=X] [temp_gib=X] [fit_compiles=N] "
         "[--program train|rl|prefill|decode[,...]] [--fit[=batch|remat|layout]] [--no-census] [--json]")
OPTIONS = """  topology=NAME     what to compile for (required): cpu:N (N fake host devices; no extra package), a TPU
                    chip grid as libtpu names it (v5p:2x2x1, v6e:2x4, tpu7x:4x4x8) or an accelerator type
                    (v5p-8, v6e-8, tpu7x-256); TPU needs libtpu: pip install 'meshlm[tpu]'
  hbm_gib=X         the device memory to fit into, in GiB (default: the TPU compiler's own limit; none on CPU)
  --program P[,P]   train (default), rl (the GRPO step: rl.prompts_per_step x rl.num_generations rows over the
                    devices), prefill, decode (the sampler: train.per_device_batch_size x devices rows, or with rl
                    the rollout's; prompts of train.seq_len, rl.max_new_tokens new tokens; decode needs the prefill)
  --fit[=batch]     search the largest train.per_device_batch_size whose train step fits (one compile per try)
  --fit=remat       the least recompute (remat none, dots, full) whose train step fits at the given batch
  --fit=layout      rank the mesh splits and MoE knobs not given by an estimate from shapes, compile the best first,
                    print the first command that fits (temp_gib=X: temporaries too; fit_compiles=N tries, 3)
  --no-census       skip the census (the memory and roofline still come from the compiled program)
  --json            the report as JSON
  Exit status: 0 when every program fits (or no memory is known), 1 when one does not, 2 for a usage error."""
OWN_KEYS = {"topology": str, "hbm_gib": float, "temp_gib": float, "fit_compiles": int}
FITS = ("batch", "remat", "layout")
FIT_COMPILES = 3  # --fit=layout compiles at most this many layouts unless fit_compiles= says otherwise
RANKED_SHOWN = 8  # --fit=layout prints this many of the ranked layouts
PROGRAMS = ("train", "rl", "prefill", "decode")
REMATS = ("none", "dots", "full")
MAX_FIT_BATCH = 1 << 16


def _split_own(args: list[str]) -> tuple[dict, list[str], str | None]:
  """(own keys, the rest, --fit's search or None)."""
  own, rest, fit = {}, [], None
  for a in args:
    key, eq, value = a.partition("=")
    if key in OWN_KEYS and eq:
      try:
        own[key] = OWN_KEYS[key](value)
      except ValueError:
        raise ConfigError(f"{key}={value!r}: expected a {OWN_KEYS[key].__name__}") from None
    elif key == "--fit":
      fit = value if eq else "batch"
      if fit not in FITS:
        raise ConfigError(f"--fit={value}: expected --fit (the batch), --fit=batch, --fit=remat or --fit=layout")
    else:
      rest.append(a)
  if "topology" not in own:
    raise ConfigError(f"compile: topology=NAME is required (cpu:N, v5p:2x2x1, tpu7x-256, ...); usage: {USAGE}")
  for key in ("hbm_gib", "temp_gib", "fit_compiles"):
    if own.get(key) is not None and own[key] <= 0:
      raise ConfigError(f"{key}={own[key]}: must be positive")
  if fit != "layout" and ("temp_gib" in own or "fit_compiles" in own):
    raise ConfigError(f"{'temp_gib' if 'temp_gib' in own else 'fit_compiles'}=: only --fit=layout reads it; add "
                      "--fit=layout or drop it")
  return own, rest, fit


def _programs(opts: dict) -> list[str]:
  names = [p.strip() for v in opts.get("--program", ["train"]) for p in v.split(",") if p.strip()]
  for p in names:
    if p not in PROGRAMS:
      raise ConfigError(f"--program {p}: expected one of {', '.join(PROGRAMS)}")
  return list(dict.fromkeys(names)) or ["train"]


def _with_mesh_sizes(overrides: list[str], n: int) -> list[str]:
  """The overrides with every mesh axis fixed for n devices, so what resolves from the mesh size (the MoE
  kernel layout) sees the topology's devices rather than cpu_devices."""
  from meshlm.parallel.mesh import resolve_mesh_shape
  cfg = load_config(*overrides)
  # compile takes its devices from topology=, never cpu_devices (refused above): the error names that key.
  sizes = resolve_mesh_shape(cfg, n, devices_key="topology= to a topology of that many devices (cpu:N, a TPU slice)")
  return overrides + [f"mesh.{k}={v}" for k, v in sizes.items()]


# --------------------------------------------------------------------------------------------- programs

def _train(cfg, mesh, rl: bool = False):
  """(lowered, {input group: abstract tree}, tokens per device) of the train or RL step."""
  if rl:
    from meshlm.rl.step import build_rl_step
    step = build_rl_step(cfg, mesh)
  else:
    from meshlm.train.step import build_train_step
    step = build_train_step(cfg, mesh)
  state, batch = step.abstract_state(), step.abstract_batch()
  inputs = {"params": state.params, "opt_state": state.opt_state, "model_state": state.model_state,
            "step": state.step, "batch": batch}
  tokens = step.global_batch * cfg.train.seq_len / mesh.size
  return step.lower(), inputs, tokens


def _loss_path(cfg, devices: int) -> str:
  """The train step's head and loss as compiled: loss_impl, with auto decided for this batch (models/logprobs.py)."""
  from meshlm.models.logprobs import loss_path
  rows = cfg.train.per_device_batch_size * devices // cfg.train.micro_batches
  return loss_path(cfg, rows, cfg.train.seq_len)


def _rl_config(cfg, devices: int):
  """meshlm rl's shapes: rl.prompts_per_step x rl.num_generations rows over the devices (rl/trainer.rl_config; the
  row length is train.seq_len here, where meshlm rl reads it from its prompts)."""
  rl = cfg.rl
  rows = rl.prompts_per_step * rl.num_generations
  if rows % devices:
    raise ConfigError(f"--program rl: rl.prompts_per_step={rl.prompts_per_step} x rl.num_generations="
                      f"{rl.num_generations} = {rows} rows do not split over {devices} devices; make the product a "
                      f"multiple of {devices}")
  return cfg.model_copy(update={"train": cfg.train.model_copy(update={"per_device_batch_size": rows // devices})})


def _sampler_inputs(cfg, mesh):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from meshlm.models.params import model_shardings, model_specs
  from meshlm.models.generate import bucket
  m, t = cfg.model, cfg.train
  shardings = model_shardings(cfg, mesh)
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.dtype(t.param_dtype), sharding=sh),
                        model_specs(cfg), shardings, is_leaf=lambda x: hasattr(x, "axes"))
  rows = t.per_device_batch_size * mesh.size
  rep = NamedSharding(mesh, PartitionSpec())
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731 (host arrays: replicated)
  T, N = bucket(t.seq_len, m.max_position), bucket(cfg.rl.max_new_tokens, m.max_position)
  static = {"cache_len": bucket(t.seq_len + cfg.rl.max_new_tokens, m.max_position), "new_len": N, "total_len": T + N}
  return params, (i32(rows, T), i32(rows), i32(rows), i32(1)), static, rows


def _prefill_outputs(cfg, mesh, prefill, args, static):
  """The prefill's outputs as abstract arrays with their shardings, without compiling it: under explicit sharding
  each output's type carries its sharding (jax.eval_shape, traced only); under auto the compiler picks them, and
  this is None."""
  import jax
  from jax.sharding import AxisType, NamedSharding
  if any(t != AxisType.Explicit for t in mesh.axis_types):
    return None
  with jax.set_mesh(mesh):
    out = jax.eval_shape(lambda *a: prefill(*a, **static), *args)
  return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=NamedSharding(mesh, o.sharding.spec)),
                      out)


def _sampler(cfg, mesh, programs: set[str], report_of, devices_per_chip: int = 1):
  """{"prefill": report, "decode": report} for the programs asked for: the prefill lowered from abstract inputs; the
  decode loop from the prefill's outputs (their shapes and shardings: traced, or under shard_mode=auto, where only
  the compiler knows them, from the compiled prefill, which is then compiled and reported too)."""
  import jax
  from meshlm.models.generate import sampler_programs
  rl = cfg.rl
  prefill, decode_loop = sampler_programs(cfg, rl.temperature, rl.top_k, rl.top_p)
  params, (tokens, lengths, seeds, stops), static, rows = _sampler_inputs(cfg, mesh)
  args = (params, tokens, lengths, seeds, stops)
  state = _prefill_outputs(cfg, mesh, prefill, args, static) if "decode" in programs else None
  out = {}
  if "prefill" in programs or ("decode" in programs and state is None):
    with jax.set_mesh(mesh):
      low = prefill.lower(*args, **static)
    out["prefill"] = report_of(low, {"params": params, "prompts": (tokens, lengths, seeds, stops)},
                               cfg.train.per_device_batch_size * cfg.train.seq_len, keep=state is None, forward=True)
  if "decode" in programs:
    if state is None:
      compiled = out["prefill"].pop("_compiled")
      if compiled is None:
        raise ConfigError("--program decode: the prefill, whose outputs the decode loop takes, does not fit; "
                          "lower train.per_device_batch_size or train.seq_len")
      state = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh), low.out_info,
                           compiled.output_shardings)
    toks, lps, n, done, cache, bufs = state
    max_new = jax.ShapeDtypeStruct((), "int32", sharding=stops.sharding)
    with jax.set_mesh(mesh):
      dlow = decode_loop.lower(params, toks, lps, n, done, cache, bufs, lengths, seeds, stops, max_new)
    # The loop's trip count is a runtime value (max_new, and every row done): the roofline is one trip of it (one
    # token per row; analysis/aot.py's decode step), with what runs once per call around it apart.
    out["decode"] = report_of(dlow, {"params": params, "cache": cache, "tokens": (toks, lps, n, done, bufs)},
                              cfg.train.per_device_batch_size, forward=True, step_loop=True)
    out["decode"]["rollout"] = rollout(out["decode"].get("roofline", {}), rl.max_new_tokens, rows, mesh.size,
                                       devices_per_chip)
  return out


def rollout(roof: dict, new_tokens: int, rows: int, devices: int, devices_per_chip: int) -> dict | None:
  """The decode loop's run over new_tokens at its roofline bound (no row stopping early): once_s + new_tokens x
  bound_s, and the tokens per second per chip it implies (rows x new_tokens over that time, over the chips).
  None where the roofline has no bound (no published chip figures) or no step loop."""
  if roof.get("bound_s") is None or roof.get("once_s") is None:
    return None
  seconds = roof["once_s"] + new_tokens * roof["bound_s"]
  return {"new_tokens": new_tokens, "rows": rows, "step_s": roof["bound_s"], "once_s": roof["once_s"],
          "seconds": seconds, "tokens_per_s_per_chip": rows * new_tokens / seconds / (devices / devices_per_chip)}


# ------------------------------------------------------------------------------------------------ command

def main(args: list[str]) -> int:
  from meshlm.analysis.arms import split_args
  from meshlm.commands.census import dumps
  own, rest, fit = _split_own(args)
  overrides, opts = split_args(rest, {"--json": False, "--program": True, "--no-census": False})
  programs = _programs(opts)
  from meshlm.parallel import topology as TP
  topo = TP.parse(own["topology"])
  cfg = load_config(*overrides)  # every key checked before any device or compile
  if cfg.cpu_devices is not None:
    raise ConfigError(f"cpu_devices={cfg.cpu_devices}: topology= sets the devices meshlm compile uses; drop "
                      "cpu_devices (topology=cpu:N gives N fake host devices)")
  _check_fit_programs(fit, programs)
  devices = TP.devices(topo)
  given = overrides  # as typed: --fit=layout searches the mesh axes and knobs they leave out
  from meshlm.analysis import aot
  chip = aot.chip_for(devices, topo.chips, own.get("hbm_gib"))
  if fit and chip.hbm_bytes is None:
    raise ConfigError(f"--fit: topology={topo.name} has no device memory to fit into; give hbm_gib=X")
  from meshlm.parallel.mesh import make_mesh
  census = "--no-census" not in opts
  report = {"topology": {"name": topo.name, "grid": topo.grid, "chips": topo.chips, "platform": topo.platform},
            "chip": chip.as_dict(), "programs": {}}

  def report_of(lowered, inputs, tokens_per_device, keep=False, with_census=census, cfg_=None, forward=False,
                step_loop=False):
    # The model FLOPs the program does per device: the training count, or its forward third for the sampler.
    flops = aot.model_flops_per_token(cfg_ or cfg) * tokens_per_device / (3 if forward else 1)
    return aot.compile_report(lowered, inputs, chip, flops, census=with_census, keep=keep,
                              recompute=0.0 if forward else aot.remat_recompute(cfg_ or cfg), step_loop=step_loop)

  def step_report(name, c, with_census=census):
    """The train or RL step of config c compiled: its report, with the rows per device."""
    mesh = make_mesh(c, devices)
    c = _rl_config(c, mesh.size) if name == "rl" else c
    lowered, inputs, tokens = _train(c, mesh, rl=name == "rl")
    return report_of(lowered, inputs, tokens, with_census=with_census, cfg_=c) | {
        "rows_per_device": c.train.per_device_batch_size}

  if fit == "layout":
    report["fit"], chosen, best = _fit_layout(given, programs[0], len(devices), chip, own, step_report)
    overrides = chosen or _with_mesh_sizes(given, len(devices))
    cfg = load_config(*overrides)
    if best is not None and not census:
      report["programs"][programs[0]] = best  # the search compiled it already, and there is no census to add
  else:
    overrides = _with_mesh_sizes(overrides, len(devices))
    cfg = load_config(*overrides)
  if fit in ("batch", "remat"):
    report["fit"], cfg, best = _fit(cfg, overrides, fit, len(devices), lambda c, with_census: step_report(
        "train", c, with_census))
    if best is not None and not census:
      report["programs"]["train"] = best  # the search compiled it already, and there is no census to add
  mesh = make_mesh(cfg, devices)
  # With rl, the sampler's programs are the rollouts' (meshlm rl samples prompts x generations rows), as the RL step.
  rl_cfg = _rl_config(cfg, mesh.size) if "rl" in programs else None
  for name in programs:
    if name in report["programs"]:
      continue
    if name in ("train", "rl"):
      if fit == "layout" and report["fit"]["best"] is None:
        continue  # no layout fitted: the search's tries are the report
      report["programs"][name] = step_report(name, cfg)
    else:
      c = rl_cfg or cfg
      sampled = _sampler(c, mesh, {p for p in programs if p in ("prefill", "decode")}, report_of,
                         chip.devices_per_chip)
      report["programs"] |= {k: v | {"rows_per_device": c.train.per_device_batch_size} for k, v in sampled.items()}
  from meshlm.analysis.census import config_summary
  report["config"] = config_summary(cfg, topo.platform) | {"remat": cfg.remat, "micro_batches": cfg.train.micro_batches}
  report["config"]["loss_path"] = _loss_path(cfg, mesh.size)
  print(dumps(report) if "--json" in opts else render(report))
  sys.stdout.flush()
  if fit == "layout" and report["fit"]["best"] is None:
    return 1
  return 1 if any(p["memory"]["fits"] is False for p in report["programs"].values()) else 0


def _check_fit_programs(fit: str | None, programs: list[str]) -> None:
  if fit in ("batch", "remat") and programs != ["train"]:
    raise ConfigError(f"--fit searches the train step's batch or remat; it runs with --program train only (got "
                      f"--program {','.join(programs)})")
  if fit == "layout" and programs not in (["train"], ["rl"]):
    raise ConfigError(f"--fit=layout searches the layout of one step: --program train or --program rl (got "
                      f"--program {','.join(programs)})")


def _fit_layout(given: list[str], program: str, devices: int, chip, own: dict, step_report
                ) -> tuple[dict, list[str] | None, dict | None]:
  """(the search's record, the winning overrides or None, its report without census or None). The layouts
  (analysis/layout.py candidates: the mesh splits and MoE knobs `given` leaves out) ranked by their estimate; the
  first compiled, then the next in the order re-ranked with what the compiles showed the estimate misses (the
  largest measured peak over its estimate, added to every estimate), until one fits (its peak within the device's
  memory and, with temp_gib, its temporaries within that) or fit_compiles layouts are tried. A kernel's scoped VMEM
  refusing a layout stops the search there (record["vmem"]: a block key to change, which no layout changes)."""
  import time
  from meshlm.analysis import layout as LO
  start = time.perf_counter()
  rl_rows = (lambda c: _rl_config(c, devices)) if program == "rl" else None
  if rl_rows:
    rl_rows(load_config(*given))  # rows that do not split over the devices fail here, in their own words
  cands = LO.candidates(given, devices, chip.platform, load_config, rl_rows)
  if not cands:
    raise ConfigError(f"--fit=layout: no layout of {devices} devices is valid for this config; free a mesh key")
  hbm = chip.hbm_bytes
  temp_limit = int(own["temp_gib"] * (1 << 30)) if "temp_gib" in own else None
  ranked = LO.rank(cands, hbm)
  record = {"search": "layout", "program": program, "candidates": len(cands),
            "ranked": [c.as_dict() for c in ranked[:RANKED_SHOWN]], "hbm_bytes": hbm, "temp_limit_bytes": temp_limit,
            "tried": [], "best": None, "given": given}
  offset, room, left = 0, None, ranked
  for _ in range(own.get("fit_compiles", FIT_COMPILES)):
    if not left:
      break
    c, left = left[0], left[1:]
    row = {"overrides": c.overrides, "estimate_bytes": c.estimate.peak, "drops": c.drops}
    try:
      r = step_report(program, load_config(*given, *c.overrides), with_census=False)
    except Exception as e:  # a layout the builder or XLA refuses for another reason: named, and the next one tried
      record["tried"].append(row | {"fits": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
      continue
    mem = r["memory"]
    if "vmem" in mem:  # a kernel's block is the fault, not the layout: the next layouts would fail alike
      record["tried"].append(row | {"fits": False, "vmem": mem["vmem"], "compile_s": r["compile_s"]})
      record["vmem"] = mem["vmem"]
      break
    temp = mem.get("temp_bytes")
    fits = bool(mem["fits"]) and (temp_limit is None or (temp is not None and temp <= temp_limit))
    row |= {"fits": fits, "peak_bytes": mem["peak_bytes"], "temp_bytes": temp, "compile_s": r["compile_s"],
            "bound_s": r.get("roofline", {}).get("bound_s")}
    record["tried"].append(row)
    if fits:
      record["best"] = c.overrides
      record["command"] = f"meshlm {program} " + " ".join(given + c.overrides)
      break
    offset = max(offset, mem["peak_bytes"] - c.estimate.peak)
    if temp_limit is not None and temp is not None and temp > temp_limit:
      # what the temporaries came to over the estimate less the arguments: the room left for the others
      args = sum(c.estimate.terms[k] for k in ("params", "opt_state", "model_state"))
      missed = temp - (c.estimate.peak - args)
      room = temp_limit - missed if room is None else min(room, temp_limit - missed)
    left = LO.rank(left, hbm, offset, room)
  record["offset_bytes"], record["search_s"] = offset, time.perf_counter() - start
  if record["best"] is None:
    return record, None, None
  return record, given + record["best"], r


def _fit(cfg, overrides: list[str], how: str, devices: int, train_report) -> tuple[dict, object, dict | None]:
  """(the search's record, the config it settles on, that config's report without census or None). batch:
  doubling from train.per_device_batch_size while it fits (halving while it does not), then bisection between
  the largest fit and the smallest misfit; only batches whose global batch train.micro_batches divides. remat:
  none, dots, full at the given batch."""
  tried, reports = [], {}

  def attempt(extra: list[str]) -> bool:
    c = load_config(*overrides, *extra)
    r = reports[extra[0]] = train_report(c, with_census=False)
    mem = r["memory"]
    tried.append({"overrides": extra, "fits": mem["fits"], "peak_bytes": mem["peak_bytes"],
                  "compile_s": r["compile_s"]})
    return bool(mem["fits"])

  if how == "remat":
    for policy in REMATS:
      if attempt([f"remat={policy}"]):
        return ({"search": "remat", "tried": tried, "best": policy}, load_config(*overrides, f"remat={policy}"),
                reports[f"remat={policy}"])
    return {"search": "remat", "tried": tried, "best": None}, cfg, None
  unit = cfg.train.micro_batches // math.gcd(cfg.train.micro_batches, devices)  # per-device batches step by this
  fits = lambda k: attempt([f"train.per_device_batch_size={k * unit}"])  # noqa: E731
  k = max(1, cfg.train.per_device_batch_size // unit)
  lo, hi = 0, None  # the largest k known to fit, the smallest known not to
  if fits(k):
    lo = k
    while k * 2 * unit <= MAX_FIT_BATCH and fits(k * 2):
      k *= 2
      lo = k
    hi = k * 2 if k * 2 * unit <= MAX_FIT_BATCH else None
  else:
    hi = k
    while k > 1:
      k //= 2
      if fits(k):
        lo = k
        break
      hi = k
  while hi is not None and hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  best = lo * unit or None
  record = {"search": "batch", "tried": tried, "best": best}
  if best is None:
    return record, cfg, None
  key = f"train.per_device_batch_size={best}"
  return record, load_config(*overrides, key), reports[key]


# ------------------------------------------------------------------------------------------------ render

def _gib(b) -> str:
  if b is None:
    return "-"
  return f"{b / (1 << 30):,.2f} GiB" if b >= 1 << 30 else f"{b / (1 << 20):,.2f} MiB"


def _si(x, unit: str) -> str:
  if x is None:
    return "-"
  for scale, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {p}{unit}"
  return f"{x:.3g} {unit}"


def _short(overrides: list[str]) -> str:
  """A layout's overrides as the report prints them: the mesh axes above 1 and the MoE knobs, prefixes dropped."""
  out = []
  for o in overrides:
    key, _, value = o.partition("=")
    if key.startswith("mesh.") and value == "1":
      continue
    out.append(f"{key.removeprefix('mesh.').removeprefix('model.parts.moe.')}={value}")
  return " ".join(out)


def render_layout(fit: dict) -> list[str]:
  """--fit=layout's lines: the ranked layouts with their estimate's terms, each compile tried, the command."""
  from meshlm.analysis.aot import vmem_line
  lines = [f"  fit=layout ({fit['program']} step): {fit['candidates']} layouts ranked by the estimate (GiB per device; "
           f"analysis/layout.py), the first {len(fit['ranked'])}:"]
  for i, c in enumerate(fit["ranked"], 1):
    e = c["estimate"]
    terms = " ".join(f"{k} {v / (1 << 30):.2f}" for k, v in e["terms"].items() if v)
    lines.append(f"   {i}. {_short(c['overrides'])}{' (drops past its buffers)' if c['drops'] else ''}: estimate "
                 f"{e['peak'] / (1 << 30):.2f}, floor {e['floor'] / (1 << 30):.2f} [{terms}]")
  for t in fit["tried"]:
    head = f"  compiled {_short(t['overrides'])} (estimate {_gib(t['estimate_bytes'])}): "
    if "error" in t:
      lines.append(head + f"failed: {t['error']}")
      continue
    if "vmem" in t:
      lines.append(head + f"does not fit: {vmem_line(t['vmem'])}; the search stops (no layout changes a kernel's "
                   "block)")
      continue
    bound = f", roofline step >= {t['bound_s'] * 1e3:,.1f} ms" if t.get("bound_s") else ""
    lines.append(head + f"{'fits' if t['fits'] else 'does not fit'} (peak {_gib(t['peak_bytes'])}, temporaries "
                 f"{_gib(t['temp_bytes'])}{bound}, compile {t['compile_s']:.1f} s)")
  limit = f", temporaries <= {_gib(fit['temp_limit_bytes'])}" if fit.get("temp_limit_bytes") else ""
  lines.append(f"  fit=layout: {len(fit['tried'])} compiles, {fit['search_s']:.0f} s (peak <= {_gib(fit['hbm_bytes'])}"
               f"{limit})")
  if fit.get("vmem"):
    lines.append(f"  fit=layout: stopped: {vmem_line(fit['vmem'])}")
  elif fit["best"] is None:
    lines.append("  fit=layout: none of the layouts compiled fits; raise fit_compiles=, or give more devices")
  else:
    lines.append(f"  command: {fit['command']}")
    if any("ep_buffer_factor" in o and not o.endswith("=null") for o in fit["best"]):
      lines.append("  its ep_buffer_factor drops the routed rows past each peer's buffer (counted in moe_dropped)")
  return lines


def _vmem_refused(name: str, p: dict) -> list[str]:
  """A program a kernel's scoped VMEM refused: its head line and the verdict naming the kernel and the key."""
  from meshlm.analysis.aot import vmem_line
  return [f"[{name}] {p['rows_per_device']} rows per device; compiled in {p['compile_s']:.1f} s: DOES NOT FIT",
          f"  {vmem_line(p['memory']['vmem'])}"]


def render(report: dict) -> str:
  from meshlm.analysis.census import unread_loops_line
  from meshlm.analysis.keys import keys_line
  c, chip, topo = report["config"], report["chip"], report["topology"]
  mesh = " ".join(f"{k}={v}" for k, v in c["mesh"].items() if v != 1) or "all 1"
  # The train batch only where the train step is compiled: rl and the sampler have rows of their own (per program).
  batch = f"per_device_batch_size={c['per_device_batch_size']}  " if "train" in report["programs"] else ""
  lines = [f"compile {c['model']}  topology={topo['name']} ({chip['devices']} x {chip['kind']}, "
           f"{chip['devices_per_chip']} per chip)  mesh {mesh}  shard_mode={c['shard_mode']}  remat={c['remat']}  "
           f"attention={c.get('attention_impl', '-')}  " + (f"gdn={c['gdn_impl']}  " if c.get("gdn_impl") else "") +
           f"{batch}seq_len={c['seq_len']}"
           + (f"  loss={c['loss_path']}" if "loss_path" in c else "")]
  lines += [line for line in (keys_line(c),) if line]
  fit = report.get("fit")
  if fit and fit["search"] == "layout":
    lines += render_layout(fit)
  elif fit:
    for t in fit["tried"]:
      lines.append(f"  fit {' '.join(t['overrides'])}: {'fits' if t['fits'] else 'does not fit'} "
                   f"(peak {_gib(t['peak_bytes'])}, compile {t['compile_s']:.1f} s)")
    lines.append(f"  fit: {fit['search']} = {fit['best'] if fit['best'] is not None else 'none fits'}")
  for name, p in report["programs"].items():
    mem = p["memory"]
    if "vmem" in mem:
      lines += _vmem_refused(name, p)
      continue
    verdict = {True: "fits", False: "DOES NOT FIT", None: "no device memory known"}[mem["fits"]]
    hbm = f" of {_gib(mem['hbm_bytes'])} ({chip['hbm_source']})" if mem.get("hbm_bytes") else ""
    lines.append(f"[{name}] {p['rows_per_device']} rows per device; compiled in {p['compile_s']:.1f} s; peak "
                 f"{_gib(mem['peak_bytes'])} per device{hbm}: {verdict}")
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in mem["arguments_by_input"].items() if v)
    if mem.get("largest_buffers"):
      lines.append("  largest buffers: " + "; ".join(f"{_gib(b['bytes'])} {b['shapes']}" for b in mem["largest_buffers"][:3]))
    if "oom" in mem:
      lines.append(f"  the compiler refused it: {_gib(mem['oom']['required_bytes'])} of arguments and temporaries "
                   f"needed, {_gib(mem['oom']['available_bytes'])} available; inputs per device: {parts}")
      continue
    lines.append(f"  arguments {_gib(mem.get('argument_bytes'))} ({parts}); outputs {_gib(mem.get('output_bytes'))}, "
                 f"aliased {_gib(mem.get('alias_bytes'))}; temporaries {_gib(mem.get('temp_bytes'))}")
    r = p["roofline"]
    xla = r["xla_cost_analysis"]
    custom = f", of which custom calls {_si(r['custom_call_flops'], 'FLOP')}" if r.get("custom_call_flops") else ""
    run = (f", with remat's recompute {_si(r['model_flops_run'], 'FLOP')}: HLO / model {r['hlo_over_model']:.3f}"
           if r.get("hlo_over_model") else "")
    lines.append(f"  FLOPs {_si(r['flops'], 'FLOP')}{custom} (model {_si(r['model_flops'], 'FLOP')}{run}; XLA "
                 f"cost_analysis, each loop once: {_si(xla.get('flops'), 'FLOP')}), HBM traffic ~{_si(r['bytes'], 'B')} "
                 f"(XLA: {_si(xla.get('bytes_accessed'), 'B')})")
    if "bound_s" in r:
      mfu = f", MFU at that bound {100 * r['mfu_at_bound']:.1f}%" if r.get("mfu_at_bound") else ""
      lines.append(f"  roofline: compute {r['compute_s'] * 1e3:,.1f} ms at {_si(r['peak_flops'], 'FLOP/s')}, memory "
                   f"{r['memory_s'] * 1e3:,.1f} ms at {_si(r['hbm_bandwidth'], 'B/s')}: step >= "
                   f"{r['bound_s'] * 1e3:,.1f} ms ({r['bound_by']}-bound){mfu}")
    if r.get("step_loop"):
      lines.append(f"  one decode step (a trip of the token loop; per device): ~{_si(r['bytes'], 'B')}, "
                   f"{_si(r['flops'], 'FLOP')}; once per call around it: ~{_si(r['once_bytes'], 'B')}")
    ro = p.get("rollout")
    if ro:
      lines.append(f"  rollout: {ro['rows']} rows x {ro['new_tokens']:,} new tokens at the bound: "
                   f"{ro['seconds']:,.1f} s ({ro['step_s'] * 1e3:,.2f} ms per step), "
                   f"{ro['tokens_per_s_per_chip']:,.1f} tokens/s per chip")
    cen = p.get("census")
    unread = unread_loops_line({"stablehlo": cen["stablehlo"]["unread_loops"]} if cen else {}
                               | {"hlo": r["unread_loops"]})
    if unread:
      lines.append("  " + unread)
    for part in r.get("estimated", []):
      lines.append(f"  estimated: {part}")
    kinds = ", ".join(f"{k} {v}" for k, v in p["collective_instructions"].items() if v)
    lines.append(f"  collective instructions in the text {sum(p['collective_instructions'].values())}: "
                 f"{kinds or 'none'}")
    if cen:
      cols = cen["hlo"]["collectives"]
      total = sum(v["count"] for v in cols.values())
      per = ", ".join(f"{k} {v['count']} ({_si(v['bytes'], 'B')})" for k, v in cols.items() if v["count"])
      tod = cen["stablehlo"]["transpose_of_dot"]
      lines.append(f"  collectives {total}: {per or 'none'}")
      lines.append(f"  transpose-of-dot blocked {tod['blocked']} (adjacent {tod['adjacent']}); copies "
                   f"{cen['hlo']['copies']}; blow-ups {len(cen['blowups'])}; scanned stacks not layer-major "
                   f"{len(cen['scan_layout'])}")
  return "\n".join(lines)
