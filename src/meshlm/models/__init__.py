"""Models: a generic decoder plus one small file per family (registered in models/registry.py)."""
from meshlm.models.decoder import forward
from meshlm.models.params import init_params, param_shardings, param_specs
from meshlm.models.registry import FAMILIES
from meshlm.spec import ParamSpec, count

__all__ = ["FAMILIES", "ParamSpec", "count", "forward", "init_params", "param_shardings", "param_specs"]
