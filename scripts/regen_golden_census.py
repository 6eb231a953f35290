"""Regenerates the golden census files that tests/test_analysis.py reads:

  tests/golden/census/<preset>.json   StableHLO counts of every *-tiny preset, every arm
  tests/golden/compiled_census.json   compiled collective counts (all-gathers, ...) of one config

Run it deliberately, after a change that is meant to move the counts, and review the diff:
  .venv/bin/python scripts/regen_golden_census.py [PRESET ... | compiled]
With no argument it writes every file. It refuses to run on a JAX other than the one
requirements.lock pins, because the counts are that version's. The tests only read these files.

The long presets are counted shrunk (golden.shrink(), recorded as the file's "shrink" and applied by the test as
it reads them): the Gated DeltaNet hybrids one period of two layers (linear + full) instead of 3 + 1, gemma3
one local and one global layer instead of its 8 (a scanned period of 6, then 2). Every layer kind's code is
counted; the lowering (tracing) of the layer bodies that repeat it is what the test saves.
"""
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

from meshlm.analysis import golden  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "golden")
LOCK = os.path.join(ROOT, "requirements.lock")


def _write(path: str, doc: dict) -> None:
  with open(path, "w") as f:
    json.dump(doc, f, indent=2, sort_keys=True)
    f.write("\n")


def main(argv: list[str]) -> int:
  pinned = golden.pinned_jax_version(LOCK)
  if jax.__version__ != pinned:
    print(f"error: jax {jax.__version__} is installed but requirements.lock pins jax=={pinned}; the golden counts "
          f"are that version's (run `make setup`)", file=sys.stderr)
    return 2
  known = golden.tiny_presets()
  targets = argv or [*known, "compiled"]
  for t in targets:
    if t != "compiled" and t not in known:
      print(f"error: {t}: not a tiny preset or 'compiled' (known: {', '.join(known)})", file=sys.stderr)
      return 2
  os.makedirs(os.path.join(OUT, "census"), exist_ok=True)
  for t in targets:
    if t == "compiled":
      from meshlm.analysis.census import census
      from meshlm.config import load_config
      counts = golden.compiled_counts(census(load_config(*golden.COMPILED_CONFIG)))
      _write(os.path.join(OUT, "compiled_census.json"),
             {"jax": jax.__version__, "config": list(golden.COMPILED_CONFIG), "counts": counts})
      print("compiled: " + "  ".join(f"{k.split('.')[2]}={v}" for k, v in counts.items()))
      continue
    over = golden.shrink(t)
    counts = golden.golden_counts(t, over=over)
    doc = {"preset": t, "jax": jax.__version__, "base": list(golden.BASE), "shrink": list(over),
           "arms": {k: list(v) for k, v in golden.ARMS.items()}, "counts": counts}
    _write(os.path.join(OUT, "census", f"{t}.json"), doc)
    print(f"{t}: " + "  ".join(f"{arm} blocked={c['stablehlo.transpose_of_dot.blocked']}" for arm, c in counts.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
