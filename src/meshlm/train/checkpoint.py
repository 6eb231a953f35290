"""Checkpoints through Orbax: save every `checkpoint.every` steps (async), keep the last
`checkpoint.keep`, resume from the latest complete one, skip corrupted ones.

Layout of one checkpoint, `<checkpoint.dir>/<step>/`:
  params/     the whole model tree (Orbax StandardSave: sharded arrays, restored onto any mesh): the
              trainable parameters and the model-state leaves beside them (params.merge_state)
  opt_state/  the optimizer state pytree
  data/       JSON: the data-iterator state, {"state": ..., "process_count"}: the position in the
              sequence of global batches, the same on every process and for any process count
  meta/       JSON: {"step", "rng" (the run's PRNG key data), "model_name", "model",
              "data" ({"source", "path"}: resuming on other data is refused),
              "nonfinite_in_a_row", "nonfinite_total"}

A meshlm model directory (`meshlm convert hf-to-meshlm`) has the same params/ and meta/ (without
the run's fields) plus config.yaml; this module owns both layouts: `save_model_dir` writes one,
`saved_model` reads which model a step or model directory holds, and `restore_params` restores
parameters after checking that model against the caller's.

`step` is the number of finished train steps: resuming from it runs step index `step` next.
Orbax writes each checkpoint into a temporary directory and renames it when complete, so a
process killed mid-write leaves no directory that looks complete; one that is complete-looking but
unreadable (truncated files) is found when restoring, moved aside to `<checkpoint.dir>-corrupt/`
and skipped with a warning that names it.

A save that cannot be written (checkpoint.dir made read-only or immutable mid-run, a full disk) stops
the run with CheckpointSaveError, one line naming the directory and the cause: training on without
checkpoints would lose the run. The directory is probed before each save, because Orbax creates the
step directory in a background thread and a failure there leaves it waiting out its 300 s timeout.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable

import jax
import numpy as np
import pydantic

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models.params import merge_state, split_state
from meshlm.models.model import resolve

ITEMS = ("params", "opt_state", "data", "meta")


def checkpoint_dir(cfg: Config) -> str:
  return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.run_dir, "checkpoints"))


def _ocp():
  import orbax.checkpoint as ocp  # slow to import; only runs that checkpoint pay for it
  return ocp


class CheckpointSaveError(ConfigError):
  """A checkpoint could not be saved; the run stops (exit code 2 through the CLI)."""


def writable_or_error(path: str) -> str | None:
  """None if this process can create files in `path` (created if missing), else the OS's reason."""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write-test-{jax.process_index()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    return e.strerror or str(e)
  return None


def _first_error(err: str | None) -> str | None:
  """The first process's error, on every process: they must all stop, or the next collective hangs."""
  if jax.process_count() == 1:
    return err
  errs = [e for e in _gather_json(err) if e]
  return errs[0] if errs else None


def _data_key(cfg: Config) -> dict:
  """What the data iterator's saved position depends on: on other data it would be meaningless."""
  path = cfg.data.path
  return {"source": cfg.data.source, "path": os.path.abspath(os.path.expanduser(path)) if path else None}


def _data_mismatch(saved: dict | None, cfg: Config) -> str | None:
  if saved is None:  # a checkpoint from before meta held it
    return None
  ours = _data_key(cfg)
  for k in ("source", "path"):
    if saved.get(k) != ours[k]:
      return f"data.{k} is {ours[k]!r} here but {saved.get(k)!r} in the checkpoint"
  return None


def _gather_json(obj: Any) -> list[Any]:
  """Every process's JSON-able `obj`, in process order (a no-op list on one process)."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))  # [P, 1]
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = multihost_utils.process_allgather(padded)  # [P, max_len]
  return [json.loads(bytes(r[:int(n)]).decode()) for r, n in zip(rows, sizes.reshape(-1))]


def _data_item(data_state: dict) -> dict:
  """The data item of a checkpoint. Every process runs the same global stream (train/data), so their
  states agree; a difference means their data configs differ."""
  states = _gather_json(data_state)
  for i, other in enumerate(states):
    if other != states[0]:
      raise ConfigError(f"processes 0 and {i} are at different data positions: every process must run the "
                        "same command (the same data.* keys)")
  return {"state": states[0], "process_count": jax.process_count()}


def _data_state(data: dict, path: str) -> dict:
  """The data-iterator state of a checkpoint's data item, for this run on any number of processes."""
  if "state" in data:
    return data["state"]
  # Written before the data order was process-count independent: {"process_count", "states"}, one per
  # process. One process's stream is today's global stream, so that state carries over exactly.
  if data["process_count"] == 1:
    return data["states"][0]
  raise ConfigError(f"checkpoint {path} holds the per-process data positions of {data['process_count']} "
                    "processes, from a meshlm before the data order was the same on any number of processes; "
                    "they cannot be resumed. Start a new run_dir with checkpoint.load_params_from")


def _model_mismatch(saved: dict, cfg: Config) -> str | None:
  ours = cfg.model.model_dump(mode="json")
  # A key the checkpoint predates had its default then (e.g. model.hidden_activation: silu); a key that has
  # moved into a part's section since is read under its new name.
  fields = type(cfg.model).model_fields
  saved = type(cfg.model).moved(saved)
  saved = {**{k: fields[k].get_default(call_default_factory=True) for k in ours if k in fields and k not in saved},
           **saved}
  # Token ids change no parameter (and the parts' knobs that only change how the same parameters are used are their
  # sections' COMPUTE ones, below).
  for k in sorted((set(saved) | set(ours)) - set(cfg.model.TOKEN_FIELDS) - {"parts"}):
    if saved.get(k) != ours.get(k):
      return f"model.{k} is {ours.get(k)!r} here but {saved.get(k)!r} in the checkpoint"
  return _parts_mismatch(saved.get("parts") or {}, cfg)


def _parts_mismatch(saved: dict, cfg: Config) -> str | None:
  """The parts' own knobs (model.parts), each at its section's default where unset; the knobs a section
  names as COMPUTE (how the same parameters are used) may differ."""
  sections = {p.name: p.config for p in resolve(cfg).unique_parts if p.config is not None}
  ours = cfg.model.parts
  for name in sorted(set(saved) | set(ours)):
    whole = f"model.parts.{name} is {ours.get(name)!r} here but {saved.get(name)!r} in the checkpoint"
    section = sections.get(name)
    if section is None:  # a section no part here declares: the model itself differs
      return whole
    try:
      a, b = (section.model_validate(t.get(name, {})).model_dump(mode="json") for t in (ours, saved))
    except pydantic.ValidationError:  # a knob the checkpoint has that this part's section no longer takes
      return whole
    for knob in sorted(set(a) - set(getattr(section, "COMPUTE", ()))):
      if a[knob] != b[knob]:
        return f"model.parts.{name}.{knob} is {a[knob]!r} here but {b[knob]!r} in the checkpoint"
  return None


class Checkpointer:
  """One run's CheckpointManager. All processes must call save/restore together."""

  def __init__(self, cfg: Config, warn: Callable[[str], None] = print):
    ocp = _ocp()
    self.cfg = cfg
    self.dir = checkpoint_dir(cfg)
    self.warn = warn
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=True)
    try:
      self.manager = ocp.CheckpointManager(self.dir, options=options, item_names=ITEMS)
    except OSError as e:
      raise ConfigError(f"checkpoint.dir={self.dir}: cannot be used ({e.strerror or e})") from None

  def should_save(self, step: int, last_step: int) -> bool:
    return step % self.cfg.checkpoint.every == 0 or step == last_step

  def _save_failed(self, step: int | None, cause: str) -> CheckpointSaveError:
    which = f"checkpoint {step}" if step is not None else "a checkpoint"
    return CheckpointSaveError(f"checkpoint.dir={self.dir}: cannot save {which} ({cause}); the run stopped. "
                               "Make it writable (or set checkpoint.dir) and run the same command to continue "
                               "from the last checkpoint")

  def save(self, step: int, state, rng: jax.Array, data_state: dict, counters: dict[str, int]) -> None:
    """Starts an async save of the state after `step` finished steps. Returns once the arrays are
    copied off the devices, so the next step may donate their buffers. Raises CheckpointSaveError if
    the directory cannot be written, or an earlier async save failed."""
    ocp = _ocp()
    err = _first_error(writable_or_error(self.dir))
    if err:
      raise self._save_failed(step, err)
    try:
      self.manager.check_for_errors()  # an earlier async save that failed in the background
    except Exception as e:  # noqa: BLE001 -- whatever Orbax met, the run must stop in one line
      raise self._save_failed(None, _first_line(e)) from None
    if step in self.manager.all_steps():  # e.g. a preemption right after a periodic save
      return
    data = _data_item(data_state)
    # The key as plain data in the JSON: Orbax's key handler writes a whole array checkpoint for 8 bytes.
    meta = {"step": step, "rng": np.asarray(jax.random.key_data(rng)).tolist(), "model_name": self.cfg.model_name,
            "model": self.cfg.model.model_dump(mode="json"), "data": _data_key(self.cfg), **counters}
    try:
      self.manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(merge_state(state.params, state.model_state)),
          opt_state=ocp.args.StandardSave(state.opt_state),
          data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta)),
          force=True)
    except Exception as e:  # noqa: BLE001
      raise self._save_failed(step, _first_line(e)) from None

  def restore_latest(self, abstract_state) -> dict | None:
    """The newest readable checkpoint as {"step", "params", "model_state", "opt_state", "rng", "data_state",
    "meta"},
    or None. Unreadable ones are moved aside with a warning; older ones are tried next."""
    ocp = _ocp()
    for step in sorted(self.manager.all_steps(), reverse=True):
      path = os.path.join(self.dir, str(step))
      try:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        bad = _model_mismatch(meta.get("model", {}), self.cfg)
        if bad:
          raise ConfigError(f"run_dir={self.cfg.run_dir}: its checkpoint {path} is for another model ({bad}); "
                            "use a new run_dir, or checkpoint.load_params_from to start from its parameters")
        bad = _data_mismatch(meta.get("data"), self.cfg)
        if bad:
          raise ConfigError(f"run_dir={self.cfg.run_dir}: its checkpoint {path} was trained on other data ({bad}), "
                            "where its data position means nothing; put the data.* key back, or use a new run_dir "
                            "with checkpoint.load_params_from to start from its parameters")
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(merge_state(abstract_state.params, abstract_state.model_state)),
            opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
            data=ocp.args.JsonRestore()))
        data_state = _data_state(out["data"], path)
        rng = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
        params, model_state = split_state(self.cfg, out["params"])
        return {"step": step, "params": params, "model_state": model_state, "opt_state": out["opt_state"],
                "rng": rng, "data_state": data_state, "meta": meta}
      except ConfigError:
        raise
      except Exception as e:  # noqa: BLE001 -- any read failure means this checkpoint is unusable
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        moved = self._move_aside(step)
        self.warn(f"checkpoint {path} is corrupted or incomplete ({reason[:200]}); skipped it"
                  + (f" and moved it to {moved}" if moved else ""))
    return None

  def _move_aside(self, step: int) -> str | None:
    """Moves a bad step out of the manager's directory, so a new save of that step can happen."""
    src = os.path.join(self.dir, str(step))
    dst = os.path.join(self.dir + "-corrupt", f"{step}-{int(time.time())}")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.move(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"meshlm-move-aside-{step}")
    self.manager.reload()
    return dst

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- a failed async save, found when waiting for it
      raise self._save_failed(None, _first_line(e)) from None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def save_model_dir(cfg: Config, params: dict, path: str, *, overwrite: bool = False, files=()) -> str:
  """A meshlm model directory: params/ (Orbax), meta/metadata, config.yaml and a copy of `files` (the
  tokenizer's); it appears only when complete."""
  from meshlm.config import to_yaml
  from meshlm.fsutil import new_dir
  ocp = _ocp()
  with new_dir(path, overwrite=overwrite) as tmp:
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp / "params", params)
    ckpt.wait_until_finished()
    (tmp / "meta").mkdir()
    meta = {"model_name": cfg.model_name, "model": cfg.model.model_dump(mode="json")}
    (tmp / "meta" / "metadata").write_text(json.dumps(meta) + "\n")
    (tmp / "config.yaml").write_text(to_yaml(cfg))
    for f in files:
      shutil.copyfile(f, tmp / os.path.basename(f))
  return os.path.abspath(path)


def saved_model(step_dir: str, key: str) -> dict | None:
  """{"model_name", "model"} of a step or model directory: from meta/metadata, else from a config.yaml
  in it or in the run directory above its checkpoints; None when neither says."""
  import yaml
  run_dir = os.path.dirname(os.path.dirname(step_dir))
  for f in (os.path.join(step_dir, "meta", "metadata"), os.path.join(step_dir, "config.yaml"),
            os.path.join(run_dir, "config.yaml")):
    if not os.path.isfile(f):
      continue
    try:
      # metadata is JSON (PyYAML would read its 1e-05 as a string), config.yaml is YAML.
      data = json.loads(open(f).read()) if f.endswith("metadata") else (yaml.safe_load(open(f).read()) or {})
    except (json.JSONDecodeError, yaml.YAMLError) as e:
      raise ConfigError(f"{key}: cannot read {f} ({str(e).splitlines()[0]})") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
      return {"model_name": data.get("model_name") or os.path.basename(step_dir), "model": data["model"]}
  return None


def saved_config(step_dir: str, key: str) -> dict | None:
  """The config.yaml tree of a step or model directory (in it, or in the run directory above its checkpoints);
  None when neither has one."""
  import yaml
  above = os.path.dirname(step_dir)
  run_dir = os.path.dirname(above) if os.path.basename(above) == "checkpoints" else step_dir
  for f in (os.path.join(step_dir, "config.yaml"), os.path.join(run_dir, "config.yaml")):
    if os.path.isfile(f):
      try:
        data = yaml.safe_load(open(f).read()) or {}
      except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot read {f} ({str(e).splitlines()[0]})") from None
      return data if isinstance(data, dict) else None
  return None


def restore_params(cfg: Config, step_dir: str, abstract_params, key: str) -> Any:
  """step_dir/params restored onto abstract_params' shardings, after checking that the directory holds
  cfg's model; every failure is one line that starts with key."""
  saved = saved_model(step_dir, key)
  bad = saved and _model_mismatch(saved["model"], cfg)
  if bad:
    raise ConfigError(f"{key}: parameters of another model ({bad})")
  try:
    return _ocp().StandardCheckpointer().restore(os.path.join(step_dir, "params"), abstract_params)
  except Exception as e:  # noqa: BLE001 -- Orbax raises many types; the user needs the path and reason
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ConfigError(f"{key}: cannot read {step_dir}/params ({reason})") from None


def load_params(cfg: Config, path: str, abstract_params, param_shardings, mesh) -> Any:
  """Parameters for a new run from `checkpoint.load_params_from`: a meshlm run_dir, checkpoints dir
  or step dir (the newest complete step), or a Hugging Face model directory.

  For a model with model state (params.model_state_specs: DeepSeek-V3's routing bias), pass the whole model
  tree's abstract arrays and shardings (params.merge_state of the parameters' and the state's): the state is
  read with the parameters, and params.split_state separates them."""
  path = os.path.abspath(os.path.expanduser(path))
  key = f"checkpoint.load_params_from={path}"
  if not os.path.isdir(path):
    raise ConfigError(f"{key}: no such directory")
  if os.path.isfile(os.path.join(path, "config.json")):
    return _load_hf(cfg, path, key, param_shardings, mesh)
  return restore_params(cfg, _find_step_dir(path, key), abstract_params, key)


def _find_step_dir(path: str, key: str) -> str:
  if os.path.isdir(os.path.join(path, "params")):
    return path
  for folder in (path, os.path.join(path, "checkpoints")):
    steps = [int(n) for n in os.listdir(folder) if n.isdigit()] if os.path.isdir(folder) else []
    complete = [s for s in steps if os.path.isdir(os.path.join(folder, str(s), "params"))]
    if complete:
      return os.path.join(folder, str(max(complete)))
  raise ConfigError(f"{key}: not a meshlm checkpoint (no <step>/params under it or its checkpoints/) "
                    "and not a Hugging Face directory (no config.json)")


def _load_hf(cfg: Config, path: str, key: str, param_shardings, mesh) -> Any:
  try:
    from meshlm import hf
  except ImportError:
    raise ConfigError(f"{key}: a Hugging Face directory, but this meshlm has no meshlm.hf importer") from None
  hf_cfg, params = hf.load(path, mesh=mesh)
  bad = _model_mismatch(hf_cfg.model.model_dump(mode="json"), cfg)
  if bad:
    raise ConfigError(f"{key}: the Hugging Face model differs from this run's ({bad}); pick the matching "
                      "model= preset or set the model.* keys")
  dtype = cfg.train.param_dtype
  return jax.device_put(jax.tree.map(lambda x: x.astype(dtype), params), param_shardings)
