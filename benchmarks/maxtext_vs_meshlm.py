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

from startup_and_step import launch, print_table  # the same directory

MESHLM = os.path.join(os.path.dirname(sys.executable), "meshlm")
MESHLM_BASE = ["model=llama2-tiny", "cpu_devices=4", "mesh.fsdp=4", "train.per_device_batch_size=1",
               "train.seq_len=128", "train.sample_tokens=0", "data.source=synthetic"]
MAXTEXT_BASE = ["dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=128",
                "base_emb_dim=256", "base_num_decoder_layers=2", "base_num_query_heads=8", "base_num_kv_heads=4",
                "head_dim=32", "base_mlp_dim=768", "vocab_size=512", "ici_fsdp_parallelism=4", "hardware=cpu",
                "enable_checkpointing=false", "attention=dot_product", "weight_dtype=float32",
                "skip_jax_distributed_system=true",
                "jax_cache_dir="]  # no persistent compile cache: every launch compiles, as meshlm's do
MAXTEXT_ENV = {"DECOUPLE_GCLOUD": "TRUE", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_PLATFORMS": "cpu"}
ARMS = {  # name -> (trainer, extra keys)
    "meshlm, float32 (preset: unrolled)": ("meshlm", []),
    "meshlm, bfloat16, scanned": ("meshlm", ["train.compute_dtype=bfloat16", "scan_layers=true"]),
    "MaxText, float32, scanned": ("maxtext", ["dtype=float32", "scan_layers=true"]),
    "MaxText, float32, unrolled": ("maxtext", ["dtype=float32", "scan_layers=false"]),
    "MaxText, bfloat16, scanned (its defaults)": ("maxtext", ["dtype=bfloat16", "scan_layers=true"]),
}
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")


def run_meshlm(extra: list[str], steps: int, binary: str = MESHLM) -> tuple[float, list[float]]:
  return launch([*MESHLM_BASE, *extra], steps, binary)


def run_maxtext(python: str, config: str, extra: list[str], steps: int) -> tuple[float, list[float]]:
  with tempfile.TemporaryDirectory() as out:
    cmd = [python, "-m", "maxtext.trainers.pre_train.train", config, "run_name=bench", f"base_output_directory={out}",
           f"steps={steps}", *MAXTEXT_BASE, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **MAXTEXT_ENV}, cwd=out)
    first, times, tail = None, {}, []
    for line in proc.stdout:
      tail = (tail + [line])[-40:]
      m = STEP_LINE.search(line)
      if m:
        if first is None:
          first = time.perf_counter() - t0
        times[int(m.group(1))] = float(m.group(2))
    if proc.wait():
      raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(tail)}")
    if first is None:
      raise SystemExit(f"no 'completed step' lines from MaxText:\n{''.join(tail)}")
    return first, [times[k] for k in sorted(times)]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--maxtext-python", required=True, help="the python of a virtualenv with maxtext installed")
  ap.add_argument("--maxtext-config", help="MaxText's base.yml (default: the installed package's)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--skip", type=int, default=5, help="leading steps left out of each run's median")
  ap.add_argument("--other-meshlm", help="a meshlm command installed beside another JAX (e.g. MaxText's "
                  "virtualenv, `pip install --no-deps .` there): adds its float32 preset arm")
  args = ap.parse_args()
  arms = dict(ARMS)
  if args.other_meshlm:
    other = os.path.join(os.path.dirname(args.other_meshlm), "python")
    jax_version = subprocess.run([other, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    arms = {**{k: v for k, v in ARMS.items() if k.startswith("meshlm")},
            f"meshlm on jax {jax_version}, float32 (preset)": ("other-meshlm", []),
            **{k: v for k, v in ARMS.items() if not k.startswith("meshlm")}}
  config = args.maxtext_config or glob.glob(os.path.join(
      os.path.dirname(os.path.dirname(args.maxtext_python)), "lib", "python3*", "site-packages", "maxtext", "configs",
      "base.yml"))[0]
  version = subprocess.run([args.maxtext_python, "-c", "import importlib.metadata as m; print(m.version('maxtext'), "
                            "m.version('jax'))"], capture_output=True, text=True, check=True).stdout.split()
  print(f"meshlm: {' '.join(MESHLM_BASE)} train.steps={args.steps}; MaxText {version[0]} (jax {version[1]}): "
        f"{' '.join(MAXTEXT_BASE)} steps={args.steps}; {args.reps} reps, arms interleaved, median of steps "
        f">= {args.skip} per run")
  results = {name: ([], []) for name in arms}
  for _ in range(args.reps):
    for name, (trainer, extra) in arms.items():
      if trainer == "meshlm":
        first, times = run_meshlm(extra, args.steps)
      elif trainer == "other-meshlm":
        first, times = run_meshlm(extra, args.steps, args.other_meshlm)
      else:
        first, times = run_maxtext(args.maxtext_python, config, extra, args.steps)
      results[name][0].append(first)
      results[name][1].append(statistics.median(times[args.skip:]))
      print(f"  {name}: first step {first:.2f} s, step {results[name][1][-1]:.4f} s", file=sys.stderr)
  print_table(results, ratio_to="MaxText, bfloat16, scanned (its defaults)")

if __name__ == "__main__":
  main()
