"""The splash kernel's blocks per phase, chosen from the chip's scoped VMEM (the `sa_block_*` and `splash_backward`
keys' `auto`), and the padded length the kernel runs.

The kernel (nn/splash_attention.py) runs three phases, each a Pallas grid whose every step holds its blocks in the
TensorCore's VMEM: the forward (q / kv / kv-compute blocks), the dkv backward (the same three; under the fused
backward it also writes dq) and, under the split backward, the dq kernel (q / kv). A step must fit the chip's scoped
VMEM limit (16 MiB on v4, v5e and v5p, 32 MiB on v6e: XLA's default `xla_tpu_scoped_vmem_limit_kib`), else Mosaic
refuses the program ("Scoped allocation with size 16.63M and limit 16.00M", a CompileTimeScopedVmemOom). `estimate`
counts a step's bytes: every in and out block twice (Mosaic double-buffers them), the scratch accumulators, and the
float32 score tiles the body keeps live (`TILES` of [block_q, block_kv_compute] per phase, one more with the soft-cap's
tanh) and what the batch rows the kernel is vmapped over add (`ROW_BYTES`). The coefficients are fitted to compiles of
the kernel alone for v5e through libtpu on a CPU (JAX 0.10.2 / libtpu 0.0.42.1, the chip's, and 0.12.0.1 / 0.0.50.1,
the lock's; benchmarks/splash_vmem.py and docs/tpu.md hold the table: at head_dim 256, bf16, segment ids, 4 rows,
the fused dkv kernel at 1024/1024/1024 needs more than 16 MiB), and the rows' share to the kernel inside the train
step on the chip, which needs more than alone (gemma3-4b at 4 rows: 1024/1024/512 refused there, 18.61 MiB).

`Rule.blocks` takes, per phase, the first of CANDIDATES (largest first) that fits and divides the padded length, a
key given as a number winning; `splash_backward=auto` is fused where the fused dkv kernel fits at blocks as large as
the split one's (it did at every shape measured: fused was faster at head_dim 128 and 256, seq 2048 and 8192).
"""
from __future__ import annotations

import dataclasses
import math
import re

LANES = 128  # the kernel's block lengths are multiples of the TPU's 128 lanes
SUBLANES = 8
MiB = 1 << 20
# The scoped VMEM limit per device kind (jax's device_kind): XLA's default. A kind not listed gets DEFAULT_VMEM.
SCOPED_VMEM = {"TPU v4": 16 * MiB, "TPU v5 lite": 16 * MiB, "TPU v5e": 16 * MiB, "TPU v5": 16 * MiB,
               "TPU v5p": 16 * MiB, "TPU v6 lite": 32 * MiB, "TPU v6e": 32 * MiB}
DEFAULT_VMEM = 16 * MiB
# (block_q, block_kv, block_kv_compute), largest first: 1024 was the fastest measured at head_dim 128, 512..1024
# alike at 256 (docs/tpu.md: the splash kernel alone); 2048 never fit a 16 MiB step with segment ids.
CANDIDATES = ((1024, 1024, 1024), (1024, 1024, 512), (1024, 512, 512), (512, 512, 512), (512, 512, 256),
              (256, 256, 256), (128, 128, 128))
# Float32 [block_q, block_kv_compute] score tiles a phase's body keeps live, fitted (module docstring); the soft-cap
# keeps one more (its tanh).
TILES = {"fwd": 1.0, "dkv": 1.75, "dq": 1.75}
SOFTCAP_TILES = 1.0
# The dkv kernel's step grows with the batch rows it is vmapped over: bytes of [block_q, qk] per row. Fitted to the
# kernel inside the train step on a v5e (JAX 0.10.2, libtpu 0.0.42.1; docs/tpu.md): gemma3-4b's h256 fused dkv at
# 1024/1024/512 ran at 1 row (seq 8192) and was refused at 4 (seq 2048: 18.61 MiB), qwen3-0.6b's h128 at
# 1024/1024/1024 ran at 8 rows, gemma2-2b's soft-capped h256 at 1024/512/512 at 4: any value in (1.25, 3.25] keeps
# those, 2.5 is past the middle (the kernel alone needs less: h256 1024/1024/512 fit at 4 rows compiled alone).
ROW_BYTES = {"fwd": 0, "dkv": 2.5, "dq": 0}
# The interpret-mode block (off TPU): the smallest the kernel takes, the least work per tile.
INTERPRET_BLOCK = LANES
KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
        "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The kernel's block lengths per phase (its BlockSizes): the forward's q / kv / kv-compute, the dkv kernel's
  q / kv / kv-compute, and the dq kernel's q / kv, which the fused backward (dq computed in the dkv kernel) has none
  of: q_dq and kv_dq None. `length`: the padded sequence the kernel runs (every block divides it)."""
  q: int
  kv: int
  kv_compute: int
  q_dkv: int
  kv_dkv: int
  kv_dkv_compute: int
  q_dq: int | None = None
  kv_dq: int | None = None
  length: int | None = None

  @property
  def fused(self) -> bool:
    return self.q_dq is None

  @property
  def backward(self) -> str:
    return "fused" if self.fused else "split"

  def as_dict(self) -> dict:
    """{"fwd": [q, kv, kv_compute], "dkv": [...], "dq": [q, kv] or None, "backward", "length"}: the reports'."""
    return {"fwd": [self.q, self.kv, self.kv_compute], "dkv": [self.q_dkv, self.kv_dkv, self.kv_dkv_compute],
            "dq": None if self.fused else [self.q_dq, self.kv_dq], "backward": self.backward, "length": self.length}

  def describe(self) -> str:
    """"fwd 1024/1024/512 dkv 1024/1024/512 fused" (or "... dq 1024/1024"): one line of a report."""
    slash = lambda bs: "/".join(str(b) for b in bs)  # noqa: E731
    d = self.as_dict()
    return f"fwd {slash(d['fwd'])} dkv {slash(d['dkv'])} " + ("fused" if self.fused else f"dq {slash(d['dq'])}")


def estimate(phase: str, bq: int, bkv: int, bkvc: int, qk: int, v: int, itemsize: int, segments: bool,
             softcap: bool, fused: bool = False, rows: int = 1) -> int:
  """The scoped VMEM bytes one grid step of `phase` (fwd | dkv | dq) holds: its in and out blocks twice
  (double-buffered), its scratch, TILES float32 [bq, bkvc] score tiles (the dq kernel's compute block is its kv
  block) and ROW_BYTES of [bq, qk] per batch row. fused: the dkv kernel also writes dq (and accumulates it in float32
  when bkvc < bkv)."""
  s, f32, i32 = itemsize, 4, 4
  if phase == "fwd":
    blocks = bq * qk * s + bkv * qk * s + bkv * v * s + bq * v * s + bq * LANES * f32  # q, k, v, out, lse
    blocks += (bq * LANES + SUBLANES * bkv) * i32 if segments else 0
    scratch = 2 * bq * LANES * f32 + bq * v * f32  # the running max and sum, the output
  elif phase == "dkv":
    blocks = bq * qk * s + bkv * qk * s + bkv * v * s + bq * v * s + 3 * SUBLANES * bq * f32  # q, k, v, do, lse, di
    blocks += bkv * qk * s + bkv * v * s + (bq * qk * s if fused else 0)  # dk, dv (dq)
    blocks += (SUBLANES * bq + bkv * LANES) * i32 if segments else 0
    scratch = bkv * qk * f32 + bkv * v * f32 + (bq * qk * f32 if fused and bkvc < bkv else 0)
  else:
    bkvc = bkv
    blocks = bq * qk * s + bkv * qk * s + bkv * v * s + bq * v * s + 2 * SUBLANES * bq * f32 + bq * qk * s
    blocks += (bq * LANES + SUBLANES * bkv) * i32 if segments else 0
    scratch = bq * qk * f32
  tiles = (TILES[phase] + (SOFTCAP_TILES if softcap else 0.0)) * bq * bkvc * f32
  return int(2 * blocks + scratch + tiles + ROW_BYTES[phase] * bq * qk * rows)


def padded_length(length: int, block: int = 1024) -> int:
  """The sequence length the kernel runs: `length` padded to a multiple of the largest of block, block / 2, ...,
  LANES that wastes at most an eighth of it (so a ragged length keeps large blocks: 2,176 runs as 2,304 in 256-blocks,
  not as 2,176 in 128-blocks), LANES at least."""
  b = block
  while b > LANES and (-length % b) * 8 > length:
    b //= 2
  b = max(b, LANES)
  return length + (-length % b)


def _fit(length: int, b: int) -> int:
  """b if it divides the padded length, else the largest multiple of LANES dividing both (one block if shorter)."""
  return length if length <= b else math.gcd(length, b)


@dataclasses.dataclass(frozen=True)
class Rule:
  """The inputs of the block choice for one program: the sequence `length` as the model gives it, on TPU (else
  interpret mode: INTERPRET_BLOCK everywhere), the compute dtype's itemsize, segment ids given, the chip's scoped
  `vmem` bytes, the batch `rows` per device the kernel is vmapped over, splash_backward and the sa_block_* keys
  ((key, int) for those given as numbers)."""
  length: int
  on_tpu: bool = True
  itemsize: int = 2
  segments: bool = True
  vmem: int = DEFAULT_VMEM
  rows: int = 1
  backward: str = "auto"
  keys: tuple[tuple[str, int], ...] = ()

  @property
  def padded(self) -> int:
    return padded_length(self.length, max(CANDIDATES[0]) if self.on_tpu else INTERPRET_BLOCK)

  def _phase(self, phase: str, keys: tuple[str, ...], qk: int, v: int, softcap: bool, fused: bool) -> tuple:
    """The phase's blocks: the keys given, else the first candidate that fits the scoped VMEM (the smallest if
    none does: Mosaic then names the kernel, and the verdict the key)."""
    given = dict(self.keys)
    T = self.padded
    n = len(keys)
    fits = []
    for cand in CANDIDATES if self.on_tpu else ((INTERPRET_BLOCK,) * 3,):
      bs = tuple(_fit(T, given.get(k, b)) for k, b in zip(keys, cand[:n]))
      full = bs + (bs[1],) * (3 - n)
      if self.on_tpu and estimate(phase, *full, qk, v, self.itemsize, self.segments, softcap, fused,
                                  self.rows) > self.vmem:
        continue
      fits.append(bs)
      break
    return fits[0] if fits else bs

  def blocks(self, qk: int, v: int, softcap: bool) -> Blocks:
    """The blocks of every phase for one attention shape (q/k and v head dims, soft-capped)."""
    fwd = self._phase("fwd", KEYS[:3], qk, v, softcap, False)
    fused = self._phase("dkv", KEYS[3:6], qk, v, softcap, True)
    split = self._phase("dkv", KEYS[3:6], qk, v, softcap, False)
    if self.backward == "fused" or (self.backward == "auto" and fused[0] * fused[2] >= split[0] * split[2]):
      return Blocks(*fwd, *fused, length=self.padded)
    dq = self._phase("dq", KEYS[6:], qk, v, softcap, False)
    return Blocks(*fwd, *split, *dq, length=self.padded)


# A phase's keys, the one to lower first first: the compute block (its score tiles are most of a step), then the
# query block, then the key block. Mosaic names the phases' kernels splash_mha_fwd..., splash_mha_dkv...,
# splash_mha_dq... (splash_mqa_* alike) and records each kernel's blocks by the key's name without "sa_".
PHASE_KEYS = {"fwd": ("sa_block_kv_compute", "sa_block_q", "sa_block_kv"),
              "dkv": ("sa_block_kv_dkv_compute", "sa_block_q_dkv", "sa_block_kv_dkv"),
              "dq": ("sa_block_kv_dq", "sa_block_q_dq")}
_KERNEL = re.compile(r"^splash_m[hq]a_(fwd|dkv|dq)")


def vmem_advice(kernel: str, blocks: dict[str, int]) -> dict | None:
  """What to change when the compiler refuses `kernel` (Mosaic's kernel name) for scoped VMEM: {"kernel":
  "splash", "phase": fwd | dkv | dq, "key": "sa_block_...=N"}, the phase's first block above LANES halved (its
  value from `blocks`, the kernel's recorded block sizes), or None for a kernel that is not the splash kernel's."""
  m = _KERNEL.match(kernel)
  if m is None:
    return None
  phase = m.group(1)
  keys = PHASE_KEYS[phase]
  for key in keys:
    b = blocks.get(key.removeprefix("sa_"))
    if b is not None and b > LANES:
      return {"kernel": "splash", "phase": phase, "key": f"{key}={max(b // 2, LANES)}"}
  return {"kernel": "splash", "phase": phase, "key": f"{keys[0]}={LANES}" + (
      " or splash_backward=split" if phase == "dkv" else "")}


def scoped_vmem(device_kind: str | None) -> int:
  """The scoped VMEM limit of a device kind (SCOPED_VMEM), DEFAULT_VMEM for one not listed or unknown."""
  return SCOPED_VMEM.get(device_kind or "", DEFAULT_VMEM)
