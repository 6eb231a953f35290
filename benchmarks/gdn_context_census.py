"""Collectives of qwen3.5-tiny's train step (shrunk) with the sequence sharded over mesh.context: counts and bytes
from the compiled program's census, split into the GDN layers, the full-attention layer and the rest, with the
GDN chunk scans' trip counts. Deterministic (no timing, one compile per mesh).

  PYTHONPATH=src .venv/bin/python benchmarks/gdn_context_census.py [--preset qwen3.5-tiny]

Run it on another checkout's src (PYTHONPATH) to compare trees. Unscoped collectives whose shape is the chunk
layout [U, B, N, ...] are counted with the GDN layers (XLA's gather of the chunk terms when the rule runs
whole: before context parallelism).
"""
from __future__ import annotations

import argparse
import collections

CHUNK = 16
# The old flat keys of model.parts.gdn.chunk_size, key_head_dim and value_head_dim (ModelConfig.MOVED), which
# checkouts from before the moves read too: the script compares trees.
SHRINK = ("model.embed_dim=32", "model.mlp_dim=64", "model.vocab_size=64", f"model.gdn_chunk_size={CHUNK}",
          "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "model.head_dim=8", "train.seq_len=128",
          "train.compute_dtype=float32", "train.per_device_batch_size=1")
MESHES = (("cpu_devices=2", "mesh.context=2"), ("cpu_devices=4", "mesh.context=4"),
          ("cpu_devices=4", "mesh.context=2", "mesh.fsdp=2"))


def bucket(call: dict, chunk_prefix: str) -> str:
  scope = call["scope"] or ""
  if "linear_attn" in scope or (not call["scope"] or scope == "other") and call["shape"].startswith(chunk_prefix):
    return "gdn"
  return "attn" if "attn" in scope else "other"


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3.5-tiny")
  args = ap.parse_args()
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from meshlm.analysis.census import census
  from meshlm.config import load_config
  print("| mesh | mode | GDN layers: count / bytes | full attention | rest | GDN chunk-scan trips |")
  print("| --- | --- | --- | --- | --- | --- |")
  for mesh in MESHES:
    for mode in ("explicit", "auto"):
      cfg = load_config(f"model={args.preset}", *SHRINK, *mesh, f"shard_mode={mode}")
      U = cfg.train.seq_len // CHUNK
      name = " ".join(o for o in mesh if o.startswith("mesh."))
      try:
        c = census(cfg)
      except Exception as e:  # noqa: BLE001 (the table says which meshes fail to trace)
        print(f"| {name} | {mode} | fails: {type(e).__name__} | | | |")
        continue
      prefix = f"f32[{U},"
      tot = collections.defaultdict(lambda: [0, 0])
      for d in c["hlo"]["collectives"].values():
        for call in d["calls"]:
          t = tot[bucket(call, prefix)]
          t[0] += call["count"]
          t[1] += call["count"] * call["bytes_per_call"]
      trips = sorted({w["trip_count"] for w in c["hlo"]["while_loops"] if "linear_attn" in (w["scope"] or "")})
      cell = lambda k: f"{tot[k][0]} / {tot[k][1]:,}"
      print(f"| {name} | {mode} | {cell('gdn')} | {cell('attn')} | {cell('other')} | {trips} |")


if __name__ == "__main__":
  main()
