"""The `meshlm` command as a user runs it: a tiny end-to-end train, and one-line errors (exit 2)."""
import io
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import yaml
from pydantic import BaseModel

from meshlm.cli import main
from meshlm.config import Config

MESHLM = os.path.join(os.path.dirname(sys.executable), "meshlm")
KO_LM = "lm_head_weight_grad_in_kernel_order"

# (overrides, what the one-line error must start with)
ERRORS = {
    "unknown_key": (["train.stepz=3"], "train.stepz: unknown key; did you mean train.steps?"),
    "bad_value": (["train.steps=-2"], "train.steps: Input should be greater than 0"),
    "mesh_does_not_divide": (["cpu_devices=4", "mesh.fsdp=3"], "mesh: mesh.fsdp=3 needs 3 devices but 4"),
    "tied_head_flag": (["model.tie_embeddings=true", f"{KO_LM}=true"], f"{KO_LM}=true needs an untied LM head"),
    "unknown_preset": (["model=llama5-tiny"], "model=llama5-tiny: unknown preset"),
    # Gated DeltaNet hybrids (issue 20).
    "gdn_value_heads": (["model=qwen3.5-tiny", "model.parts.gdn.value_heads=3"],
                        "model.parts.gdn.value_heads: 3 must be a multiple of key_heads=2"),
    "gdn_chunk": (["model=qwen3.5-tiny", "model.parts.gdn.chunk_size=48"],
                  "model.parts.gdn.chunk_size: 48 must be a power of two"),
    "gdn_context": (["model=qwen3.5-tiny", "cpu_devices=2", "mesh.fsdp=1", "mesh.context=2", "train.seq_len=96"],
                    "mesh.context=2: train.seq_len=96 does not split into 2 shards whose lengths are multiples of 64"),
    "gdn_kind": (["model=qwen3.5-tiny", "model.hybrid_layer_types=[linear_attention,mamba,linear_attention,"
                  "full_attention]"], "model.hybrid_layer_types[1]='mamba': unknown layer type"),
}


# The cases run as `meshlm train` processes: one per stage that refuses (the override parser, a field's
# validation, the device count, the preset lookup, a part's check against the mesh). Every case, these and the model
# checks (tied_head_flag, gdn_value_heads, gdn_chunk, gdn_kind), goes through main() in this process below, which
# is what the console script calls: the same exit code and line. A process is about 1 s of CPU (it imports JAX).
IN_A_PROCESS = ("unknown_key", "bad_value", "mesh_does_not_divide", "unknown_preset", "gdn_context")


def _env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory):
  """Each IN_A_PROCESS case as its own `meshlm train` process, started together."""
  cwd = tmp_path_factory.mktemp("cli_errors")
  procs = {name: subprocess.Popen([MESHLM, "train", *ERRORS[name][0]], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
           for name in IN_A_PROCESS}
  out = {name: (p.wait(timeout=600),) + p.communicate() for name, p in procs.items()}
  out["cwd"] = cwd
  return out


@pytest.mark.parametrize("name", IN_A_PROCESS)
def test_config_errors_exit_2_with_one_line(error_runs, name):
  rc, stdout, stderr = error_runs[name]
  expected = ERRORS[name][1]
  assert rc == 2, (rc, stderr)
  assert "Traceback" not in stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr
  assert lines[0].startswith(f"meshlm: error: {expected}"), lines[0]
  assert stdout == ""


def test_config_errors_fail_before_any_run_dir_is_made(error_runs):
  assert os.listdir(error_runs["cwd"]) == []


@pytest.mark.parametrize("name", list(ERRORS))
def test_config_errors_in_process(capsys, name):
  """main() itself returns 2 and prints the same line (what the subprocess shows)."""
  args, expected = ERRORS[name]
  assert main(["train", *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"meshlm: error: {expected}") and err.count("\n") == 1


def test_usage_and_unknown_command(capsys):
  assert main([]) == 2
  assert "usage: meshlm" in capsys.readouterr().out
  assert main(["--help"]) == 0
  assert main(["trian"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("meshlm: error: unknown command 'trian'") and err.count("\n") == 1


def test_presets_command(capsys):
  """Rough edge 13: each preset with its family and parameter count, one line each."""
  from meshlm.config import load_config, preset_names
  from meshlm.models import count, param_specs
  assert main(["presets"]) == 0
  rows = {ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines()}
  assert set(rows) == set(preset_names()) and {"llama2-tiny", "llama2-7b", "llama3-8b"} <= set(rows)
  assert rows["qwen3-moe-tiny"] == ["qwen3_moe", f"{count(param_specs(load_config('model=qwen3-moe-tiny'))):,}",
                                    "parameters"]
  assert rows["llama2-7b"][:2] == ["llama", "6,738,415,616"]


# --- --help: usage and every config key, from the schema ---------------------------------------

def schema_leaves(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, object]:
  """dotted key -> its pydantic field, for every settable key (walked here, not by the code under test)."""
  out = {}
  for name, field in model.model_fields.items():
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
      out.update(schema_leaves(field.annotation, f"{prefix}{name}."))
    else:
      out[prefix + name] = field
  return out


def part_leaves() -> dict[str, object]:
  """model.parts.<part>.<knob> -> its field, over the registered parts' own config sections."""
  import importlib
  from meshlm.models import registry
  out = {}
  for name, where in registry.PARTS.items():
    module, factory = where.split(":")
    config = getattr(importlib.import_module(module), factory)().config
    if config is not None:
      out.update(schema_leaves(config, f"model.parts.{name}."))
  return out


# The keys each command's --help lists, as sets of the schema's leaves (worked out here, not by the code under test).
def _under(*prefixes):
  return lambda k: any(k == p or (p.endswith(".") and k.startswith(p)) for p in prefixes)


# What each command reads: train everything but rl.*; rl no data files nor the shapes it derives from its prompts;
# the compile-only commands no loop keys (data, logging, sampling, stopping, saving), and compile only the rl.* keys
# of the programs it compiles. Every command but train points at train's --help for model.* instead of listing it.
LOOP = ("run_dir", "checkpoint.", "data.", "eval.", "train.log_every", "train.sample_tokens", "train.sample_temperature",
        "train.on_nonfinite", "train.max_nonfinite_in_a_row", "train.stop_after")
RL_PROGRAM = ("rl.prompts_per_step", "rl.num_generations", "rl.max_new_tokens", "rl.temperature", "rl.top_k", "rl.top_p",
              "rl.policy_loss", "rl.epsilon", "rl.epsilon_high", "rl.delta", "rl.cispo_cap", "rl.ratio_level",
              "rl.loss_agg", "rl.top_entropy_quantile", "rl.beta", "rl.kl_estimator", "rl.num_iterations",
              "rl.score_truncated", "rl.sampler_is", "rl.sampler_is_cap", "rl.sampler_is_min", "rl.router_replay")
_no_model = lambda k: not k.startswith("model.")  # noqa: E731
HELP_SCOPE = {
    "train": lambda k: not k.startswith("rl."),
    "rl": lambda k: _no_model(k) and not _under("data.source", "data.path", "data.field", "train.seq_len",
                                                "train.per_device_batch_size", "train.sample_tokens",
                                                "train.sample_temperature")(k),
    # eval: the step's shapes, the parameters to load and the data.* rules of the validation set; no optimizer, loop
    # or run directory key.
    "eval": lambda k: _no_model(k) and not _under(
        "rl.", "run_dir", "checkpoint.every", "checkpoint.keep", "checkpoint.dir", "data.source", "data.path",
        "data.seed", "eval.every", "train.learning_rate", "train.warmup_steps", "train.min_lr_ratio",
        "train.weight_decay", "train.b1", "train.b2", "train.grad_clip", "train.steps", "train.micro_batches",
        "train.log_every", "train.sample_tokens", "train.sample_temperature", "train.on_nonfinite",
        "train.max_nonfinite_in_a_row", "train.stop_after", "train.freeze")(k),
    "census": lambda k: _no_model(k) and not _under("rl.", *LOOP)(k),
    "compare": lambda k: _no_model(k) and not _under("rl.", *LOOP)(k),
    "bench": lambda k: _no_model(k) and not _under("rl.", *LOOP)(k),
    "compile": lambda k: _no_model(k) and not _under("rl.", *LOOP, "cpu_devices", "distributed.")(k) or k in RL_PROGRAM,
    "generate": _under("cpu_devices", "mesh.", "shard_mode", "data.tokenizer", "distributed."),
    "convert": _under("cpu_devices", "mesh.", "distributed."),
}


@pytest.mark.parametrize("command", list(HELP_SCOPE))
def test_help_lists_the_keys_the_command_takes(capsys, command):
  assert main([command, "--help"]) == 0
  out, err = capsys.readouterr()
  assert err == ""
  assert out.startswith(f"usage: meshlm {command}")
  keys = out[out.index("config keys:"):]
  rows = {line.split()[0]: line for line in keys.splitlines() if line.startswith("  ") and line.split()}
  rows.pop("key")
  if command not in ("train", "generate", "convert"):  # the model.* pointer (two lines), not a key row
    assert rows.pop("model.*") and rows.pop("(model.num_layers=2,")
  leaves = {**schema_leaves(), **part_leaves()}
  assert len(leaves) > 60 and "model.parts.mla.absorb" in leaves
  want = {k for k in leaves if HELP_SCOPE[command](k)}
  assert set(rows) == want, (sorted(set(rows) - want), sorted(want - set(rows)))
  for key in want:
    field = leaves[key]
    assert field.description, f"{key}: give it Field(description=...), the meaning --help shows"
    assert " ".join(field.description.split()) in rows[key]
  assert main([command, "-h", "model=llama2-tiny"]) == 0 and capsys.readouterr().out == out


def test_help_lists_what_the_command_reads_and_points_at_the_rest():
  """Item 8: every command's --help ended in the same ~140-key table (compile --help: 166 lines). Now each lists what
  it reads, model.* in one line pointing at train's --help, the rest at docs/config.md: compile --help is under 110
  lines (89 before issues 60-62's 17 keys that change the program: sa_block_* x 8, flash_block, rope_swap,
  layer_cast, scatter_leading, remat_attention, gdn_impl, loss_grad_reduce, decode_attention_impl and _block; one row each), and
  train, rl, census and compile list different keys (census, compare and bench read the same ones)."""
  from meshlm.cli import command_help
  tables = {}
  for cmd in ("train", "rl", "census", "bench", "compile"):
    text = command_help(cmd)
    tables[cmd] = text[text.index("config keys:"):]
    assert text.rstrip().endswith("every key: docs/config.md."), cmd
    assert ("model.*  the model's fields" in text) == (cmd != "train"), cmd
  assert len(command_help("compile").splitlines()) < 110 < len(command_help("train").splitlines())
  assert len(set(tables.values())) == 4 and tables["census"] == tables["bench"]


def test_every_key_has_a_help_line_somewhere():
  leaves = schema_leaves()
  assert set(leaves) == {k for k in leaves if any(scope(k) for scope in HELP_SCOPE.values())}
  assert all(leaves[k].description for k in leaves)


@pytest.mark.parametrize("command, own", [
    ("generate", ["prompt=TEXT", "max_new_tokens=N", "temperature=T", "stop=ID,ID"]),
    ("bench", ["--timer wall|cpu", "--reps N", "--warmup N", "--arm NAME"]),
    ("census", ["--json"]), ("compare", ["--arm NAME", "--json"]), ("convert", ["hf-to-meshlm SRC DST"]),
    ("compile", ["topology=NAME", "hbm_gib=X", "--program P[,P]", "--fit[=batch]", "--fit=remat", "--json"]),
])
def test_each_command_help_leads_with_its_own_options(command, own):
  """Rough edge 10: every command's --help printed the training key table first; train has no options block."""
  from meshlm.cli import command_help
  text = command_help(command)
  head = text[:text.index("config keys:")]
  assert "options:" in head, head
  options = head[head.index("options:"):]
  for opt in own:
    assert f"\n  {opt}" in options, (command, opt, options)
  assert "options:" not in command_help("train")


def test_help_shows_types_and_defaults():
  from meshlm.cli import command_help
  rows = {line.split()[0]: line.split()[1:3] for line in command_help("train").splitlines()
          if line.startswith("  ") and line.split()}
  assert rows["train.steps"] == ["int", "200"]
  assert rows["shard_mode"] == ["auto|explicit", "explicit"]
  assert rows["train.stop_after"] == ["int|null", "null"]
  assert rows["model.embed_dim"] == ["int", "(preset)"]
  assert rows["scan_layers"] == ["bool", "true"]
  assert rows["model.layer_pattern"] == ["list[global|local]|null", "null"]


def test_help_is_also_a_command(capsys):
  assert main(["help", "census"]) == 0
  assert capsys.readouterr().out.startswith("usage: meshlm census")
  assert main(["presets", "--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: meshlm presets\n") and "model family and its parameter count" in out


# --- output to a file or pipe never wraps; the sample is escaped --------------------------------

def test_console_to_a_file_never_wraps(monkeypatch):
  from rich.console import Console

  from meshlm.console import make_console
  msg = "resuming from checkpoint /a/long/path/" + "x" * 80 + "/checkpoints/5 (step 5 of 20)"
  for width in ("40", "300"):
    monkeypatch.setenv("COLUMNS", width)
    buf = io.StringIO()
    make_console(file=buf).print(msg)
    assert buf.getvalue() == msg + "\n"
  # Negative control: rich's plain Console wraps the same line at COLUMNS.
  monkeypatch.setenv("COLUMNS", "40")
  buf = io.StringIO()
  Console(file=buf).print(msg)
  assert buf.getvalue().count("\n") > 1


def test_printable_escapes_control_characters_and_keeps_newlines_and_tabs():
  from meshlm.console import printable
  assert printable("def f():\n\treturn 1") == "def f():\n\treturn 1"
  assert printable("a\x1b[2Jb\rc\x07\x00\u200b\x85é\ufffd") == "a\\x1b[2Jb\\rc\\x07\\x00\\u200b\\x85é\ufffd"


@pytest.fixture
def fake_train(monkeypatch, tmp_path):
  """cmd_train up to train(), which returns a made-up result: the CLI's own printing, in-process."""
  from meshlm.train import loop
  calls = []

  def train(cfg, *, console=None, start_time=None, **kw):
    calls.append(cfg)
    if hooks:
      hooks.pop()(cfg)
    return loop.TrainResult(losses=[6.2, 3.1], grad_norms=[1.0, 1.0], state=None, sample="def \x1b[31mred\x07\n\tok",
                            first_step_s=1.5)
  hooks: list = []
  monkeypatch.setattr(loop, "train", train)
  run_dir = tmp_path / ("a-run-dir-long-enough-to-wrap-" + "x" * 60)
  return run_dir, hooks


def test_train_messages_stay_on_one_line_at_any_columns(monkeypatch, capsys, fake_train):
  run_dir, _ = fake_train
  for width in ("40", "300"):
    monkeypatch.setenv("COLUMNS", width)
    assert main(["train", "cpu_devices=2", f"run_dir={run_dir}"]) == 0
    err = capsys.readouterr().err.splitlines()
    banner = [ln for ln in err if ln.startswith("meshlm train llama2-tiny")]
    assert len(banner) == 1 and banner[0].endswith(f"data=stdlib  tokenizer=byte  run_dir={run_dir}"), err
    assert any(ln.startswith("loss 6.2000 -> 3.1000 (50% of the first step) in 2 steps; first step finished 1.5 s")
               for ln in err), err


def test_train_escapes_the_sample(capsys, fake_train):
  run_dir, _ = fake_train
  assert main(["train", "cpu_devices=2", f"run_dir={run_dir}"]) == 0
  out = capsys.readouterr().out
  assert out == "def \\x1b[31mred\\x07\n\tok\n"
  assert "\x1b" not in out and "\x07" not in out


def test_meshlm_warnings_print_as_one_line(capsys, fake_train):
  """A sharding warning raised during a command reaches the user as one `meshlm: warning:` line."""
  from meshlm.parallel import sharding
  from meshlm.parallel.mesh import make_mesh
  run_dir, hooks = fake_train
  sharding._warned.clear()
  hooks.append(lambda cfg: sharding.logical_spec(("embed", "heads"), (256, 8), make_mesh(cfg)))
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    assert main(["train", "cpu_devices=6", "mesh.fsdp=2", "mesh.tensor=3", f"run_dir={run_dir}"]) == 0
  err = capsys.readouterr().err
  assert ("meshlm: warning: mesh.tensor=3 does not divide the heads dimension (size 8): it stays whole" in err), err
  assert "ShardingWarning" not in err and "warnings.warn" not in err
  sharding._warned.clear()


STEPS = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """`meshlm train` on the default data (the stdlib corpus) for a few steps, with a short sample."""
  run_dir = tmp_path_factory.mktemp("cli_run") / "run"
  args = [MESHLM, "train", "model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", f"train.steps={STEPS}",
          "train.seq_len=32", "train.per_device_batch_size=1", "train.sample_tokens=8", f"run_dir={run_dir}"]
  # A narrow COLUMNS: nothing written to the pipe may wrap at it.
  proc = subprocess.run(args, env=dict(_env(), COLUMNS="40"), capture_output=True, text=True, timeout=300)
  return proc, run_dir


def test_train_exits_0(tiny_run):
  proc, _ = tiny_run
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr


def test_train_writes_metrics(tiny_run):
  _, run_dir = tiny_run
  with open(run_dir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the updates done, as the console counts
  for r in records:
    assert {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm"} <= set(r)
    assert r["loss"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
  # ln(512) = 6.24 at init, plus what the initial logits' spread adds; the stdlib corpus is the running
  # Python's (6.74 on 3.11's, 6.91 on 3.12's).
  assert records[0]["loss"] == pytest.approx(6.24, abs=1.0)


def test_train_saves_the_resolved_config(tiny_run):
  _, run_dir = tiny_run
  saved = yaml.safe_load((run_dir / "config.yaml").read_text())
  assert saved["model_name"] == "llama2-tiny" and saved["shard_mode"] == "explicit"
  assert saved[KO_LM] is True and saved["dense_weight_grad_in_kernel_order"] is True
  assert saved["train"]["steps"] == STEPS and saved["cpu_devices"] == 4 and saved["mesh"]["fsdp"] == 4
  assert saved["data"]["source"] == "stdlib"
  # The keys that change the compiled program (issue 61 item 3) are recorded as given (their auto resolves per
  # platform where the program is built; the census and meshlm compile print them resolved).
  program = {"flash_block": 512, "rope_swap": "auto", "layer_cast": "bits", "remat_attention": "recompute",
             "scatter_leading": "auto", "splash_backward": "auto"}
  program |= {k: "auto" for k in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                                  "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")}
  assert {k: saved.get(k) for k in program} == program


def test_convert_takes_a_run_trained_on_fake_devices_as_it_is(tiny_run, tmp_path):
  """`meshlm convert meshlm-to-hf RUN DST` in a fresh process, with no key=value: the run's recorded cpu_devices=4
  and fsdp=4 are its own (a new process has one CPU device until it asks for more; the command failed here
  with "cpu_devices=4: only 1 devices exist")."""
  _, run_dir = tiny_run
  dst = tmp_path / "hf"
  proc = subprocess.run([MESHLM, "convert", "meshlm-to-hf", str(run_dir), str(dst)], env=_env(), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"-> {dst} (llama," in proc.stdout
  assert (dst / "model.safetensors").is_file() and (dst / "config.json").is_file()


def test_train_prints_progress_and_a_sample(tiny_run):
  proc, _ = tiny_run
  _, run_dir = tiny_run
  lines = proc.stderr.splitlines()
  # Each message on one line although COLUMNS=40 (the run_dir alone is longer).
  assert any(ln.startswith("meshlm train llama2-tiny  shard_mode=explicit") and ln.endswith(f"run_dir={run_dir}")
             for ln in lines), proc.stderr
  assert any(ln.startswith("loss ") and ln.endswith("s after start") for ln in lines), proc.stderr
  assert any("  tokenizer=byte  run_dir=" in ln for ln in lines), proc.stderr  # the header names the tokenizer
  # Not a terminal: a plain progress line per logged step (train.log_every=1), not one bar drawn at the end.
  steps = [ln for ln in lines if ln.startswith("step ")]
  assert [ln.split()[1] for ln in steps] == [f"{i}/{STEPS}" for i in range(1, STEPS + 1)], proc.stderr
  assert all(" loss " in ln and " tok/s " in ln and ln.endswith(" s/step") for ln in steps), steps
  assert "sample" in proc.stderr
  # The sample goes to stdout: the prompt and then the generated bytes (8 byte tokens: at most 8
  # characters, each non-printable one escaped in at most 6 characters such as \u200b).
  sample = proc.stdout.rstrip("\n")
  assert sample.startswith("def ")
  assert len(sample) <= len("def ") + 8 * 6
  assert all(ch.isprintable() or ch in "\n\t" for ch in sample)


# --- the run directory: fresh by default, left as found when the run fails to start -------------

RUN_NAME = r"llama2-tiny-\d{8}-\d{6}(-\d+)?"


def test_runs_without_run_dir_each_get_a_fresh_directory(monkeypatch, capsys, fake_train, tmp_path):
  """Before, both went to runs/default, where the second resumed the first's checkpoint."""
  import re
  monkeypatch.chdir(tmp_path)
  dirs = []
  for _ in range(2):
    assert main(["train", "cpu_devices=2"]) == 0
    banner = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("meshlm train")]
    dirs.append(banner[0].rsplit("run_dir=", 1)[1])
  assert dirs[0] != dirs[1], dirs
  for d in dirs:
    assert re.fullmatch(f"runs/{RUN_NAME}", d), d
  assert sorted(os.listdir(tmp_path / "runs")) == sorted(os.path.basename(d) for d in dirs)


def test_fresh_run_dirs_are_unique_within_one_second(tmp_path):
  import datetime

  from meshlm.train.run_dir import fresh_run_dir
  now = datetime.datetime(2026, 1, 2, 3, 4, 5)
  got = [fresh_run_dir(name, str(tmp_path), now) for name in ("llama2-tiny", "llama2-tiny", "/some/hf/Llama 3")]
  assert [os.path.basename(p) for p in got] == ["llama2-tiny-20260102-030405", "llama2-tiny-20260102-030405-2",
                                                "Llama-3-20260102-030405"]
  assert all(os.path.isdir(p) for p in got)


def test_an_error_after_the_header_leaves_no_directory(monkeypatch, capsys, tmp_path):
  """A bad data.path is found in train(), after the header line; before, run_dir/checkpoints stayed."""
  monkeypatch.chdir(tmp_path)
  bad = ["cpu_devices=2", "data.source=text", f"data.path={tmp_path}/nowhere/*.txt"]
  for extra in ([f"run_dir={tmp_path}/a/run"], []):  # a given run_dir (and its parent), and a fresh one
    assert main(["train", *bad, *extra]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("meshlm train llama2-tiny"), err  # the header came first
    assert err.splitlines()[-1].startswith("meshlm: error: data.path="), err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


# --- train.freeze: the counts in the header; nothing to train is refused -------------------------

def test_header_reports_trainable_and_frozen_parameter_counts(capsys, fake_train):
  from meshlm.config import load_config
  from meshlm.models.params import param_specs
  from meshlm import spec as S
  run_dir, _ = fake_train
  total = S.count(param_specs(load_config("model=llama2-tiny")))
  frozen = 512 * 256  # llama2-tiny's embedding table, [vocab, embed]
  assert main(["train", "cpu_devices=2", "train.freeze=[embed]", f"run_dir={run_dir}"]) == 0
  banner = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("meshlm train")][0]
  assert f"  trainable={total - frozen:,}  frozen={frozen:,}  " in banner, banner
  assert main(["train", "cpu_devices=2", f"run_dir={run_dir}"]) == 0
  assert f"  trainable={total:,}  frozen=0  " in capsys.readouterr().err


def test_header_names_the_attention_core(capsys, fake_train):
  """The banner says which attention core the step runs: attention_impl resolved (auto on CPU at llama2-tiny's
  length: xla)."""
  run_dir, _ = fake_train
  for extra, core in (((), "xla"), (("attention_impl=flash",), "flash")):
    assert main(["train", "cpu_devices=2", *extra, f"run_dir={run_dir}"]) == 0
    banner = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("meshlm train")][0]
    assert f"  attention={core}  " in banner, banner


def test_freezing_everything_is_refused(capsys, tmp_path):
  """Before, the run trained for its steps with nothing trainable and no word."""
  assert main(["train", "cpu_devices=2", "train.freeze=['.*']", f"run_dir={tmp_path}/run"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert err.startswith("meshlm: error: train.freeze=['.*']: freezes all "), err
  assert "parameters (" in err and "so nothing would train; narrow the patterns (paths look like embed, " in err
  assert not os.path.exists(tmp_path / "run")


# --- signals: saved, then a non-zero exit ---------------------------------------------------------

SIGNAL_RUN = ["model.embed_dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32",
              "model.mlp_dim=128", "model.num_layers=1", "train.per_device_batch_size=1", "train.seq_len=16",
              "train.sample_tokens=0", "cpu_devices=2", "mesh.fsdp=2", "data.source=synthetic",
              "train.compute_dtype=float32", "train.steps=100000"]


@pytest.fixture(scope="module")
def signal_env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax-cache")
  return dict(_env(), JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              PYTHONUNBUFFERED="1")


# SIGINT (Ctrl-C). SIGTERM's save, exit code 128 + 15 and resume are tests/test_checkpoint.py's
# test_sigterm_finishes_the_step_saves_and_resumes_exactly (the same handler; the line here names the signal).
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=["SIGINT"])
def test_a_signal_saves_then_exits_128_plus_the_signal(tmp_path, signal_env, sig):
  """`meshlm train ... && meshlm convert ...` must not convert a run a Ctrl-C cut short; before, exit 0.
  The signal is sent once metrics.jsonl has a step, i.e. the loop (and its handler) is running."""
  import time
  run_dir = tmp_path / "run"
  p = subprocess.Popen([MESHLM, "train", *SIGNAL_RUN, f"run_dir={run_dir}"], env=signal_env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300  # a hang guard only: the wait ends when the file has a line
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
      assert p.poll() is None, p.communicate()[1][-3000:]
      assert time.monotonic() < deadline, "no step within 300 s"
      time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
  finally:
    p.kill()
  name = signal.Signals(sig).name
  assert p.returncode == 128 + sig, err[-3000:]
  saved = [n for n in os.listdir(run_dir / "checkpoints") if n.isdigit()]
  assert len(saved) == 1, saved
  assert (f"stopped (preempted) after step {saved[0]} of 100000; checkpoint {run_dir}/checkpoints/{saved[0]}; "
          f"exit code {128 + sig} ({name}); to continue, run the same command with run_dir={run_dir}") in err, err
