"""Mesh building, the logical-axis rule table and constrain()."""
from meshlm.parallel.mesh import AXES, make_mesh, mesh_of, resolve_mesh, resolve_mesh_shape, set_cpu_devices
from meshlm.parallel.sharding import RULES, constrain, is_explicit, logical_spec, out_sharding

__all__ = ["AXES", "RULES", "constrain", "is_explicit", "logical_spec", "make_mesh", "mesh_of", "out_sharding",
           "resolve_mesh", "resolve_mesh_shape", "set_cpu_devices"]
