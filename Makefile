# `make train` and `make test` work on a fresh clone with only Python (>=3.11) and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test bench bench-table clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
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
