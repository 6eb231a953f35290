"""meshlm: a compact, fast JAX trainer for decoder LLMs where explicit sharding costs nothing."""
from meshlm.config import Config, ConfigError, load_config
from meshlm.models import forward, init_params

__all__ = ["Config", "ConfigError", "forward", "init_params", "load_config"]
__version__ = "0.1.0"
