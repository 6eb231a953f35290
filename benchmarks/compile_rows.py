"""The real-scale rows of docs/performance.md ("Real-scale programs, compiled for TPU"): each a `meshlm compile
... --json` for a TPU topology, run one at a time (a 397B compile holds about 2 GB and both cores for ~4.5
minutes), then one markdown table of compile time, peak memory per device against the HBM, fits, the roofline,
collectives and the census' layout counts.

  .venv/bin/python benchmarks/compile_rows.py OUT_DIR            # compile every row into OUT_DIR/<row>.json
  .venv/bin/python benchmarks/compile_rows.py OUT_DIR --table    # the table from the JSON already there
  .venv/bin/python benchmarks/compile_rows.py OUT_DIR --rows a,b  # compile only these rows (names as in ROWS)

The compile runs this interpreter's meshlm (`python -m meshlm.cli`), so PYTHONPATH picks the source tree. Each
row's wall seconds and the load average before and after go to OUT_DIR/<row>.run.json beside its report.

Needs libtpu (pip install 'meshlm[tpu]'). Nothing runs on a TPU: every figure is the compiled executable's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

Q397 = ["model=qwen3.5-397b-a17b", "topology=tpu7x-256", "train.per_device_batch_size=1", "remat=full"]
V5P8 = ["model=llama3-8b", "topology=v5p-8", "mesh.fsdp=4", "remat=full"]
ROWS = {
    "q397_fsdp128_ctx2_full": Q397 + ["train.seq_len=16384", "mesh.fsdp=128", "mesh.context=2",
                                      "model.parts.moe.kernel_fsdp=experts"],
    "q397_e8c2f16_embed": Q397 + ["train.seq_len=16384", "mesh.expert=8", "mesh.context=2", "mesh.fsdp=16",
                                  "model.parts.moe.kernel_fsdp=embed"],
    "q397_e8c2f16_embed_seq4096": Q397 + ["train.seq_len=4096", "mesh.expert=8", "mesh.context=2", "mesh.fsdp=16",
                                          "model.parts.moe.kernel_fsdp=embed"],
    # One period of the 397B model (3 GDN + 1 full-attention layer of its 60), all else as the row above: the
    # full depth at 4,096 tokens ran past 40 minutes of compile here.
    "q397_4layers_e8c2f16_embed_seq4096": Q397 + ["model.num_layers=4", "train.seq_len=4096", "mesh.expert=8",
                                                  "mesh.context=2", "mesh.fsdp=16", "model.parts.moe.kernel_fsdp=embed"],
    "dsv3_v5p512": ["model=deepseek-v3", "topology=v5p-512", "mesh.expert=8", "mesh.fsdp=32", "remat=full",
                    "model.parts.moe.kernel_fsdp=embed"],
    "dsv3_v5p512_t4": ["model=deepseek-v3", "topology=v5p-512", "mesh.expert=8", "mesh.tensor=4", "mesh.fsdp=8",
                       "remat=full", "model.parts.moe.kernel_fsdp=embed"],
    "llama3_v5p8_explicit": V5P8 + ["shard_mode=explicit"],
    "llama3_v5p8_explicit_noflags": V5P8 + ["shard_mode=explicit", "dense_weight_grad_in_kernel_order=false",
                                            "lm_head_weight_grad_in_kernel_order=false"],
    "llama3_v5p8_auto": V5P8 + ["shard_mode=auto"],
    "qwen3_v5p8_explicit": ["model=qwen3-8b", "topology=v5p-8", "mesh.fsdp=4", "remat=full", "shard_mode=explicit"],
    "qwen3_v5p8_auto": ["model=qwen3-8b", "topology=v5p-8", "mesh.fsdp=4", "remat=full", "shard_mode=auto"],
    "llama3_v6e8_explicit": ["model=llama3-8b", "topology=v6e-8", "mesh.fsdp=8", "remat=full"],
    "qwen3_v6e8_explicit": ["model=qwen3-8b", "topology=v6e-8", "mesh.fsdp=8", "remat=full"],
}


def gib(b) -> str:
  return "-" if b is None else f"{b / (1 << 30):.2f}"


def row(name: str, report: dict) -> str:
  p = report["programs"]["train"]
  m, r, c = p["memory"], p.get("roofline", {}), p.get("census")
  cfg = report["config"]
  mesh = " ".join(f"{k}={v}" for k, v in cfg["mesh"].items() if v != 1)
  fits = {True: "yes", False: "**no**", None: "-"}[m["fits"]]
  bound = f"{r['bound_s'] * 1e3:,.0f} ({r['bound_by'][:3]})" if "bound_s" in r else "-"
  mfu = f"{100 * r['mfu_at_bound']:.0f}%" if r.get("mfu_at_bound") else "-"
  if c:
    cols = c["hlo"]["collectives"]
    text = p.get("collective_instructions")
    total = f"{sum(v['count'] for v in cols.values())} ({sum(text.values()) if text else '-'})"
    layout = f"{c['stablehlo']['transpose_of_dot']['blocked']} / {c['hlo']['copies']} / {len(c['scan_layout'])}"
  else:
    total, layout = "-", "-"
  return (f"| {name} | {report['topology']['name']} | {mesh} | {cfg['shard_mode']} | "
          f"{cfg.get('attention_impl', '-')} | {cfg['seq_len']} | "
          f"{p['compile_s']:.0f} | {gib(m['peak_bytes'])} / {gib(m['hbm_bytes'])} | {fits} | "
          f"{gib(m.get('temp_bytes'))} | {bound} | {mfu} | {total} | {layout} |")


def table(out_dir: str) -> str:
  lines = ["| row | topology | mesh | mode | attention | seq | compile (s) | peak / HBM per device (GiB) | fits | temporaries "
           "(GiB) | step >= (ms) | MFU at bound | collectives per step (in the text) | blocked / copies / scan flags |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name in ROWS:
    path = os.path.join(out_dir, f"{name}.json")
    if os.path.exists(path) and os.path.getsize(path):
      lines.append(row(name, json.load(open(path))))
  return "\n".join(lines)


def selected(argv: list[str]) -> list[str]:
  """The rows `--rows a,b` names (all of ROWS without it); an unknown name is a one-line error."""
  if "--rows" not in argv:
    return list(ROWS)
  i = argv.index("--rows")
  names = argv[i + 1].split(",") if i + 1 < len(argv) else []
  unknown = [n for n in names if n not in ROWS]
  if not names or unknown:
    print(f"compile_rows: --rows {','.join(unknown) or '(none)'}: not a row; rows: {', '.join(ROWS)}", file=sys.stderr)
    raise SystemExit(2)
  return names


def run(out_dir: str, name: str) -> None:
  load0, start = os.getloadavg(), time.perf_counter()
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    code = subprocess.run([sys.executable, "-m", "meshlm.cli", "compile", *ROWS[name], "--json"], stdout=f).returncode
  wall = time.perf_counter() - start
  with open(os.path.join(out_dir, f"{name}.run.json"), "w") as f:
    json.dump({"exit": code, "wall_s": round(wall, 1), "load_before": load0, "load_after": os.getloadavg()}, f)
  print(f"{name}: exit {code} in {wall:.0f} s", file=sys.stderr)


def main(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-"):
    print(__doc__)
    return 2
  out_dir, names = argv[0], selected(argv)
  if "--table" not in argv:
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
      run(out_dir, name)
  print(table(out_dir))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
