"""`meshlm convert`: Hugging Face <-> meshlm model directories.

  meshlm convert hf-to-meshlm SRC DST [key=value ...]
  meshlm convert meshlm-to-hf SRC DST [key=value ...]

A meshlm model directory is what `checkpoint.load_params_from=DIR` reads (train/checkpoint.py):

  DIR/params/        the parameter pytree, an Orbax StandardSave (sharded arrays, restored onto any mesh)
  DIR/meta/metadata  JSON {"model_name", "model"}: lets load_params_from refuse another model's weights
  DIR/config.yaml    the resolved meshlm Config (the same YAML a run_dir holds)
  DIR/tokenizer.json (and the other TOKENIZER_FILES) when the HF directory has them

The model config carries the HF token ids and generation_config.json (model.bos_token_id, ...), so an
export writes them again.

so `meshlm train model=DIR` starts from converted weights (as from an HF directory), and
`meshlm convert meshlm-to-hf` also takes a run's step directory (`run_dir/checkpoints/<step>`, whose
model comes from its meta, plus key=value overrides for the rest, and its tokenizer files from the run
directory). Both directions write into a
temporary sibling and rename, so a failed conversion leaves nothing at DST.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from meshlm.commands.resolve import load_config
from meshlm.config import Config
from meshlm.errors import ConfigError


# A model's tokenizer, copied along by both directions so that model=DIR finds it and the export has it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def tokenizer_files(src: Path) -> list[Path]:
  """The tokenizer files of src; for a run's step directory (RUN/checkpoints/<step>, which holds none), the run's."""
  src = Path(src)
  found = [src / name for name in TOKENIZER_FILES if (src / name).is_file()]
  if not found and src.absolute().parent.name == "checkpoints":
    return tokenizer_files(src.absolute().parent.parent)
  return found


def save_meshlm(cfg: Config, params: dict, path: str | os.PathLike, *, overwrite: bool = False,
                files: list[Path] = ()) -> Path:
  """A meshlm model directory (layout: meshlm.train.checkpoint), written atomically."""
  from meshlm.train.checkpoint import save_model_dir
  return Path(save_model_dir(cfg, params, str(path), overwrite=overwrite, files=files))


def load_meshlm(path: str | os.PathLike, *overrides: str, mesh=None) -> tuple[Config, dict]:
  """Reads a meshlm model directory (or a run's checkpoint step dir): each array restored straight
  onto its sharding; the whole model tree, the model state (a routing bias) with the parameters."""
  import jax
  from meshlm.models.params import model_shardings, model_specs
  from meshlm import spec as S
  from meshlm.parallel.mesh import make_mesh
  from meshlm.train.checkpoint import restore_params, saved_model
  from meshlm.train.checkpoint import _find_step_dir
  given = Path(path).absolute()
  try:
    path = Path(_find_step_dir(str(given), str(given)))  # a model or step dir itself, or a run's newest step
  except ConfigError:
    raise ConfigError(f"{given}: not a meshlm model directory (no params/) nor a run directory (no "
                      "checkpoints/<step>/params)") from None
  base = saved_model(str(path), str(path))
  if base is None:
    raise ConfigError(f"{path}: has params/ but neither config.yaml nor meta/metadata to say which model")
  record = next((d / "config.yaml" for d in (path, given) if (d / "config.yaml").is_file()), None)
  if record is not None:
    base = yaml.safe_load(record.read_text()) or base  # the whole record, not only the model
  cfg = load_config(*overrides, base=base)
  if mesh is None:
    from meshlm.parallel import set_cpu_devices
    set_cpu_devices(cfg.cpu_devices)  # the run's own fake devices (cpu_devices=4 on a CPU), unless overridden
    mesh = make_mesh(cfg)
  dtype = cfg.train.param_dtype
  # The whole model tree: the model-state leaves (a routing bias) are in the checkpoint beside the parameters.
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                          model_specs(cfg), model_shardings(cfg, mesh), is_leaf=S.is_spec)
  return cfg, restore_params(cfg, str(path), abstract, str(path / "params"))


def _split(args: list[str]) -> tuple[list[str], list[str]]:
  paths = [a for a in args if "=" not in a]
  overrides = [a for a in args if "=" in a]
  return paths, overrides


def _set_devices(overrides: list[str]) -> None:
  from meshlm.config import parse_overrides
  from meshlm.parallel import set_cpu_devices
  for key, value in parse_overrides(overrides):
    if key == "cpu_devices":
      set_cpu_devices(int(value))


USAGE = ("meshlm convert hf-to-meshlm SRC DST [key=value ...] | meshlm convert meshlm-to-hf SRC DST "
         "[key=value ...]")

OPTIONS = """  hf-to-meshlm SRC DST  a Hugging Face directory (config.json, *.safetensors) to a meshlm model directory
  meshlm-to-hf SRC DST  a meshlm model, run (its newest checkpoint) or step directory to a Hugging Face directory
  DST must not exist; the tokenizer files are copied along. key=value pairs: cpu_devices, mesh.*"""


def main(args: list[str]) -> int:
  """The CLI entry point; ConfigErrors become exit code 2 in meshlm.cli."""
  if not args or args[0] not in ("hf-to-meshlm", "meshlm-to-hf"):
    raise ConfigError(f"convert: expected a direction; usage: {USAGE}")
  direction, rest = args[0], args[1:]
  paths, overrides = _split(rest)
  if len(paths) != 2:
    raise ConfigError(f"convert {direction}: expected SRC and DST, got {len(paths)} paths; usage: {USAGE}")
  src, dst = Path(paths[0]), Path(paths[1])
  if not src.is_dir():
    raise ConfigError(f"convert {direction}: SRC {src} is not a directory")
  if dst.exists():
    raise ConfigError(f"convert {direction}: DST {dst} already exists; choose a new directory")
  _set_devices(overrides)
  from meshlm import hf
  if direction == "hf-to-meshlm":
    cfg, params = hf.load(src, *overrides)
    save_meshlm(cfg, params, dst, files=tokenizer_files(src))
  else:
    cfg, params = load_meshlm(src, *overrides)
    hf.save(cfg, params, dst, files=tokenizer_files(src))
  from meshlm.models import count, param_specs
  print(f"meshlm convert {direction}: {src} -> {dst} ({cfg.model.family}, "
        f"{count(param_specs(cfg)):,} parameters)")
  return 0
