"""meshlm: a compact, fast JAX trainer for decoder LLMs where explicit sharding costs nothing."""
import importlib

from meshlm.commands.resolve import load, load_config  # presets, overrides and model=PATH
from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.models.api import forward, init_params
from meshlm.models.generate import generate

__all__ = ["Config", "ConfigError", "forward", "generate", "hf", "init_params", "load", "load_config"]
__version__ = "0.1.0"

# Subpackages that `meshlm.NAME` reaches without an import of their own, loaded on first use so
# that `import meshlm` stays cheap (meshlm.hf brings safetensors and the family maps).
_LAZY = ("hf",)


def __getattr__(name: str):
  if name in _LAZY:
    return importlib.import_module(f"meshlm.{name}")  # also binds meshlm.<name> for next time
  raise AttributeError(f"module 'meshlm' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
