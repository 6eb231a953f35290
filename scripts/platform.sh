#!/bin/sh
# The JAX platform that `make train` runs on (docs/tpu.md): JAX_PLATFORMS when set; tpu on a machine with a TPU chip;
# cpu otherwise, the CPU demo (a .venv that `make test` gave libtpu then does not probe for a TPU).
# A TPU chip is found as JAX finds one (jax/_src/hardware_utils.py): a PCI function with Google's vendor id and a TPU
# device id (v3, v4, v5p, v5e, v6e, tpu7x and later). Google's other PCI devices (the gVNIC network card) are not TPUs.
# MESHLM_PCI: the PCI device folder to look in (default /sys/bus/pci/devices; tests point it at a fake one).
if [ -n "${JAX_PLATFORMS:-}" ]; then
  echo "$JAX_PLATFORMS"
  exit 0
fi
for d in "${MESHLM_PCI:-/sys/bus/pci/devices}"/*.0; do
  [ "$(cat "$d/vendor" 2>/dev/null)" = 0x1ae0 ] || continue
  case "$(cat "$d/device" 2>/dev/null)" in
    0x0027|0x0056|0x005e|0x0062|0x0063|0x006f|0x0076|0x0083|0x007c) echo tpu; exit 0 ;;
  esac
done
echo cpu
