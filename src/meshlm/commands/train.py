"""What `meshlm train` adds around train.loop.train: the run directory carries its tokenizer (tokenizer.json and the
files beside it that say how to read it: tokenizer_config.json with its special tokens, special_tokens_map.json, ...)
and chat template, copied once the loop returns, whatever its stop reason, so that a config the loop refuses leaves
nothing behind; and on TPU, before anything compiles, the refusal of a layout that cannot fit the device's memory
(refuse_unfit_layout: analysis/layout.py's lower bound)."""
from __future__ import annotations

import os
from pathlib import Path

from meshlm.config import Config


def tokenizer_file(cfg: Config) -> Path | None:
  """The tokenizer.json data.tokenizer names (the file, or the one in the directory it names); None for byte."""
  t = cfg.data.tokenizer
  if t == "byte":
    return None
  p = Path(t)
  p = p / "tokenizer.json" if p.is_dir() else p
  return p if p.is_file() else None


def carry_tokenizer(cfg: Config) -> None:
  """Copies the run's tokenizer into run_dir, so that model=RUN_DIR (generate, a fine-tune, rl, convert) reads text
  as the run did, as it does from a model directory: tokenizer.json, the tokenizer files beside it (convert's
  TOKENIZER_FILES: tokenizer_config.json names the bos/eos/pad tokens that the chat template renders and the EOS rule
  reads; one naming the run's EOS and BOS when the tokenizer came without it, but no token its chat template reads:
  _tokenizer_config) and the chat template as chat_template.jinja (data.chat_template's, else the directory's).
  Process 0 only."""
  import jax
  from meshlm.commands.convert import TOKENIZER_FILES
  src = tokenizer_file(cfg)
  dst = Path(cfg.run_dir) / "tokenizer.json"
  if src is None or jax.process_index() != 0 or src.resolve() == dst.resolve():
    return
  _write_once(dst, src.read_bytes())
  for name in TOKENIZER_FILES:
    side = src.parent / name
    # chat_template.json is replaced by the one template the run used, as chat_template.jinja
    if name not in ("tokenizer.json", "chat_template.jinja", "chat_template.json") and side.is_file():
      _write_once(Path(cfg.run_dir) / name, side.read_bytes())
  from meshlm.train.data.chat import load_chat_template
  template = load_chat_template(cfg.data.chat_template, str(src))
  if not (src.parent / "tokenizer_config.json").is_file():
    _write_once(Path(cfg.run_dir) / "tokenizer_config.json", _tokenizer_config(src, template))
  if template is not None:
    # model=RUN_DIR finds it beside the tokenizer (meshlm generate chat=true renders with it); it wins over a
    # chat_template in tokenizer_config.json, for meshlm as for transformers.
    _write_once(Path(cfg.run_dir) / "chat_template.jinja", template.source)


def _tokenizer_config(src: Path, template) -> str:
  """A tokenizer_config.json for a tokenizer.json that came without one: what the run used. The EOS it ended its rows
  with (the EOS rule's choice) and the BOS its post-processor adds, so that transformers' AutoTokenizer and
  model=RUN_DIR read the tokens the run trained with; but no token the run's chat template reads: the run rendered
  its chats with none named (no tokenizer_config.json gave one; transformers renders them so), and one named here
  would render from the run directory and its export where it rendered empty in training (`{{ bos_token }}`: a
  BOS before every chat that the run never trained on). The EOS rule finds the same EOS without the entry."""
  import json
  from meshlm.train.data.tokenizers import HFTokenizer
  tok = HFTokenizer(str(src))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.token(tok.eos_id)}
  if len(tok.bos_ids):
    config["bos_token"] = tok.token(tok.bos_ids[0])
  read = template.special_tokens_read if template is not None else frozenset()
  return json.dumps({k: v for k, v in config.items() if k not in read}, indent=2) + "\n"


def _write_once(dst: Path, data: str | bytes) -> None:
  raw = data.encode() if isinstance(data, str) else data  # tokenizer.model is binary
  if dst.is_file() and dst.read_bytes() == raw:
    return
  os.makedirs(dst.parent, exist_ok=True)
  tmp = dst.with_name(dst.name + ".tmp")
  tmp.write_bytes(raw)
  os.replace(tmp, dst)  # readers see the old file or the new, never half


def device_hbm(device) -> int | None:
  """The memory one program may use on `device`: its allocator's limit on a real TPU, else the compiler's limit
  (analysis/aot.hbm_limit, compile-only devices too), else the chip's published figure; None off TPU."""
  from meshlm.analysis import aot
  if device.platform != "tpu":
    return None
  try:
    stats = device.memory_stats() or {}
  except Exception:  # compile-only devices have no allocator
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  hbm = aot.hbm_limit(device)
  pub = aot.PUBLISHED.get(device.device_kind)
  return hbm or (int(pub.hbm_bytes) if pub else None)


def layout_refusal(cfg: Config, devices: int, hbm_bytes: int | None) -> str | None:
  """Why cfg's layout cannot fit `hbm_bytes` per device on `devices` devices, in one line naming what to change, or
  None. It judges the estimate's floor (analysis/layout.py): the step's arguments, the scanned layers' gradients
  and the saved layer inputs, all live when the backward's layer loop starts; a layout under it is never refused."""
  from meshlm.analysis.layout import GiB, estimate
  if hbm_bytes is None:
    return None
  est = estimate(cfg, devices, "tpu")
  if est.floor <= hbm_bytes:
    return None
  t = est.terms
  state = t["params"] + t["opt_state"] + t["model_state"]
  saved = t["saved"]
  gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
  head = (f"the layout needs at least {gib(est.floor)} per device, the device has {gib(hbm_bytes)} (parameters "
          f"{gib(t['params'])}, AdamW state {gib(t['opt_state'])}, gradients and saved layer inputs {gib(est.floor - state)})")
  sizes = cfg.mesh.sizes()
  spread = [k for k in ("data", "tensor") if sizes.get(k, 1) > 1]
  if state - saved >= saved and spread:
    fix = (f"the parameters are replicated over {' and '.join(f'mesh.{k}={sizes[k]}' for k in spread)}: move those "
           f"devices to mesh.fsdp")
  elif state >= saved:
    fix = "the parameters are split over every device already: train on more devices, or freeze some (train.freeze)"
  else:
    fix = "lower train.per_device_batch_size or train.seq_len (or raise train.micro_batches)"
  return f"{head}: {fix}; `meshlm compile --fit=layout ... topology=<slice>` ranks the layouts that may fit"


def refuse_unfit_layout(cfg: Config, devices: list) -> None:
  """meshlm train on TPU: a ConfigError before anything compiles when the layout cannot fit (layout_refusal)."""
  from meshlm.errors import ConfigError
  if not devices or devices[0].platform != "tpu":
    return
  why = layout_refusal(cfg, len(devices), device_hbm(devices[0]))
  if why:
    raise ConfigError(why)
