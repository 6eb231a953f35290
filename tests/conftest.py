"""Every test process sees 8 fake CPU devices; meshes use the first N they need."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now: a later cpu_devices=N in some test's config must find it running (and then
# only checks the count) rather than set the device count for every test after it.
assert len(jax.devices()) == 8
