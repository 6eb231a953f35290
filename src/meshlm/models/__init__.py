"""Models: a generic decoder plus one small file per family."""
from meshlm.models.decoder import FAMILIES, forward, init_params, param_shardings, param_specs
from meshlm.models.spec import ParamSpec, count

__all__ = ["FAMILIES", "ParamSpec", "count", "forward", "init_params", "param_shardings", "param_specs"]
