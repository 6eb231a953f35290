"""meshlm <command> [key=value ...]: train | eval | rl | census | compare | compile | bench | convert | generate."""
from __future__ import annotations

import signal
import sys
import time
import warnings

from meshlm.errors import ConfigError, UsageError

USAGE = """usage: meshlm <command> [key=value ...]

commands:
  train     train a model: meshlm train model=llama2-tiny train.steps=100
  eval      the validation loss of a model, no training: meshlm eval model=RUN_DIR eval.path=val.jsonl
  rl        GRPO with rewards: meshlm rl model=RUN_DIR rl.prompts=prompts.jsonl rl.reward=exact_match
  presets   list the model presets
  convert   Hugging Face <-> meshlm: meshlm convert hf-to-meshlm SRC DST | meshlm-to-hf SRC DST
  census    HLO census of the train step: meshlm census [key=value ...] [--json]
  compile   the step compiled for a topology (TPU via libtpu, or cpu:N): memory, census, roofline:
            meshlm compile model=llama3-8b topology=v5p:2x2x1 mesh.fsdp=4 [--program rl|prefill|decode] [--fit]
  compare   A/B census: meshlm compare [key=value ...] --arm NAME:k=v[,k=v] --arm ... [--json]
  bench     interleaved timing: meshlm bench [key=value ...] --arm ... --reps N [--json] [--plot PATH]
  generate  sample with a KV cache: meshlm generate PATH prompt="def f(" max_new_tokens=64

Keys are dotted paths into the config; model=NAME picks a preset.
`meshlm <command> --help` shows the command's usage and the keys it reads with their type, default and meaning
(`meshlm train --help` the model's; every key: docs/config.md)."""

# One-line summaries for `meshlm <command> --help`; each command's usage line comes from its module.
SUMMARIES = {
    "train": "Train a model; the same command with the same run_dir resumes from its latest checkpoint.",
    "eval": ("The validation loss and perplexity of a model's parameters over eval.path (the whole file, each row "
             "once; eval.batches caps it), as a train run measures it, with no training; writes nothing."),
    "rl": "Reinforcement learning (GRPO) on prompts with rewards; the same command with the same run_dir resumes.",
    "census": "HLO census of the train step `meshlm train` would compile (nothing runs).",
    "compile": ("The train step (or the RL step, the sampler's prefill and decode) compiled for a topology's devices "
                "(a TPU slice through libtpu, or fake CPU devices) from abstract inputs: memory per device against the "
                "HBM (fits or not), the census, a roofline and the compile time. Nothing is allocated or run."),
    "compare": "A/B census: the same train step under two or more arms of overrides.",
    "bench": "Interleaved timing of the train step under one or more arms of overrides.",
    "convert": "Convert between Hugging Face and meshlm model directories.",
    "generate": "Sample from a run, meshlm model or Hugging Face directory (temperature 0 is greedy).",
}


def _fail(msg: str) -> int:
  print(f"meshlm: error: {msg}", file=sys.stderr)
  return 2


def vmem_refusal(e: Exception) -> str | None:
  """The one line of a program the compiler refused for a kernel's scoped VMEM (meshlm train, rl, eval on TPU: the
  kernel, its phase and the key to change; analysis/aot.vmem_figures), or None for another error. It exits 2, as
  the refusal of a layout that cannot fit the device's HBM does."""
  if "Scoped allocation with size" not in str(e):
    return None
  from meshlm.analysis.aot import vmem_figures, vmem_line
  found = vmem_figures(str(e))
  return None if found is None else vmem_line(found)


def _usage_of(cmd: str) -> tuple[str, str | None]:
  """(usage line, the command's own options or None); each comes from the command's module."""
  if cmd == "train":
    return "meshlm train [key=value ...]", None
  if cmd == "rl":
    from meshlm.commands.rl import USAGE
    return USAGE, None
  if cmd == "eval":
    from meshlm.commands.eval import OPTIONS, USAGE
    return USAGE, OPTIONS
  if cmd in ("census", "compare"):
    from meshlm.commands import census as c
    return (c.CENSUS_USAGE, c.CENSUS_OPTIONS) if cmd == "census" else (c.COMPARE_USAGE, c.COMPARE_OPTIONS)
  if cmd == "compile":
    from meshlm.commands.compile import OPTIONS, USAGE
    return USAGE, OPTIONS
  if cmd == "bench":
    from meshlm.commands.bench import BENCH_OPTIONS, BENCH_USAGE
    return BENCH_USAGE, BENCH_OPTIONS
  if cmd == "convert":
    from meshlm.commands.convert import OPTIONS, USAGE
    return USAGE, OPTIONS
  if cmd == "generate":
    from meshlm.commands.generate import OPTIONS, USAGE
    return USAGE, OPTIONS
  return f"meshlm {cmd}", None


# What a run's loop reads and a compile-only command does not: the data, the validation set, when to log, sample,
# stop and save.
_LOOP = ("run_dir", "checkpoint.", "data.", "eval.", "train.log_every", "train.sample_tokens", "train.sample_temperature",
         "train.on_nonfinite", "train.max_nonfinite_in_a_row", "train.stop_after")
# The optimizer's keys: what only an update reads.
_OPTIMIZER = ("train.learning_rate", "train.warmup_steps", "train.min_lr_ratio", "train.weight_decay", "train.b1",
              "train.b2", "train.grad_clip")
# rl.* keys read on the host only (the prompts, rewards, evaluation and logs): in no compiled program.
_RL_HOST = ("rl.prompts", "rl.reward", "rl.reward_weights", "rl.reward_regex", "rl.failed_reward", "rl.scale_rewards",
            "rl.mask_truncated_completions", "rl.eval_every", "rl.eval_prompts", "rl.log_completions")
# The config keys each command's --help lists, the ones it reads: (only these, or None for all; not these). A key
# or a section ending in '.'. generate and convert read a model directory's own config and take only where and how
# to run it. Every command but train lists model.* as one line (MODEL_POINTER): train's --help lists them all.
HELP_KEYS = {
    "train": (None, ("rl.",)),
    # rl sets the row length and batch from its prompts and rl.* (rl/trainer.rl_config), and reads no data files.
    "rl": (None, ("data.source", "data.path", "data.field", "train.seq_len", "train.per_device_batch_size",
                  "train.sample_tokens", "train.sample_temperature")),
    # eval reads the step's shapes and dtypes, the parameters to load and the data.* rules the validation set is read
    # with (eval.path, not data.path); nothing of the optimizer, the loop or the run directory.
    "eval": (None, ("rl.", "run_dir", "checkpoint.every", "checkpoint.keep", "checkpoint.dir", "data.source", "data.path",
                    "data.seed", "eval.every", *_OPTIMIZER, "train.steps", "train.micro_batches", "train.log_every",
                    "train.sample_tokens", "train.sample_temperature", "train.on_nonfinite",
                    "train.max_nonfinite_in_a_row", "train.stop_after", "train.freeze")),
    "census": (None, ("rl.", *_LOOP)),
    "compare": (None, ("rl.", *_LOOP)),
    "bench": (None, ("rl.", *_LOOP)),
    "compile": (None, (*_LOOP, *_RL_HOST, "cpu_devices", "distributed.")),  # --program rl reads the step's rl.* keys
    "generate": (("cpu_devices", "mesh.", "shard_mode", "data.tokenizer", "distributed."), ()),
    "convert": (("cpu_devices", "mesh.", "distributed."), ()),
}
MODEL_POINTER = ("  model.*  the model's fields, set by model=NAME (a preset) or model=PATH and overridden one by one\n"
                 "           (model.num_layers=2, model.parts.moe.num_experts=8): `meshlm train --help` lists them")
KEYS_POINTER = "Keys this command does not read are not listed; every key: docs/config.md."
PRESETS_HELP = """usage: meshlm presets

Lists every model preset (src/meshlm/config/presets/), one line each: its name (what model=NAME takes), its
model family and its parameter count, counted from the parameter specs (nothing is allocated). Takes no keys."""


def _part_keys() -> tuple:
  """model.parts.<part>.<knob> for every registered part with its own config section."""
  from meshlm.config.keys import section_keys
  from meshlm.models.registry import part_sections
  return tuple(k for name, section in part_sections().items() for k in section_keys(f"model.parts.{name}.", section))


def command_help(cmd: str) -> str:
  """`meshlm <cmd> --help`: usage, the command's own options, then the config keys it takes, from the schema."""
  from meshlm.config.keys import render_keys
  if cmd == "presets":
    return PRESETS_HELP
  usage, options = _usage_of(cmd)
  own = f"options:\n{options}\n\n" if options else ""
  only, skip = HELP_KEYS[cmd]
  if only is not None:
    return (f"usage: {usage}\n\n{SUMMARIES[cmd]}\n\n{own}The model and its settings come from PATH; these keys "
            f"set where and how it runs\n(a model.* key that keeps every parameter's shape may be given too).\n\n"
            f"config keys:\n{render_keys(only)}")
  if cmd == "train":
    table = render_keys(skip=skip, extra=_part_keys())
  else:
    table = f"{render_keys(skip=(*skip, 'model.'))}\n{MODEL_POINTER}"
  return (f"usage: {usage}\n\n{SUMMARIES[cmd]}\n\n{own}"
          "model=NAME picks a preset (meshlm presets lists them), which sets model.* and some train.* keys; the\n"
          "default column shows the schema's default where it says nothing. Values are YAML scalars: 3, 1e-3, true, "
          "null, [local,global].\n\n"
          f"config keys:\n{table}\n\n{KEYS_POINTER}")


def _show_warning(message, category, filename, lineno, file=None, line=None):
  """meshlm's own warnings as one line each; others (JAX, Orbax) as Python shows them."""
  if category.__module__.startswith("meshlm."):
    print(f"meshlm: warning: {message}", file=sys.stderr if file is None else file)
  else:
    _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def _data_label(cfg) -> str:
  """The header's data source: what the run reads, so a forgotten data.source shows at once."""
  d = cfg.data
  return f"{d.source}:{d.path}" if d.path else d.source


def cmd_train(args: list[str], start: float) -> int:
  from meshlm.commands.resolve import load_config
  from meshlm.parallel import set_cpu_devices
  cfg = load_config(*args)
  set_cpu_devices(cfg.cpu_devices)
  from meshlm.parallel.distributed import init_distributed
  init_distributed(cfg)  # joins the other processes before anything touches devices
  from meshlm.parallel.mesh import make_mesh
  mesh = make_mesh(cfg)  # validates the mesh against the devices before anything compiles
  from meshlm.commands.train import refuse_unfit_layout
  refuse_unfit_layout(cfg, list(mesh.devices.flat))  # on TPU: a layout that cannot fit, before compiling
  from meshlm.console import make_console, printable, report_stop
  from meshlm.train.loop import param_counts, prepare_run_dir, train
  from meshlm.train.run_dir import leave_as_found
  from meshlm.analysis.census import attention_impl
  from meshlm.models.registry import part_reports
  trainable, frozen = param_counts(cfg)  # train.freeze that leaves nothing to train fails here
  parts = "".join(f"{k.removesuffix('_impl')}={v}  " for k, v in part_reports(cfg).items())  # gdn=jax
  console = make_console()
  try:
    with leave_as_found(cfg) as cfg:  # a fresh run_dir when it is null; removed again if the run fails to start
      prepare_run_dir(cfg)  # a run_dir we cannot write fails here, in one line, before the banner
      console.print(f"[bold]meshlm train[/] {cfg.model_name}  shard_mode={cfg.shard_mode}  "
                    f"lm_head_kernel_order={cfg.lm_head_weight_grad_in_kernel_order}  "
                    f"dense_kernel_order={cfg.dense_weight_grad_in_kernel_order}  "
                    f"attention={attention_impl(cfg)}  {parts}"
                    f"trainable={trainable:,}  frozen={frozen:,}  data={_data_label(cfg)}  "
                    f"tokenizer={cfg.data.tokenizer}  run_dir={cfg.run_dir}")
      result = train(cfg, console=console, start_time=start)
      from meshlm.commands.train import carry_tokenizer
      carry_tokenizer(cfg)  # after the run, so a config the loop refuses leaves no file behind
  except KeyboardInterrupt:  # Ctrl-C before the loop took over the signal: nothing to save yet
    print("\nmeshlm: SIGINT before the first step; nothing was saved", file=sys.stderr)
    return 128 + signal.SIGINT
  code = report_stop(console, result, cfg.train.steps, cfg.run_dir)
  if code is not None:
    return code
  if not result.losses:
    console.print(f"nothing to do: {cfg.run_dir} is already at step {result.start_step} of {cfg.train.steps}")
    return 0
  first, last = result.losses[0], result.losses[-1]
  share = f" ({last / first:.0%} of the first step)" if first else ""  # 0: a first step that trained no token
  console.print(f"loss {first:.4f} -> {last:.4f}{share} in {len(result.losses)} steps; "
                f"first step finished {result.first_step_s:.1f} s after start")
  if result.sample is not None:
    t = cfg.train
    how = "greedy" if t.sample_temperature == 0 else f"temperature {t.sample_temperature:g}, seed {t.seed}"
    console.print(f"[bold]sample[/] ({how}):")
    print(printable(result.sample))  # a model's bytes may hold terminal escapes
  return 0


def cmd_eval(args: list[str], start: float) -> int:
  from meshlm.commands.eval import main as eval_main
  return eval_main(args, start)


def cmd_rl(args: list[str], start: float) -> int:
  from meshlm.commands.rl import main as rl_main
  return rl_main(args, start)


def cmd_presets(args: list[str], start: float) -> int:
  """Each preset with its family and parameter count (from the spec tree; nothing is allocated)."""
  from meshlm.config import load_config, preset_names
  from meshlm.models import count, param_specs
  rows = [(n, (c := load_config(f"model={n}")).model.family, f"{count(param_specs(c)):,}") for n in preset_names()]
  widths = [max(len(r[i]) for r in rows) for i in range(2)]
  for name, family, params in rows:
    print(f"{name.ljust(widths[0])}  {family.ljust(widths[1])}  {params} parameters")
  return 0


def cmd_convert(args: list[str], start: float) -> int:
  from meshlm.commands.convert import main as convert_main
  return convert_main(args)


def cmd_census(args: list[str], start: float) -> int:
  from meshlm.commands.census import cmd_census as run
  return run(args, start)


def cmd_compare(args: list[str], start: float) -> int:
  from meshlm.commands.census import cmd_compare as run
  return run(args, start)


def cmd_compile(args: list[str], start: float) -> int:
  from meshlm.commands.compile import main as compile_main
  return compile_main(args)


def cmd_bench(args: list[str], start: float) -> int:
  from meshlm.commands.bench import cmd_bench as run
  return run(args, start)


def cmd_generate(args: list[str], start: float) -> int:
  from meshlm.commands.generate import main as generate_main
  return generate_main(args)


COMMANDS = {"generate": cmd_generate, "train": cmd_train, "eval": cmd_eval, "rl": cmd_rl, "presets": cmd_presets, "convert": cmd_convert, "census": cmd_census,
            "compare": cmd_compare, "compile": cmd_compile, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
  start = time.perf_counter()
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] in (["-h"], ["--help"], ["help"]) and len(argv) > 1:
    argv = [argv[1], "--help"]  # meshlm help train
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE)
    return 0 if argv else 2
  cmd, args = argv[0], argv[1:]
  if cmd not in COMMANDS:
    return _fail(f"unknown command {cmd!r}; commands: {', '.join(COMMANDS)}")
  if "--help" in args or "-h" in args:
    print(command_help(cmd))
    return 0
  warnings.showwarning = _show_warning
  try:
    return COMMANDS[cmd](args, start)
  except (ConfigError, UsageError) as e:
    return _fail(str(e))
  except Exception as e:
    line = vmem_refusal(e)
    if line is None:
      raise
    return _fail(line)
  finally:
    warnings.showwarning = _python_showwarning


if __name__ == "__main__":
  sys.exit(main())
