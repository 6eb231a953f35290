"""Tokens/s of the data pipeline alone: make_dataset -> next(), no model, no device transfer.

The training loop needs a batch per step, so the pipeline must out-run training by a wide margin
(issue 5 asks for >= 20x the tokens/s of training llama2-tiny). Defaults are llama2-tiny's shapes:
global batch 16, seq_len 128, data.source=stdlib, byte tokenizer. Each rep builds a fresh iterator,
discards --warmup batches (thread pool start, first reads) and times --batches more. Prints a markdown
table row with the median tokens/s and the spread between reps ((max - min) / median).

  .venv/bin/python benchmarks/data_throughput.py --reps 5
  .venv/bin/python benchmarks/data_throughput.py data.source=jsonl data.path='corpus/*.jsonl' \
      data.tokenizer=tokenizer.json model.vocab_size=32000
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The pipeline is host-only; keep JAX (imported by meshlm.config's callers) off any accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from meshlm.config import load_config  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.train.data import make_dataset  # noqa: E402


def one_rep(cfg, batch: int, seq_len: int, warmup: int, batches: int) -> float:
  it = make_dataset(cfg, global_batch=batch, seq_len=seq_len)
  for _ in range(warmup):
    next(it)
  t0 = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batch * seq_len * batches / (time.perf_counter() - t0)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("overrides", nargs="*", help="config key=value, as on the meshlm command line")
  ap.add_argument("--batch", type=int, default=16, help="global batch (llama2-tiny: 16)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=20)
  ap.add_argument("--batches", type=int, default=200)
  ap.add_argument("--header", action=argparse.BooleanOptionalAction, default=True)
  args = ap.parse_args()
  try:
    cfg = load_config("model=llama2-tiny", *args.overrides)
    seq_len = cfg.train.seq_len
    rates = [one_rep(cfg, args.batch, seq_len, args.warmup, args.batches) for _ in range(args.reps)]
  except ConfigError as e:
    print(f"data_throughput: error: {e}", file=sys.stderr)
    return 2
  med = statistics.median(rates)
  spread = (max(rates) - min(rates)) / med
  d = cfg.data
  source = d.source if d.source in ("stdlib", "synthetic") else f"{d.source} {d.path}"
  tokenizer = d.tokenizer if d.tokenizer == "byte" else os.path.basename(d.tokenizer)
  if args.header:
    print(f"command: {' '.join(sys.argv)}  ({args.reps} reps of {args.batches} batches after {args.warmup} warm-up)")
    print("| source | tokenizer | global batch | seq_len | tokens/s (median) | spread |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
  print(f"| {source} | {tokenizer} | {args.batch} | {seq_len} | {med:,.0f} | {spread:.0%} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
