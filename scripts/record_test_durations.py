"""Per-file test durations from a `pytest --durations=0` log, for scheduling and for docs.

  .venv/bin/python -m pytest --durations=0 > run.log; .venv/bin/python scripts/record_test_durations.py run.log

Writes tests/file_durations.json ({file: seconds of setup + call + teardown}), which tests/conftest.py
reads to hand xdist the heaviest files first, and prints a markdown table for docs/test-durations.md.
Regenerate it deliberately, after the suite's shape changes; a file missing from it sorts last.
"""
import collections
import json
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LINE = re.compile(r"\s*([\d.]+)s (call|setup|teardown)\s+(tests/\S+?\.py)::(\S+)")


def main(path: str) -> int:
  files, tests = collections.Counter(), collections.Counter()
  for line in open(path):
    m = LINE.match(line)
    if m:
      files[m.group(3)] += float(m.group(1))
      tests[f"{m.group(3)}::{m.group(4)}"] += float(m.group(1))
  with open(os.path.join(ROOT, "tests", "file_durations.json"), "w") as f:
    json.dump({k: round(v, 1) for k, v in files.most_common()}, f, indent=1)
    f.write("\n")
  print("| file | seconds |\n| --- | --- |")
  for k, v in files.most_common():
    print(f"| {k} | {v:.1f} |")
  print(f"\nsum {sum(files.values()):.0f} s\n\n| test (setup + call + teardown) | seconds |\n| --- | --- |")
  for k, v in tests.most_common(25):
    print(f"| {k} | {v:.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
