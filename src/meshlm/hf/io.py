"""Reading and writing Hugging Face model directories (config.json + safetensors).

load() never builds the model on the host: each stacked meshlm parameter is made with
`jax.make_array_from_callback`, whose callback reads only the layers (and, for 2-D kernels and
embeddings, only the rows and columns) of the device shard it is asked for. save() converts one
parameter at a time and flushes a safetensors shard whenever it reaches `max_shard_bytes`, into a
temporary directory that is renamed into place only when complete.

load() also reads the text model of a multimodal checkpoint its family declares (`maps.Wrapped`: the
text config nested under `text_config`, tensors under `model.language_model.`), and an inner stack's tensors
stored either one per row or fused (`maps.Fused`). Tensors under a family's skipped prefixes (the
vision tower, multi-token prediction) are not read, and one line on stderr says how many were skipped; so
are a family's layers past num_hidden_layers where it declares them multi-token prediction (DeepSeek-V3's).

The model-state leaves the layer parts declare (params.model_state_specs, e.g. DeepSeek-V3's routing bias
`e_score_correction_bias`) are read and written like parameters: load() returns, and save() takes, the whole model
tree (params.merge_state), what forward and meshlm's checkpoints hold. fp8 block-quantized weights (hf/fp8.py) are
dequantized to the parameter dtype as they are read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from meshlm.config import Config, load_config
from meshlm.errors import ConfigError
from meshlm.hf import fp8, maps

# Tensors in some checkpoints that carry no weights (precomputed RoPE tables), skipped on load.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes a float32 model can take; anything else (integers, bool) is refused, and fp8 (F8_E4M3) is read
# only as a block-scaled weight with its scale tensor (hf/fp8.py).
FLOAT_DTYPES = {"F32": np.float32, "BF16": None, "F16": np.float16, "F64": np.float64}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG = "generation_config.json"


def families() -> dict[str, maps.Adapter]:
  """model_type -> adapter, over the families with a Hugging Face adapter (and the multimodal model_types
  whose text model one of them reads)."""
  from meshlm.hf.adapters import ADAPTERS
  adapters = [importlib.import_module(module).ADAPTER for module in ADAPTERS.values()]
  return {**{w.model_type: a for a in adapters for w in a.wrapped}, **{a.model_type: a for a in adapters}}


def resolve(hf: dict, where: str) -> tuple[maps.Adapter, dict, maps.Wrapped | None]:
  """(the family's adapter, the text model's config.json fields, the multimodal layout or None)."""
  fams = families()
  model_type = hf.get("model_type")
  if model_type not in fams:
    raise ConfigError(f"{where}: model_type={model_type!r} is not supported; known: {', '.join(sorted(fams))}")
  fam = fams[model_type]
  wrapped = next((w for w in fam.wrapped if w.model_type == model_type), None)
  allowed = fam.architectures if wrapped is None else wrapped.architectures
  archs = hf.get("architectures") or []
  bad = [a for a in archs if a not in allowed]
  if bad:
    raise ConfigError(f"{where}: architectures={bad!r} is not supported for model_type={model_type!r}; "
                      f"expected {', '.join(allowed)}")
  if wrapped is None:
    return fam, hf, None
  text = hf.get(wrapped.config_key)
  if not isinstance(text, dict):
    raise ConfigError(f"{where}: model_type={model_type!r} needs the text model's fields under "
                      f"{wrapped.config_key!r} (an object)")
  # transformers ties the head by the top-level flag of a multimodal config; ids the text config lacks are
  # read from the top level.
  text = {**{k: hf[k] for k in TOKEN_IDS if k in hf}, **text,
          "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
  return fam, text, wrapped


def family_for(hf: dict, where: str) -> maps.Adapter:
  return resolve(hf, where)[0]


def _family_of_cfg(cfg: Config) -> maps.Adapter:
  from meshlm.hf.adapters import ADAPTERS
  if cfg.model.family not in ADAPTERS:
    raise ConfigError(f"model.family={cfg.model.family!r}: has no Hugging Face mapping")
  return importlib.import_module(ADAPTERS[cfg.model.family]).ADAPTER


@dataclasses.dataclass(frozen=True)
class Entry:
  """One meshlm parameter leaf and where its values live in the HF checkpoint.

  A stacked leaf holds one HF tensor per model layer (`{i}` in the name) and, where the name has `{e}`,
  one per row of a second stacked axis too (the inner stack, `maps.Tensor.inner_axes`): the leaf
  [layers, inner, ...] is the HF tensors stacked on those two axes, and each HF tensor converts like an
  unstacked one (`tensor_shape()`).
  """
  path: tuple[str, ...]
  tensor: maps.Tensor
  shape: tuple[int, ...]  # the meshlm leaf's shape (stacked for layer params)
  layer_axis: int | None  # position of the "layers" axis, None for non-layer leaves
  layer_ids: tuple[int, ...] = ()  # the model layer index of each row of the stack
  inner_axis: int | None = None  # position of the inner stack's axis when the name has {e}, else None

  def tensor_shape(self) -> tuple[int, ...]:
    """The shape of the meshlm slice one HF tensor holds: the leaf without its layer and inner axes."""
    return tuple(n for ax, n in enumerate(self.shape) if ax not in (self.layer_axis, self.inner_axis))

  def layers(self) -> list[int | None]:
    return [None] if self.layer_axis is None else list(self.layer_ids)

  def inner(self) -> list[int | None]:
    return [None] if self.inner_axis is None else list(range(self.shape[self.inner_axis]))

  def name(self, layer: int | None, row: int | None) -> str:
    return self.tensor.name.format(i=layer, e=row)

  def hf_names(self) -> list[str]:
    return [self.name(i, e) for i in self.layers() for e in self.inner()]


def entries(cfg: Config, wrapped: maps.Wrapped | None = None) -> list[Entry]:
  """Every meshlm parameter leaf paired with its HF tensor, in parameter-tree order; with `wrapped`, named as
  that multimodal layout stores the text model."""
  import jax
  from meshlm import spec as S
  from meshlm.models import decoder
  from meshlm.models.params import model_specs
  fam = _family_of_cfg(cfg)
  m = cfg.model
  top = fam.top_map(m)
  layer = fam.layer_map(m)
  out = []
  lp = decoder.plan(cfg)
  rows = {k: [i for i, kind in enumerate(lp.kinds) if kind == k] for k in lp.kind_names()}
  flat = jax.tree_util.tree_flatten_with_path(model_specs(cfg), is_leaf=S.is_spec)[0]
  for kpath, s in flat:
    path = tuple(k.key for k in kpath)
    ids: tuple[int, ...] = ()
    if path[0] == "layers":
      # params["layers"][kind] stacks that kind's layers; HF names address model layer indices.
      key, ids = ".".join(path[2:]), tuple(rows[path[1]])
      table = layer
    else:
      key = ".".join(path)
      table = top
    if key not in table:
      raise ValueError(f"family {m.family!r}: its HF name map has no entry for parameter {'.'.join(path)}")
    axis = s.axes.index("layers") if "layers" in s.axes else None
    tensor = table[key]
    inner = None
    if "{e}" in tensor.name:
      named = [a for a in s.axes if a in tensor.inner_axes]
      if not named:
        raise ValueError(f"family {m.family!r}: {tensor.name} has {{e}} but parameter {'.'.join(path)} (axes "
                         f"{s.axes}) has none of its inner_axes={tensor.inner_axes}; the adapter's Tensor declares "
                         "which axis {e} indexes")
      inner = s.axes.index(named[0])
    if wrapped is not None:
      fused = tensor.fused and dataclasses.replace(tensor.fused, name=wrapped.rename(tensor.fused.name))
      tensor = dataclasses.replace(tensor, name=wrapped.rename(tensor.name), fused=fused)
    out.append(Entry(path, tensor, tuple(s.shape), axis, ids, inner))
  return out


# ----------------------------------------------------------------------------------------------
# Reading

def read_hf_config(path: Path) -> dict:
  cfg_path = path / "config.json"
  if not cfg_path.is_file():
    raise ConfigError(f"{path}: not a Hugging Face model directory (no config.json)")
  try:
    return json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{cfg_path}: invalid JSON ({e})") from None


def model_fields(path: Path) -> dict:
  """ModelConfig fields of an HF model directory: its family's reading of config.json, plus the token ids
  (config.json) and generation_config.json, which meshlm carries to the export unchanged."""
  hf = read_hf_config(path)
  fam, hf, _ = resolve(hf, str(path / "config.json"))
  out = fam.from_hf_config(hf)
  gen = None
  gen_path = path / GENERATION_CONFIG
  if gen_path.is_file():
    try:
      gen = json.loads(gen_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{gen_path}: invalid JSON ({e})") from None
    if not isinstance(gen, dict):
      raise ConfigError(f"{gen_path}: expected a JSON object")
  for key in TOKEN_IDS:
    # transformers: config.json's id, else generation_config.json's (newer repos keep them only there).
    value = hf.get(key, (gen or {}).get(key))
    ok = value is None or isinstance(value, int) or (key == "eos_token_id" and isinstance(value, list)
                                                     and all(isinstance(v, int) for v in value))
    if not ok or isinstance(value, bool):
      raise ConfigError(f"{path / 'config.json'}: {key}={value!r} is not a token id")
    out[key] = value
  out["generation_config"] = gen
  return out


def _tensor_files(path: Path) -> dict[str, Path]:
  """HF tensor name -> the safetensors file holding it.

  What transformers reads: the files model.safetensors.index.json lists, else model.safetensors. Any
  other *.safetensors beside them (Mistral's consolidated.safetensors, an adapter) is not the model.
  """
  index = path / "model.safetensors.index.json"
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{index}: invalid JSON ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
      raise ConfigError(f"{index}: no weight_map (expected {{tensor name: file name}})")
    out = {}
    for name, fname in weight_map.items():
      f = path / fname
      if not f.is_file():
        raise ConfigError(f"{index}: tensor {name} is in {fname}, which does not exist")
      out[name] = f
    return out
  single = path / "model.safetensors"
  if not single.is_file():
    others = sorted(p.name for p in path.glob("*.safetensors"))
    seen = f"; {', '.join(others)} {'is' if len(others) == 1 else 'are'} not read" if others else ""
    raise ConfigError(f"{path}: no model.safetensors or model.safetensors.index.json (meshlm reads the "
                      f"safetensors files transformers reads{seen})")
  with _open(single) as h:
    return {name: single for name in h.keys()}


def _open(f: Path):
  """safe_open, with a damaged or truncated file (an interrupted download) as one line naming it."""
  from safetensors import SafetensorError, safe_open
  try:
    return safe_open(f, framework="numpy")
  except (SafetensorError, OSError) as e:
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ConfigError(f"{f}: not a readable safetensors file ({reason}); is the download complete?") from None


class _Reader:
  """Open safetensors files by path, and slices of tensors as float32 numpy arrays.

  `fused` maps the name of an inner stack's tensor to where a fused tensor holds it (fused name, index on its
  first axis, rows): such a name reads as the unfused tensor would.
  """

  def __init__(self, stack: contextlib.ExitStack, files: dict[str, Path], quant: fp8.Scheme | None = None):
    self._stack, self._files, self._open = stack, files, {}
    self.fused: dict[str, tuple[str, int, slice]] = {}
    self.quant, self._raw = quant, fp8.RawTensors()

  def has(self, name: str) -> bool:
    return name in self._files or name in self.fused

  def _handle(self, name: str):
    f = self._files[name]
    if f not in self._open:
      self._open[f] = self._stack.enter_context(_open(f))
    return self._open[f]

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    if name in self.fused:
      src, _, rows = self.fused[name]
      shape, dtype = self.info(src)
      return (rows.stop - rows.start, *shape[2:]), dtype
    sl = self._handle(name).get_slice(name)
    return tuple(sl.get_shape()), sl.get_dtype()

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    if name in self.fused:
      src, e, rows = self.fused[name]
      x = np.asarray(self._handle(src).get_slice(src)[e:e + 1, rows][0], dtype=np.float32)  # one row's [out, in]
      return x if index is None else x[index]
    sl = self._handle(name).get_slice(name)
    if sl.get_dtype() == fp8.WEIGHT:
      rows, cols = index if index is not None else (slice(None), slice(None))
      return fp8.dequantize(self._raw.array(self._files[name], name), self._scales(fp8.scale_name(name)), rows, cols,
                            self.quant, name)
    x = sl[index] if index is not None else sl[:]
    return np.asarray(x, dtype=np.float32)

  def _scales(self, name: str):
    """(row blocks, col blocks) -> those blocks of the scale tensor `name`, as float32."""
    if self.info(name)[1] in fp8.RAW_DTYPES:  # ue8m0 exponent bytes
      return lambda r, c: np.asarray(self._raw.array(self._files[name], name)[r, c]).astype(np.float32)
    return lambda r, c: np.asarray(self._handle(name).get_slice(name)[r, c], dtype=np.float32)


def _find_fused(ents: list[Entry], reader: _Reader) -> None:
  """Where a layer's inner-stack tensors are absent but its fused tensor is present, reads them from it
  (reader.fused), after checking the fused tensor's shape [rows, parts * out, in]."""
  for e in ents:
    fused = e.tensor.fused
    if fused is None or e.inner_axis is None:
      continue
    out, *ins = e.tensor.hf_shape(e.tensor_shape())
    n = e.shape[e.inner_axis]
    for i in e.layers():
      names = [e.name(i, x) for x in e.inner()]
      src = fused.name.format(i=i)
      if any(reader.has(name) for name in names) or not reader.has(src):
        continue  # one per row (a missing one is reported by _check_tensors), or neither
      want = (n, fused.parts * out, *ins)
      got, _ = reader.info(src)
      if got != want:
        raise ConfigError(f"tensor {src}: shape {list(got)}, but config.json implies {list(want)} "
                          f"({n} on the {{e}} axis, fused)")
      for x, name in enumerate(names):
        reader.fused[name] = (src, x, fused.rows(out))


def _check_tensors(ents: list[Entry], reader: _Reader, files: dict[str, Path], tied: bool,
                   skipped: tuple[str, ...] = ()) -> dict[str, int]:
  """Names, shapes and dtypes (an fp8 weight's scale tensor too), before anything is read: each error names the
  tensor. Returns how many tensors each skipped prefix held."""
  expected, scales = {}, set()
  for e in ents:
    hf_shape = e.tensor.hf_shape(e.tensor_shape())
    for name in e.hf_names():
      expected[name] = hf_shape
  for name, shape in expected.items():
    if not reader.has(name):
      raise ConfigError(f"missing tensor {name} (expected shape {list(shape)})")
    got, dtype = reader.info(name)
    where = files[reader.fused[name][0] if name in reader.fused else name].name
    if got != shape:
      raise ConfigError(f"tensor {name}: shape {list(got)} in {where}, but config.json implies {list(shape)}")
    if dtype == fp8.WEIGHT and name not in reader.fused:
      scales.add(fp8.check(name, got, reader.quant, reader.has, reader.info))
    elif dtype not in FLOAT_DTYPES:
      raise ConfigError(f"tensor {name}: dtype {dtype} cannot be loaded into float32 parameters "
                        f"(expected one of {', '.join(FLOAT_DTYPES)})")
  read_fused = {src for src, _, _ in reader.fused.values()} | scales
  counts = dict.fromkeys(skipped, 0)
  for name in files:
    if name in expected or name in read_fused or name.endswith(IGNORED_SUFFIXES):
      continue
    if tied and name == "lm_head.weight":
      continue  # some tied checkpoints also store the head; meshlm uses the embedding table
    prefix = next((p for p in skipped if name.startswith(p)), None)
    if prefix is not None:
      counts[prefix] += 1
      continue
    raise ConfigError(f"unexpected tensor {name} in {files[name].name} (not part of this "
                      f"{'tied' if tied else 'untied'} model)")
  return {p: n for p, n in counts.items() if n}


def _leaf(e: Entry, reader: _Reader, sharding, dtype) -> Any:
  """The leaf as a sharded array: each device's callback reads only the HF tensors (layers, inner rows) of
  its shard, and of each, only its rows and columns where the layout allows (Tensor.hf_index)."""
  import jax
  tensor_shape = e.tensor_shape()
  stacked = [ax for ax in (e.layer_axis, e.inner_axis) if ax is not None]

  def one_tensor(name: str, index: tuple[slice, ...]) -> np.ndarray:
    direct = e.tensor.hf_index(index, tensor_shape)
    if direct is not None:
      hf_index, transpose = direct
      x = reader.read(name, hf_index)
      return x.T if transpose else x
    return e.tensor.to_meshlm(reader.read(name), tensor_shape)[index]

  def callback(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, e.shape))
    dims = tuple(s for ax, s in enumerate(index) if ax not in stacked)  # within one HF tensor
    layers = e.layers() if e.layer_axis is None else [e.layer_ids[r] for r in range(*index[e.layer_axis].indices(
        e.shape[e.layer_axis]))]
    rows = e.inner() if e.inner_axis is None else list(range(*index[e.inner_axis].indices(
        e.shape[e.inner_axis])))
    grid = np.stack([np.stack([one_tensor(e.name(i, x), dims) for x in rows]) for i in layers])
    return _from_grid(grid, e).astype(dtype)

  return jax.make_array_from_callback(e.shape, sharding, callback)


def _to_grid(leaf: np.ndarray, e: Entry) -> np.ndarray:
  """A leaf (or a shard of it) as [layers, inner, *tensor dims], with 1 for an axis it does not stack."""
  la, ia = e.layer_axis, e.inner_axis
  if la is not None and ia is not None:
    return np.moveaxis(leaf, (la, ia), (0, 1))
  if la is not None:
    return np.moveaxis(leaf, la, 0)[:, None]
  if ia is not None:
    return np.moveaxis(leaf, ia, 0)[None]
  return leaf[None, None]


def _from_grid(grid: np.ndarray, e: Entry) -> np.ndarray:
  """The inverse of _to_grid."""
  la, ia = e.layer_axis, e.inner_axis
  if la is not None and ia is not None:
    return np.moveaxis(grid, (0, 1), (la, ia))
  if la is not None:
    return np.moveaxis(grid[:, 0], 0, la)
  if ia is not None:
    return np.moveaxis(grid[0], 0, ia)
  return grid[0, 0]


def load(path: str | os.PathLike, *overrides: str, mesh=None) -> tuple[Config, dict]:
  """Reads an HF model directory into (cfg, params), params placed on `mesh`'s shardings.

  overrides are key=value config settings (e.g. "train.compute_dtype=float32", "mesh.fsdp=4").
  With no mesh, the enclosing jax.set_mesh's, else the config's (meshlm.parallel.resolve_mesh).
  """
  import jax
  from meshlm.models import registry
  from meshlm.models.params import model_shardings
  from meshlm.parallel.mesh import resolve_mesh
  path = Path(path)
  base = {"model_name": path.name, "model": model_fields(path)}
  cfg = registry.validate(load_config(*overrides, base=base))  # the family's checks; its parts' knobs written out
  mesh = resolve_mesh(cfg, None, mesh)
  hf = read_hf_config(path)
  fam, _, wrapped = resolve(hf, str(path / "config.json"))
  ents = entries(cfg, wrapped)
  files = _tensor_files(path)
  shardings = model_shardings(cfg, mesh)
  dtype = np.dtype(cfg.train.param_dtype)
  skip = fam.skipped + (wrapped.skipped if wrapped else ())
  if fam.mtp_layers:
    skip += _layers_past(files, cfg.model.num_layers)
  with contextlib.ExitStack() as stack:
    reader = _Reader(stack, files, fp8.scheme(hf, str(path / "config.json")))
    _find_fused(ents, reader)
    skipped = _check_tensors(ents, reader, files, cfg.model.tie_embeddings, skip)
    if skipped:
      counts = " and ".join(f"{n} under {p}*" for p, n in skipped.items())
      print(f"meshlm: {path}: skipped {counts} (not part of the text model)", file=sys.stderr)
    flat = {e.path: _leaf(e, reader, _get(shardings, e.path), dtype) for e in ents}
  params: dict = {}
  for p, v in flat.items():
    node = params
    for k in p[:-1]:
      node = node.setdefault(k, {})
    node[p[-1]] = v
  jax.block_until_ready(params)
  return cfg, params


def _layers_past(files: dict[str, Path], num_layers: int) -> tuple[str, ...]:
  """The `model.layers.{i}.` prefixes of the checkpoint's layers i >= num_layers (multi-token prediction)."""
  found = set()
  for name in files:
    head, _, rest = name.partition("model.layers.")
    index = rest.split(".", 1)[0]
    if not head and index.isdigit() and int(index) >= num_layers:
      found.add(int(index))
  return tuple(f"model.layers.{i}." for i in sorted(found))


def _get(tree: dict, path: tuple[str, ...]) -> Any:
  for k in path:
    tree = tree[k]
  return tree


# ----------------------------------------------------------------------------------------------
# Writing

def hf_config(cfg: Config) -> dict:
  fam = _family_of_cfg(cfg)
  m = cfg.model
  return {"architectures": [fam.architectures[0]], "model_type": fam.model_type,
          **fam.to_hf_config(m), **{k: getattr(m, k) for k in TOKEN_IDS}, "dtype": "float32"}


def hf_tensors(cfg: Config, params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array in HF layout), one parameter leaf on the host at a time (the parts of a split tensor
  until the last one comes)."""
  split: dict[str, dict[int, np.ndarray]] = {}
  for e in entries(cfg):
    try:
      leaf = _get(params, e.path)
    except KeyError:
      raise ConfigError(f"parameter {'.'.join(e.path)}: not in the tree given; save() takes the whole model, the "
                        "model state merged in (meshlm.models.params.merge_state(params, model_state))") from None
    if tuple(leaf.shape) != e.shape:
      raise ConfigError(f"parameter {'.'.join(e.path)}: shape {list(leaf.shape)}, but the config implies "
                        f"{list(e.shape)}")
    host = np.asarray(leaf, dtype=np.float32)
    grid = _to_grid(host, e)  # one HF tensor per (layer, inner row)
    for r, i in enumerate(e.layers()):
      for c, x in enumerate(e.inner()):
        name, arr = e.name(i, x), np.ascontiguousarray(e.tensor.to_hf(grid[r, c]))
        if isinstance(e.tensor, maps.HeadSplit):
          # One part of an HF tensor that holds several leaves (kv_b_proj: k_b and v_b): written once all are here.
          parts = split.setdefault(name, {})
          parts[e.tensor.part] = arr
          if len(parts) < len(e.tensor.sizes):
            continue
          arr = maps.HeadSplit.join([parts[k] for k in sorted(parts)])
          del split[name]
        yield name, arr
    del host, grid


def save(cfg: Config, params: dict, path: str | os.PathLike, *, max_shard_bytes: int = 2 << 30,
         overwrite: bool = False, files: list[Path] = ()) -> Path:
  """Writes an HF model directory (config.json, float32 safetensors shards, and the imported
  generation_config.json) that transformers loads.

  `files` (the tokenizer's) are copied in. Everything goes into a temporary sibling directory first,
  renamed to `path` when complete, so a failed export leaves nothing behind. An existing `path` is
  replaced only with overwrite=True.
  """
  from safetensors.numpy import save_file
  from meshlm.fsutil import new_dir
  config = hf_config(cfg)
  with new_dir(path, overwrite=overwrite, hint="pass overwrite=True, or choose another directory") as tmp:
    current: dict[str, np.ndarray] = {}
    size, total = 0, 0
    written: list[tuple[str, list[str]]] = []

    def flush():
      nonlocal current, size
      if current:
        fname = f"part-{len(written):05d}.safetensors"
        save_file(current, str(tmp / fname), metadata={"format": "pt"})
        written.append((fname, list(current)))
      current, size = {}, 0

    for name, arr in hf_tensors(cfg, params):
      if current and size + arr.nbytes > max_shard_bytes:
        flush()
      current[name] = arr
      size += arr.nbytes
      total += arr.nbytes
    flush()
    # HF's naming: model.safetensors alone, or model-0000i-of-0000n.safetensors plus an index.
    n = len(written)
    if n == 1:
      os.rename(tmp / written[0][0], tmp / "model.safetensors")
    else:
      index = {"metadata": {"total_size": total}, "weight_map": {}}
      for i, (fname, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.rename(tmp / fname, tmp / final)
        for name in names:
          index["weight_map"][name] = final
      (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if cfg.model.generation_config is not None:
      (tmp / GENERATION_CONFIG).write_text(json.dumps(cfg.model.generation_config, indent=2) + "\n")
    for f in files:  # the tokenizer, copied along
      shutil.copyfile(f, tmp / Path(f).name)
  return Path(path)
