"""The one place meshlm makes its rich Console, and the escaping of text a model wrote.

Written to a terminal, messages wrap to the terminal as usual. Written to a file or a pipe (CI
logs, `2> log`, a test's captured stderr), a message stays on one line whatever COLUMNS says, so
what a script greps for is never split, and the output does not depend on the environment.
"""
from __future__ import annotations

from typing import IO

from rich.console import Console

# Layout width of a non-terminal: only renderables that fill a width (the progress bar's final
# line) use it; printed messages never wrap (soft_wrap). Fixed, so COLUMNS cannot change a log.
FILE_WIDTH = 120


def make_console(*, stderr: bool = True, file: IO[str] | None = None) -> Console:
  """A Console on stderr (or stdout, or `file`); soft-wrapped at a fixed width unless a terminal."""
  console = Console(stderr=stderr, file=file)
  if console.is_terminal:
    return console
  return Console(stderr=stderr, file=file, soft_wrap=True, width=FILE_WIDTH)


def printable(text: str) -> str:
  """text with every non-printable character escaped (\\x1b, \\r, \\u200b), newlines and tabs kept.

  For text a model generated: raw control bytes would otherwise move the cursor, clear the
  screen or change colours in the user's terminal.
  """
  return "".join(ch if ch in "\n\t" or ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                 for ch in text)


def report_stop(console: Console, result, steps: int, run_dir) -> int | None:
  """For a trainer's result (train's or rl's) that stopped before its last step: says where it stopped and how
  to continue, and returns the exit code; None when it ran to the end. A preempted run exits 128 + the signal,
  as the shell reports a killed command, so that `meshlm train ... && meshlm convert ...` does not go on with a
  partly trained run."""
  import signal
  if result.stop_reason == "done":
    return None
  code, why = 0, ""
  if result.stop_reason == "preempted":
    sig = result.signal or signal.SIGTERM  # only another process was signalled: stopped as if by SIGTERM
    code, why = 128 + sig, f"exit code {128 + sig} ({signal.Signals(sig).name}); "
  # run_dir named: with the default (null) the same command alone would start a fresh run.
  console.print(f"stopped ({result.stop_reason}) after step {result.start_step + len(result.losses)} of "
                f"{steps}; checkpoint {result.checkpoint}; {why}to continue, run the same command "
                f"with run_dir={run_dir}")
  return code
