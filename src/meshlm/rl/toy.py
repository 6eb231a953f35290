"""The toy RL task: reverse a short string, with the byte tokenizer.

    python -m meshlm.rl.toy OUT_DIR [--n 2000] [--seed 0] [--min-len 3] [--max-len 6]

writes OUT_DIR/prompts.jsonl ({"prompt": "rev abcd=", "answer": "dcba"}) for `meshlm rl` and
OUT_DIR/sft.jsonl ({"text": "rev abcd=dcba"}) of demonstrations for the supervised warm-start
(`meshlm train data.path=OUT_DIR/sft.jsonl`; the byte tokenizer closes each document with EOS, which
is what the sampler then stops on). The reward is `meshlm.rl.toy:reverse_reward`: the fraction of the
answer's characters the completion has right, position by position, over the longer of the two (a
completion of the wrong length loses the characters it misses or adds); 1 only for the exact answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ALPHABET = "abcdefgh"


def make_rows(n: int, seed: int, min_len: int = 3, max_len: int = 6) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    s = "".join(rng.choice(list(ALPHABET), int(rng.integers(min_len, max_len + 1))))
    rows.append({"prompt": f"rev {s}=", "answer": s[::-1]})
  return rows


def reverse_reward(prompt: str, completion: str, row: dict) -> float:
  want = row["answer"]
  got = completion.strip()
  right = sum(a == b for a, b in zip(got, want))
  return right / max(len(want), len(got), 1)


def write(out: str, n: int, seed: int, min_len: int, max_len: int) -> tuple[str, str]:
  os.makedirs(out, exist_ok=True)
  rows = make_rows(n, seed, min_len, max_len)
  prompts, sft = os.path.join(out, "prompts.jsonl"), os.path.join(out, "sft.jsonl")
  with open(prompts, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  # Demonstrations from another seed: the warm-start does not see the RL prompts' answers.
  with open(sft, "w") as f:
    f.writelines(json.dumps({"text": r["prompt"] + r["answer"]}) + "\n"
                 for r in make_rows(n, seed + 1, min_len, max_len))
  return prompts, sft


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m meshlm.rl.toy", description=__doc__.split("\n")[0])
  ap.add_argument("out")
  ap.add_argument("--n", type=int, default=2000)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--min-len", type=int, default=3)
  ap.add_argument("--max-len", type=int, default=6)
  a = ap.parse_args(argv)
  for path in write(a.out, a.n, a.seed, a.min_len, a.max_len):
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
