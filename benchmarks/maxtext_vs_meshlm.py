"""meshlm and MaxText back to back at MaxText's CPU reference geometry, as fresh processes.

Geometry: embed 256, 2 layers, 8 query / 4 KV heads of 32, MLP 768, vocab 512, seq 128, global
batch 4 on 4 fake CPU devices with fsdp=4, synthetic data. Each rep launches every arm once (arms
interleaved), reads each step's time from the trainer's own record (meshlm: `step_time_s` in
metrics.jsonl; MaxText: its "completed step: N, seconds: X" log lines), and takes the median over
steps 5 to the end. Start to first step is timed from launch to the first step record.

MaxText is not a meshlm dependency: install it in its own virtualenv (it needs Python >= 3.12):

  python3.12 -m venv /tmp/mtvenv
  /tmp/mtvenv/bin/pip install maxtext==0.2.5 --no-deps
  /tmp/mtvenv/bin/pip install jax jaxlib flax optax orbax-checkpoint grain pathwaysutils absl-py \
      omegaconf pydantic tensorboardx sentencepiece tiktoken jaxtyping qwix aqtp drjax chex \
      ml-collections jsonlines pyyaml jinja2 tokamax huggingface_hub transformers pillow sympy

  .venv/bin/python benchmarks/maxtext_vs_meshlm.py --maxtext-python /tmp/mtvenv/bin/python --reps 3

With --other-meshlm /tmp/mtvenv/bin/meshlm (meshlm installed there with `pip install --no-deps .`)
it adds an arm of meshlm on MaxText's JAX, to separate the trainers from the JAX versions.

--geometry compute: a compute-bound geometry, where the step is mostly matmuls: embed 512, MLP 1376,
4 layers, 8 query and 8 KV heads of 64, vocab 4096, seq 256, global batch 8 (2 per device) on 4
fake devices with fsdp=4, float32 in both trainers, scanned and unrolled. Every run also measures
a matmul peak in the same process that launches the arms (a jitted float32 [n, n] @ [n, n] at
--peak-sizes, median FLOP/s per size, the best size taken as the peak; once before the arms and
once after, the higher of the two is the peak) and reports each arm's model FLOP/s (flops_per_token:
6 x matmul parameters + 6 x layers x heads x head_dim x seq per token: causal attention halved as
Megatron and MaxText count it, the embedding lookup not counted) and its MFU against that peak;
MaxText's own count's split (attention against weights, from its start-up log) is printed beside
this script's as a check of the convention.

  .venv/bin/python benchmarks/maxtext_vs_meshlm.py --geometry compute --maxtext-python /tmp/mtvenv/bin/python \
      --reps 3 --steps 20 --skip 5
  .venv/bin/python benchmarks/maxtext_vs_meshlm.py --geometry compute --smoke   # meshlm only, 1 rep of 3 steps

Without --maxtext-python only the meshlm arms run, and the output says so. --only TEXT (repeatable)
keeps the arms whose name contains TEXT.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from startup_and_step import launch  # the same directory

MESHLM = os.path.join(os.path.dirname(sys.executable), "meshlm")
DEVICES = 4  # fake CPU devices, all on the fsdp axis, in both trainers
# The model and batch of each geometry, in one place; both trainers' keys are derived from it.
GEOMETRIES = {
    "reference": dict(embed=256, mlp=768, layers=2, heads=8, kv_heads=4, head_dim=32, vocab=512, seq=128,
                      per_device_batch=1),
    "compute": dict(embed=512, mlp=1376, layers=4, heads=8, kv_heads=8, head_dim=64, vocab=4096, seq=256,
                    per_device_batch=2),
}
MAXTEXT_COMMON = ["dataset_type=synthetic", f"ici_fsdp_parallelism={DEVICES}", "hardware=cpu",
                  "enable_checkpointing=false", "attention=dot_product", "weight_dtype=float32",
                  "skip_jax_distributed_system=true",
                  "jax_cache_dir="]  # no persistent compile cache: every launch compiles, as meshlm's do


def meshlm_base(g: dict) -> list[str]:
  """meshlm keys for geometry g: llama2-tiny's llama layers at g's sizes."""
  return ["model=llama2-tiny", f"cpu_devices={DEVICES}", f"mesh.fsdp={DEVICES}",
          f"train.per_device_batch_size={g['per_device_batch']}", f"train.seq_len={g['seq']}", "train.sample_tokens=0",
          "data.source=synthetic", f"model.embed_dim={g['embed']}", f"model.mlp_dim={g['mlp']}",
          f"model.num_layers={g['layers']}", f"model.num_heads={g['heads']}", f"model.num_kv_heads={g['kv_heads']}",
          f"model.head_dim={g['head_dim']}", f"model.vocab_size={g['vocab']}"]


def maxtext_base(g: dict) -> list[str]:
  return [*MAXTEXT_COMMON[:1], f"per_device_batch_size={g['per_device_batch']}", f"max_target_length={g['seq']}",
          f"base_emb_dim={g['embed']}", f"base_num_decoder_layers={g['layers']}", f"base_num_query_heads={g['heads']}",
          f"base_num_kv_heads={g['kv_heads']}", f"head_dim={g['head_dim']}", f"base_mlp_dim={g['mlp']}",
          f"vocab_size={g['vocab']}", *MAXTEXT_COMMON[1:]]


MESHLM_BASE = meshlm_base(GEOMETRIES["reference"])
MAXTEXT_BASE = maxtext_base(GEOMETRIES["reference"])
MAXTEXT_ENV = {"DECOUPLE_GCLOUD": "TRUE", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_PLATFORMS": "cpu"}
ARMS = {  # name -> (trainer, extra keys)
    "meshlm, float32 (preset: unrolled)": ("meshlm", []),
    "meshlm, bfloat16, scanned": ("meshlm", ["train.compute_dtype=bfloat16", "scan_layers=true"]),
    "MaxText, float32, scanned": ("maxtext", ["dtype=float32", "scan_layers=true"]),
    "MaxText, float32, unrolled": ("maxtext", ["dtype=float32", "scan_layers=false"]),
    "MaxText, bfloat16, scanned (its defaults)": ("maxtext", ["dtype=bfloat16", "scan_layers=true"]),
}
# The compute geometry: float32 in both, scanned and unrolled in both.
COMPUTE_ARMS = {
    "meshlm, float32, unrolled": ("meshlm", ["train.compute_dtype=float32", "scan_layers=false"]),
    "meshlm, float32, scanned": ("meshlm", ["train.compute_dtype=float32", "scan_layers=true"]),
    "MaxText, float32, scanned": ("maxtext", ["dtype=float32", "scan_layers=true"]),
    "MaxText, float32, unrolled": ("maxtext", ["dtype=float32", "scan_layers=false"]),
}
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")
# MaxText prints its own model-FLOP count at start-up (calculate_tflops_training_per_device): the total
# to 2 decimals of a TFLOP (too coarse at CPU sizes) and its split to 0.01%, which is what is checked.
SPLIT_LINE = re.compile(r"split as ([\d.]+)% learnable weight flops and ([\d.]+)% attention flops")
MAXTEXT_SPLIT: dict[str, float] = {}  # MaxText's attention share of its model FLOPs (%), by the arm's keys


def flops_per_token(g: dict, causal: bool = True) -> float:
  """Model FLOPs of one training token (forward + backward) for geometry g: 6 x the matmul
  parameters a token meets (per layer q, k, v, o and the gated MLP's three; the LM head) + 12 x
  layers x heads x head_dim x seq for the attention scores and values (PaLM's count: forward 2 x
  seq x heads x head_dim each), halved for the causal mask when causal (the Megatron / MaxText
  convention, so MaxText's own TFLOP/s is comparable). Norms, softmax, rotary and the embedding
  lookup are not counted."""
  d, hd = g["embed"], g["head_dim"]
  per_layer = d * g["heads"] * hd + 2 * d * g["kv_heads"] * hd + g["heads"] * hd * d + 3 * d * g["mlp"]
  matmul_params = g["layers"] * per_layer + d * g["vocab"]
  attention = 12.0 * g["layers"] * g["heads"] * hd * g["seq"]
  return 6.0 * matmul_params + (attention / 2 if causal else attention)


def flops_per_step(g: dict) -> float:
  return flops_per_token(g) * g["per_device_batch"] * DEVICES * g["seq"]


def mfu(step_flops: float, step_s: float, peak_flops_per_s: float) -> tuple[float, float]:
  """(model FLOP/s, MFU) of a step of step_flops model FLOPs taking step_s, against the peak."""
  rate = step_flops / step_s
  return rate, rate / peak_flops_per_s


def matmul_peak(sizes=(1024, 2048, 4096), reps: int = 5) -> dict:
  """{"per_size": {n: median FLOP/s}, "peak": the best size's}: a jitted float32 [n, n] @ [n, n] on
  this process's default device (XLA:CPU spreads one dot over every core), 2 n^3 FLOPs each."""
  import jax
  import jax.numpy as jnp
  per_size = {}
  mm = jax.jit(lambda a, b: a @ b)
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm(a, b).block_until_ready()  # compile and warm up
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      mm(a, b).block_until_ready()
      times.append(time.perf_counter() - t0)
    per_size[n] = 2.0 * n**3 / statistics.median(times)
  return {"per_size": per_size, "peak": max(per_size.values())}


def parse_step_line(line: str) -> tuple[int, float] | None:
  """A MaxText "completed step" log line -> (step, seconds); None for any other line."""
  m = STEP_LINE.search(line)
  return (int(m.group(1)), float(m.group(2))) if m else None


def attention_share(g: dict, causal: bool = True) -> float:
  """The attention scores and values' share of flops_per_token, in % (MaxText prints its own)."""
  weights = flops_per_token(g, causal=False) - 12.0 * g["layers"] * g["heads"] * g["head_dim"] * g["seq"]
  return 100.0 * (flops_per_token(g, causal) - weights) / flops_per_token(g, causal)


def run_meshlm(extra: list[str], steps: int, binary: str = MESHLM, base: list[str] | None = None) -> tuple[float, list[float]]:
  return launch([*(MESHLM_BASE if base is None else base), *extra], steps, binary)


def run_maxtext(python: str, config: str, extra: list[str], steps: int, base: list[str] | None = None) -> tuple[float, list[float]]:
  with tempfile.TemporaryDirectory() as out:
    cmd = [python, "-m", "maxtext.trainers.pre_train.train", config, "run_name=bench", f"base_output_directory={out}",
           f"steps={steps}", *(MAXTEXT_BASE if base is None else base), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **MAXTEXT_ENV}, cwd=out)
    first, times, tail = None, {}, []
    for line in proc.stdout:
      tail = (tail + [line])[-40:]
      parsed = parse_step_line(line)
      if parsed:
        if first is None:
          first = time.perf_counter() - t0
        times[parsed[0]] = parsed[1]
      split = SPLIT_LINE.search(line)
      if split:
        MAXTEXT_SPLIT[" ".join(extra)] = float(split.group(2))
    if proc.wait():
      raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(tail)}")
    if first is None:
      raise SystemExit(f"no 'completed step' lines from MaxText:\n{''.join(tail)}")
    return first, [times[k] for k in sorted(times)]


def spread(xs: list[float]) -> float:
  return (max(xs) - min(xs)) / statistics.median(xs)


def mfu_table(results: dict[str, tuple[list[float], list[float]]], ratio_to: str, step_flops: float,
              peak: float) -> str:
  """Markdown: per arm the medians and spreads of (start-to-first-step, per-run step times), the step
  against ratio_to's, and the model FLOP/s and MFU of the median step against the peak."""
  base = statistics.median(results[ratio_to][1])
  lines = [f"| arm | start to first step (median, s) | spread | step time (median of per-run medians, s) | spread | "
           f"step vs {ratio_to} | model GFLOP/s | MFU |", "| --- " * 8 + "|"]
  for name, (firsts, steps) in results.items():
    step = statistics.median(steps)
    rate, frac = mfu(step_flops, step, peak)
    lines.append(f"| {name} | {statistics.median(firsts):.2f} | {spread(firsts):.1%} | {step:.4f} | {spread(steps):.1%} | "
                 f"{step / base:.3f} | {rate / 1e9:.1f} | {frac:.1%} |")
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="reference")
  ap.add_argument("--maxtext-python", help="the python of a virtualenv with maxtext installed (without it: meshlm "
                  "arms only)")
  ap.add_argument("--maxtext-config", help="MaxText's base.yml (default: the installed package's)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--skip", type=int, default=5, help="leading steps left out of each run's median")
  ap.add_argument("--peak-sizes", default="1024,2048,4096", help="matmul sizes n of the peak measurement")
  ap.add_argument("--only", action="append", help="keep the arms whose name contains this text (repeatable; e.g. "
                  "'unrolled' or 'MaxText, float32, scanned')")
  ap.add_argument("--smoke", action="store_true", help="1 rep of 3 steps (median of steps >= 1), peak at n=1024 only")
  ap.add_argument("--other-meshlm", help="a meshlm command installed beside another JAX (e.g. MaxText's "
                  "virtualenv, `pip install --no-deps .` there): adds its float32 preset arm")
  args = ap.parse_args()
  if args.smoke:
    args.reps, args.steps, args.skip, args.peak_sizes = 1, 3, 1, "1024"
  if args.skip >= args.steps:
    print(f"--skip {args.skip} must be below --steps {args.steps}", file=sys.stderr)
    sys.exit(2)
  g = GEOMETRIES[args.geometry]
  mesh_base, mt_base = meshlm_base(g), maxtext_base(g)
  arms = dict(ARMS if args.geometry == "reference" else COMPUTE_ARMS)
  if not args.maxtext_python:
    arms = {k: v for k, v in arms.items() if v[0] == "meshlm"}
  if args.only:
    arms = {k: v for k, v in arms.items() if any(w in k for w in args.only)}
    if not arms:
      print(f"--only {' / '.join(args.only)}: no arm's name contains it; arms: "
            f"{'; '.join(ARMS if args.geometry == 'reference' else COMPUTE_ARMS)}", file=sys.stderr)
      sys.exit(2)
  if args.other_meshlm:
    other = os.path.join(os.path.dirname(args.other_meshlm), "python")
    jax_version = subprocess.run([other, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    first_extra = next(iter(arms.values()))[1]
    arms = {**{k: v for k, v in arms.items() if k.startswith("meshlm")},
            f"meshlm on jax {jax_version}, float32 ({'preset' if args.geometry == 'reference' else 'unrolled'})":
                ("other-meshlm", first_extra),
            **{k: v for k, v in arms.items() if not k.startswith("meshlm")}}
  if args.maxtext_python:
    config = args.maxtext_config or glob.glob(os.path.join(
        os.path.dirname(os.path.dirname(args.maxtext_python)), "lib", "python3*", "site-packages", "maxtext", "configs",
        "base.yml"))[0]
    version = subprocess.run([args.maxtext_python, "-c", "import importlib.metadata as m; print(m.version('maxtext'), "
                              "m.version('jax'))"], capture_output=True, text=True, check=True).stdout.split()
    maxtext = f"MaxText {version[0]} (jax {version[1]}): {' '.join(mt_base)} steps={args.steps}"
  else:
    config, maxtext = None, "MaxText: not run (no --maxtext-python)"
  step_flops = flops_per_step(g)
  sizes = tuple(int(n) for n in args.peak_sizes.split(","))
  print(f"geometry {args.geometry}: {g}; model FLOPs per step {step_flops:.4g} "
        f"({flops_per_token(g):.4g} per token x {g['per_device_batch'] * DEVICES * g['seq']} tokens)")
  print(f"meshlm: {' '.join(mesh_base)} train.steps={args.steps}; {maxtext}; {args.reps} reps, arms interleaved, "
        f"median of steps >= {args.skip} per run")
  peaks = [matmul_peak(sizes)]
  results = {name: ([], []) for name in arms}
  for _ in range(args.reps):
    for name, (trainer, extra) in arms.items():
      if trainer == "meshlm":
        first, times = run_meshlm(extra, args.steps, base=mesh_base)
      elif trainer == "other-meshlm":
        first, times = run_meshlm(extra, args.steps, args.other_meshlm, base=mesh_base)
      else:
        first, times = run_maxtext(args.maxtext_python, config, extra, args.steps, base=mt_base)
      results[name][0].append(first)
      results[name][1].append(statistics.median(times[args.skip:]))
      print(f"  {name}: first step {first:.2f} s, step {results[name][1][-1]:.4f} s", file=sys.stderr)
  peaks.append(matmul_peak(sizes))
  peak = max(p["peak"] for p in peaks)
  print("float32 matmul peak (median GFLOP/s per size, before / after the arms): "
        + "; ".join(f"n={n}: {peaks[0]['per_size'][n] / 1e9:.1f} / {peaks[1]['per_size'][n] / 1e9:.1f}" for n in sizes)
        + f"; peak used: {peak / 1e9:.1f} GFLOP/s")
  ratio_to = ("MaxText, bfloat16, scanned (its defaults)" if args.geometry == "reference" else
              "MaxText, float32, scanned")
  ratio_to = ratio_to if ratio_to in arms else next(iter(arms))
  print(mfu_table(results, ratio_to, step_flops, peak))
  for arm_keys, share in MAXTEXT_SPLIT.items():
    print(f"attention's share of the model FLOPs: MaxText's own count ({arm_keys}) {share:.2f}%, this script's "
          f"{attention_share(g):.2f}% (causal halved; {attention_share(g, causal=False):.2f}% if not)")


if __name__ == "__main__":
  main()
