"""Regenerates tests/golden/census/<preset>.json for every *-tiny preset.

Run it deliberately, after a change that is meant to move the counts, and review the diff:
  .venv/bin/python scripts/regen_golden_census.py [PRESET ...]
The golden test (tests/test_analysis.py) only reads these files.
"""
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

from meshlm.analysis.golden import ARMS, BASE, golden_counts, tiny_presets  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "census")


def main(argv: list[str]) -> int:
  presets = argv or tiny_presets()
  os.makedirs(OUT, exist_ok=True)
  for preset in presets:
    counts = golden_counts(preset)
    doc = {"preset": preset, "base": list(BASE), "arms": {k: list(v) for k, v in ARMS.items()}, "counts": counts}
    path = os.path.join(OUT, f"{preset}.json")
    with open(path, "w") as f:
      json.dump(doc, f, indent=2, sort_keys=True)
      f.write("\n")
    print(f"{preset}: " + "  ".join(f"{arm} blocked={c['stablehlo.transpose_of_dot.blocked']}" for arm, c in counts.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
