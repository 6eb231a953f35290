"""`meshlm eval model=RUN_OR_DIR eval.path=GLOB [key=value ...]`: the validation loss of a model's parameters alone, no
training: the train setup (config, mesh, the train step's loss function, the validation set as a run reads it:
train/validation.py), then one evaluation. Writes nothing; prints one line (or JSON with --json)."""
from __future__ import annotations

import json
import types

from meshlm.errors import ConfigError

USAGE = "meshlm eval model=RUN_OR_DIR eval.path=GLOB [key=value ...] [--json]"
OPTIONS = """  --json  print {"val_loss", "val_ppl", "val_tokens", "val_rows", "eval_path", "params"} instead of the line
  The parameters are model=PATH's (checkpoint.load_params_from: a run's latest checkpoint, a step, a meshlm or a
  Hugging Face model directory); a preset without one is evaluated at its initialization (train.seed)."""


def main(args: list[str], start: float) -> int:
  from meshlm.commands.resolve import load_config
  from meshlm.parallel import set_cpu_devices
  as_json = "--json" in args
  cfg = load_config(*[a for a in args if a != "--json"])
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
    print(json.dumps({**out, "eval_path": cfg.eval.path, "params": where}))
  else:
    print(f"meshlm eval {cfg.model_name}: val_loss {out['val_loss']:.6f}  val_ppl {out['val_ppl']:.4f}  over "
          f"{validation.describe()}; parameters: {where}")
  return 0
