"""The GDN Pallas kernels' static cost on TPU, from Mosaic's own compiled output on this machine (no chip): each kernel
compiled for one v5e chip through libtpu with its LLO dump on, and the "total scheduled bundles" of its schedule
analysis (one grid step's body: a VLIW bundle issues in a cycle, stalls on MXU results or DMAs not counted).

  python benchmarks/gdn_bundles.py [--chunk 64 128] [--heads 8] [--inverse refine split]

Per (chunk, value heads a grid step, inverse): the forward without residuals (what a rematerialized layer's forward
runs), the forward with them (a training forward, and the remat recompute) and the backward, each per head and chunk
and per head and 64 positions, at the hybrid's widths (K = N = 16, H = J = 128, bf16 q, k, v, packed rows).
Measured with jax/libtpu of the lock: docs/gdn.md quotes them. libtpu must be installed (scripts/tpu_install.sh).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="gdn_bundles_")
# Before jax loads libtpu: the LLO text of every compiled program into DUMP.
os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                  + f" --xla_jf_dump_to={DUMP} --xla_jf_dump_llo_text=true").strip()


def bundles(chunk: int, heads: int, inverse: str) -> dict[str, int]:
  """{"fwd": ..., "fwd_res": ..., "bwd": ...}: one grid step's scheduled bundles of each kernel."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from meshlm.nn import gdn_pallas
  B, T, K, N, H, J = 1, 4 * chunk, 16, 16, 128, 128
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1").devices
  mesh = Mesh(np.array(devices[:1]), ("data",))
  whole = NamedSharding(mesh, P())
  shapes = [((B, T, K, H), jnp.bfloat16)] * 2 + [((B, T, N, J), jnp.bfloat16)] + [((B, T, N), jnp.float32)] * 2
  args = [jax.ShapeDtypeStruct(s, dt, sharding=whole) for s, dt in shapes + [((B, T), jnp.int32)]]

  def rule(q, k, v, g, beta, ids):
    return gdn_pallas.gated_delta_rule_pallas(q, k, v, g, beta, segment_ids_BT=ids, chunk_size=chunk,
                                              heads_per_step=heads, inverse=inverse)

  def loss(*a):
    o, S = rule(*a)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
  out = {}
  for key, fn in (("fwd", rule), ("grad", jax.grad(loss, argnums=(0, 1, 2, 3, 4)))):
    for f in glob.glob(f"{DUMP}/*"):
      os.remove(f)
    with jax.set_mesh(mesh):
      jax.jit(fn).lower(*args).compile()
    for f in glob.glob(f"{DUMP}/*gdn_chunk_*schedule-analysis_final_bundles.txt"):
      n = int(re.search(r"total scheduled bundles:\s+(\d+)", open(f).read()).group(1))
      kind = "bwd" if "gdn_chunk_bwd" in f else ("fwd" if key == "fwd" else "fwd_res")
      out[kind] = n
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--chunk", type=int, nargs="+", default=[64, 128])
  ap.add_argument("--heads", type=int, nargs="+", default=[8], help="value heads a grid step (heads_per_step)")
  ap.add_argument("--inverse", nargs="+", default=["refine", "split"])
  args = ap.parse_args(argv)
  print("| chunk | heads a step | inverse | forward | forward + residuals | backward | per head and 64 positions: "
        "fwd / fwd+res / bwd |\n| --- | --- | --- | --- | --- | --- | --- |")
  for chunk in args.chunk:
    for heads in args.heads:
      for inverse in args.inverse:
        b = bundles(chunk, heads, inverse)
        per = {k: v / heads for k, v in b.items()}
        per64 = " / ".join(f"{per[k] * 64 / chunk:.0f}" for k in ("fwd", "fwd_res", "bwd"))
        print(f"| {chunk} | {heads} | {inverse} | {per['fwd']:.0f} | {per['fwd_res']:.0f} | {per['bwd']:.0f} | "
              f"{per64} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
