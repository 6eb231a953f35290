# `make train` and `make test` work on a fresh clone with only Python (>=3.12) and make.
# The lock's jax (0.12) needs Python >= 3.12: PYTHON defaults to the first of python3, python3.12,
# python3.13 and pyenv's installed 3.12+ that is at least 3.12.
PY312 := import sys; sys.exit(sys.version_info < (3, 12))
PYTHON ?= $(shell for p in python3 python3.12 python3.13 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3; do \
  $$p -c '$(PY312)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test bench bench-table clean

$(STAMP): pyproject.toml requirements.lock
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found (set PYTHON=...)" >&2; exit 1; }
	$(BIN)/python -c '$(PY312)' 2>/dev/null || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/meshlm train model=llama2-tiny train.steps=600

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/startup_and_step.py

# The explicit-vs-auto table for every tiny preset into docs/performance.md (about an hour; a quiet machine).
bench-table: $(STAMP)
	$(BIN)/python benchmarks/table.py --target-ci 0.015 --max-seconds 300 --docs docs/performance.md

clean:
	rm -rf $(VENV) runs
