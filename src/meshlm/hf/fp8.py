"""Block-quantized fp8 checkpoints (DeepSeek-V3's): read as float32, block by block.

The published DeepSeek-V3 checkpoint stores each linear weight of its layers (not the router, the norms, the
embeddings or the head) as float8_e4m3fn, `W` [out, in], beside `W_scale_inv` [ceil(out / 128), ceil(in / 128)]:
block (r, c) of the weight times scale_inv[r, c] is the weight (config.json's `quantization_config`: quant_method
"fp8", fmt "e4m3", weight_block_size [128, 128]). The last row and column blocks may be partial
(kv_a_proj_with_mqa has 576 = 4.5 x 128 rows). Later releases round every scale to a power of two (`scale_fmt`
"ue8m0"), stored as float32 or as the exponent byte itself (safetensors F8_E8M0).

safetensors' NumPy API returns no float8 arrays, so `RawTensors` reads such tensors from the file's own layout (an
8-byte header size, a JSON header, the bytes), memory-mapped: a slice reads only its rows. `dequantize` reads a
[rows, cols] slice of a weight and only the scale blocks that cover it, so import reads each device's slice of an
fp8 checkpoint as it does of a float one. A weight without its scale tensor is refused, never read as raw fp8.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from meshlm.errors import ConfigError

WEIGHT = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
# safetensors dtype -> the NumPy (ml_dtypes) type of the tensors meshlm reads itself.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu}
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
SCALE_FORMATS = (None, "ue8m0")


@dataclasses.dataclass(frozen=True)
class Scheme:
  """config.json's fp8 quantization_config: the block [rows, cols] one scale covers, and whether the scales are
  powers of two (ue8m0)."""
  block: tuple[int, int]
  ue8m0: bool = False


def scheme(hf: dict, where: str) -> Scheme | None:
  """The checkpoint's fp8 scheme, None when it is not quantized; any other quantization is refused."""
  q = hf.get("quantization_config")
  if q is None:
    return None
  key = f"{where}: quantization_config"
  if not isinstance(q, dict):
    raise ConfigError(f"{key} must be an object, got {q!r}")
  if q.get("quant_method") != "fp8":
    raise ConfigError(f"{key}.quant_method={q.get('quant_method')!r} is not supported (meshlm reads fp8 "
                      "block-quantized checkpoints; dequantize others first)")
  if q.get("fmt", "e4m3") != "e4m3":
    raise ConfigError(f"{key}.fmt={q.get('fmt')!r} is not supported (expected e4m3)")
  block = q.get("weight_block_size")
  if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
    raise ConfigError(f"{key}.weight_block_size={block!r}: expected [rows, cols] of positive ints, e.g. [128, 128]")
  if q.get("scale_fmt") not in SCALE_FORMATS:
    raise ConfigError(f"{key}.scale_fmt={q.get('scale_fmt')!r} is not supported (expected ue8m0 or none)")
  return Scheme((block[0], block[1]), q.get("scale_fmt") == "ue8m0")


def scale_name(name: str) -> str:
  return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


class RawTensors:
  """Tensors read from safetensors files' own layout, memory-mapped, as NumPy arrays of their stored dtype."""

  def __init__(self):
    self._files: dict[Path, tuple[np.memmap, dict, int]] = {}

  def _file(self, path: Path):
    if path not in self._files:
      with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
      self._files[path] = (np.memmap(path, dtype=np.uint8, mode="r"), header, 8 + n)
    return self._files[path]

  def array(self, path: Path, name: str) -> np.ndarray:
    data, header, start = self._file(path)
    meta = header[name]
    if meta["dtype"] not in RAW_DTYPES:
      raise ConfigError(f"tensor {name}: dtype {meta['dtype']} is not one meshlm reads raw")
    begin, end = meta["data_offsets"]
    return data[start + begin:start + end].view(RAW_DTYPES[meta["dtype"]]).reshape(meta["shape"])


def check(name: str, shape: tuple[int, ...], scheme_: Scheme | None, has, info) -> str:
  """Before anything is read: an fp8 weight `name` of `shape` has its scale tensor, of the block grid's shape and a
  scale dtype. Returns the scale tensor's name. `has(name)` / `info(name) -> (shape, dtype)` ask the checkpoint."""
  if scheme_ is None:
    raise ConfigError(f"tensor {name}: dtype {WEIGHT}, but config.json has no fp8 quantization_config to say how "
                      "it is scaled")
  if len(shape) != 2:
    raise ConfigError(f"tensor {name}: an fp8 weight of shape {list(shape)}; meshlm dequantizes 2-D weights only")
  scale = scale_name(name)
  if not has(scale):
    raise ConfigError(f"tensor {name}: fp8 weights without their scale tensor {scale}, which the checkpoint lacks "
                      "(meshlm never loads raw fp8 values)")
  got, dtype = info(scale)
  want = scale_shape(shape, scheme_.block)
  if tuple(got) != want:
    raise ConfigError(f"tensor {scale}: shape {list(got)}, but {name} {list(shape)} in blocks of "
                      f"{list(scheme_.block)} implies {list(want)}")
  if dtype not in SCALE_DTYPES:
    raise ConfigError(f"tensor {scale}: dtype {dtype}; expected one of {', '.join(SCALE_DTYPES)}")
  return scale


def dequantize(weight: np.ndarray, scales: Callable[[slice, slice], np.ndarray], rows: slice, cols: slice,
               scheme_: Scheme, name: str) -> np.ndarray:
  """weight[rows, cols] as float32: each element times its block's scale. `weight` is the stored
  float8_e4m3fn tensor (memory-mapped) and `scales(row blocks, col blocks)` those blocks' float32 scales; only the
  slice and the scale blocks that cover it are read."""
  (r0, r1, _), (c0, c1, _) = rows.indices(weight.shape[0]), cols.indices(weight.shape[1])
  br, bc = scheme_.block
  s = scales(slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc)))  # [row blocks, col blocks]
  if scheme_.ue8m0 and not np.all(np.frexp(s)[0] == 0.5):
    raise ConfigError(f"tensor {scale_name(name)}: scale_fmt is ue8m0, but it holds scales that are not powers of two")
  full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)  # [row blocks * br, col blocks * bc]
  block = full[r0 - (r0 // br) * br:r1 - (r0 // br) * br, c0 - (c0 // bc) * bc:c1 - (c0 // bc) * bc]
  return np.asarray(weight[r0:r1, c0:c1]).astype(np.float32) * block
