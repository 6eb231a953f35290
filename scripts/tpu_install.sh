#!/usr/bin/env bash
# meshlm's dependencies on a TPU machine without network access, beside the JAX and libtpu it already has
# (docs/tpu.md "Setting up"; a TPU VM with network runs `make train` or `make setup-tpu` instead).
#
#   INDEX=<the machine's package index URL> bash scripts/tpu_install.sh SITE WHEELS
#   export PYTHONPATH=$PYTHONPATH:SITE:<this checkout>/src
#
# SITE: a writable folder the packages go into. WHEELS: a folder holding the three wheels the index lacks (grain,
# array_record and portpicker, fetched on a machine with network: docs/tpu.md). The rest comes from INDEX at the
# versions pinned in scripts/tpu_offline.lock. Nothing replaces the machine's jax, jaxlib, libtpu or numpy: every
# install is --no-deps into SITE, which goes after the machine's own folders on PYTHONPATH. PYTHON: the interpreter
# (default python3, the one that has the machine's JAX).
set -u
here=$(cd "$(dirname "$0")" && pwd)
site=${1:?usage: INDEX=URL bash scripts/tpu_install.sh SITE WHEELS}
wheels=${2:?usage: INDEX=URL bash scripts/tpu_install.sh SITE WHEELS}
: "${INDEX:?set INDEX to the package index URL of the TPU machine}"
py=${PYTHON:-python3}
for name in grain array_record portpicker; do
  ls "$wheels"/"$name"-*.whl >/dev/null 2>&1 || {
    echo "tpu_install: no $name wheel in $wheels (docs/tpu.md, 'Setting up', says how to fetch it)" >&2
    exit 1
  }
done
mkdir -p "$site"
export PIP_CONFIG_FILE=/dev/null  # the machine's pip settings (another index, --user) stay out of it
pip_install() {
  "$py" -m pip install --isolated -q --no-cache-dir --no-compile --only-binary=:all: --no-deps --target "$site" "$@"
}
failed=0
pip_install --no-index "$wheels"/grain-*.whl "$wheels"/array_record-*.whl "$wheels"/portpicker-*.whl \
  || { echo "tpu_install: FAILED: the carried wheels" >&2; failed=1; }
pins=$(grep -v '^#' "$here/tpu_offline.lock")
# shellcheck disable=SC2086  # one argument per pin
pip_install --index-url "$INDEX" $pins || {
  echo "tpu_install: the pinned set failed as a whole; one package at a time" >&2
  for p in $pins; do
    pip_install --index-url "$INDEX" "$p" >/dev/null 2>&1 || { echo "tpu_install: FAILED: $p" >&2; failed=1; }
  done
}
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site:$here/../src "$py" -c \
  "import grain, array_record, portpicker, optax, orbax.checkpoint, pydantic, meshlm.cli, jax; print(jax.__version__)" \
  || { echo "tpu_install: FAILED: meshlm does not import" >&2; failed=1; }
[ $failed = 0 ] || exit 1
echo "tpu_install: done; now: export PYTHONPATH=\$PYTHONPATH:$(cd "$site" && pwd):$(cd "$here/.." && pwd)/src"
