"""The user-facing errors: one line that names the key and value, what was expected and what to do.

The bottom of the import graph (imports nothing of meshlm), so every layer can raise them; the CLI
prints them as `meshlm: error: ...` and exits 2. Layer-specific subclasses (CheckpointSaveError,
NonFiniteStop) live beside the code that raises them.
"""


class ConfigError(ValueError):
  """A config problem, reported as one line that names the key. The CLI exits 2 on it."""


class UsageError(Exception):
  """A command-line problem outside the config keys (a missing argument, an unknown flag); exit 2."""
