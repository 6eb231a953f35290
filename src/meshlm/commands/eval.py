"""`meshlm eval model=RUN_OR_DIR eval.path=GLOB [key=value ...]`: the validation loss of a model's parameters alone, no
training: the train setup (config, mesh, the train step's loss function, the validation set as a run reads it:
train/validation.py), then one evaluation. Writes nothing; prints one line (or JSON with --json).

A meshlm run (or model) directory is evaluated as it validated: its config.yaml's data rules and train.seq_len
(RUN_SETTINGS; the run's compute dtype too, as every model=PATH command: resolve.CARRIED), and with no eval.path
on the command line, its eval.path and eval.batches. key=value overrides win; the line names the run's settings
that differ from the defaults."""
from __future__ import annotations

import json
import types

from meshlm.errors import ConfigError

USAGE = "meshlm eval model=RUN_OR_DIR eval.path=GLOB [key=value ...] [--json]"
OPTIONS = """  --json  print {"val_loss", "val_ppl", "val_tokens", "val_rows", "eval_path", "params", "from_run"}
          instead of the line
  The parameters are model=PATH's (checkpoint.load_params_from: a run's latest checkpoint, a step, a meshlm or a
  Hugging Face model directory); a preset without one is evaluated at its initialization (train.seed).
  A meshlm run is evaluated as it validated: its data.* rules and train.seq_len (and without eval.path, its
  eval.path and eval.batches) from its config.yaml, unless the command line gives them."""

# What a meshlm run's config.yaml gives `meshlm eval model=RUN` besides the model: the rules its rows were read,
# masked and cut by (data.path, source and seed are training's file and order, not the validation set's).
RUN_SETTINGS = tuple(f"data.{f}" for f in ("field", "tokenizer", "format", "chat_template", "completion_only",
                                           "assistant_only", "truncation")) + ("train.seq_len",)
RUN_VALIDATION = ("eval.path", "eval.batches")  # also the run's validation set, when the command line names none


def main(args: list[str], start: float) -> int:
  from meshlm.commands.resolve import load_config
  from meshlm.parallel import set_cpu_devices
  from meshlm.config import parse_overrides
  as_json = "--json" in args
  overrides = [a for a in args if a != "--json"]
  given = {k for k, _ in parse_overrides(overrides)}
  carry = RUN_SETTINGS + (() if "eval.path" in given else RUN_VALIDATION)
  cfg = load_config(*overrides, carry=carry)
  from_run = {k: _get(cfg, k) for k in carry if k not in given and _get(cfg, k) != _default(cfg, k)} \
      if _is_meshlm_dir(cfg.checkpoint.load_params_from) else {}
  if cfg.eval.path is None:
    raise ConfigError("eval: eval.path is null; give the validation files: eval.path=GLOB (.jsonl, .parquet, .txt)")
  set_cpu_devices(cfg.cpu_devices)
  from meshlm.parallel.distributed import init_distributed
  init_distributed(cfg)
  import jax
  from meshlm.parallel.mesh import make_mesh
  from meshlm.train.step import build_train_step
  from meshlm.train.validation import Validation
  mesh = make_mesh(cfg)
  step_fn = build_train_step(cfg, mesh)
  validation = Validation(cfg, step_fn)  # the file is read (and refused) before any parameter is
  where = cfg.checkpoint.load_params_from
  if where:
    from meshlm.models.params import merge_state, split_state
    from meshlm.train.checkpoint import load_params
    abstract, sh = step_fn.abstract_state(), step_fn.state_shardings()
    tree = load_params(cfg, where, merge_state(abstract.params, abstract.model_state),
                       merge_state(sh.params, sh.model_state), mesh)
    params, model_state = split_state(cfg, tree)
    state = types.SimpleNamespace(params=params, model_state=model_state)
  else:
    where = f"a fresh initialization (train.seed={cfg.train.seed})"
    state = step_fn.init_state(jax.random.key(cfg.train.seed))
  out = validation(state)
  if jax.process_index() != 0:
    return 0
  if as_json:
    print(json.dumps({**out, "eval_path": cfg.eval.path, "params": where, "from_run": from_run}))
  else:
    run = ("; as the run validated (its config.yaml; key=value overrides win): " +
           ", ".join(f"{k}={_spelled(v)}" for k, v in from_run.items())) if from_run else ""
    print(f"meshlm eval {cfg.model_name}: val_loss {out['val_loss']:.6f}  val_ppl {out['val_ppl']:.4f}  over "
          f"{validation.describe()}; parameters: {where}{run}")
  return 0


def _spelled(v) -> str:
  """A value as the command line spells it (true, null)."""
  return json.dumps(v) if v is None or isinstance(v, bool) else str(v)


def _is_meshlm_dir(path: str | None) -> bool:
  """model=PATH named a meshlm run, step or model directory (not a Hugging Face one, not a preset)."""
  import os
  return path is not None and not os.path.isfile(os.path.join(path, "config.json"))


def _get(cfg, dotted: str):
  section, _, field = dotted.partition(".")
  return getattr(getattr(cfg, section), field)


def _default(cfg, dotted: str):
  section, _, field = dotted.partition(".")
  return type(getattr(cfg, section)).model_fields[field].get_default(call_default_factory=True)
