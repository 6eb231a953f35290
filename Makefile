# `make train` and `make test` work on a fresh clone with only Python (>=3.12) and make.
# The lock's jax (0.12) needs Python >= 3.12: PYTHON defaults to the first of python3, python3.12,
# python3.13 and pyenv's installed 3.12+ that is at least 3.12.
PY312 := import sys; sys.exit(sys.version_info < (3, 12))
PYTHON ?= $(shell for p in python3 python3.12 python3.13 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3; do \
  $$p -c '$(PY312)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TPU_STAMP := $(VENV)/.installed-tpu

# The platform `make train` runs on: JAX_PLATFORMS when set, else tpu on a machine with a TPU chip, else cpu.
PLATFORM := $(shell sh scripts/platform.sh)

.PHONY: setup setup-tpu train test bench bench-table rl-demo clean

$(STAMP): pyproject.toml requirements.lock
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found (set PYTHON=...)" >&2; exit 1; }
	$(BIN)/python -c '$(PY312)' 2>/dev/null || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

# `make test` also installs the tpu extra (requirements-tpu.lock: libtpu, a 215 MB wheel, 640 MB installed, a few
# seconds to install from a warm pip cache): tests/test_compile.py then compiles a train step for a TPU v5p slice on
# this CPU, so the TPU path of `meshlm compile` is tested in CI (docs/compile.md). `make setup` leaves it out.
$(TPU_STAMP): $(STAMP) requirements-tpu.lock
	$(BIN)/python -m pip install -q --no-deps -r requirements-tpu.lock
	touch $(TPU_STAMP)

setup: $(STAMP)

# On a TPU VM: the lock and the tpu extra (libtpu), what `make train` installs there by itself (docs/tpu.md).
setup-tpu: $(TPU_STAMP)

# The demo. On CPU (JAX_PLATFORMS=cpu, so a .venv that `make test` gave libtpu does not probe for a TPU) and, on a
# TPU machine, on its chip, the tpu extra installed first. JAX_PLATFORMS, when set, is kept.
train: $(STAMP) $(if $(findstring tpu,$(PLATFORM)),$(TPU_STAMP))
	JAX_PLATFORMS=$(PLATFORM) $(BIN)/meshlm train model=llama2-tiny train.steps=600

test: $(STAMP) $(TPU_STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/startup_and_step.py

# The explicit-vs-auto table for every tiny preset into docs/bench-table.md (about an hour; a quiet machine).
bench-table: $(STAMP)
	$(BIN)/python benchmarks/table.py --target-ci 0.015 --max-seconds 300 --docs docs/bench-table.md

# The RL demo (docs/rl.md): the toy reversal task's data, a supervised warm-start with `meshlm train`, then
# GRPO with `meshlm rl` on the same MoE model (qwen3-moe-tiny at small widths), router replay on and the
# router frozen, and the reward curve into $(RL_DEMO)/rl/reward-curve.png (docs/rl-reward-curve.png is the
# tracked picture, written by hand from a run: docs/rl.md). About 5 minutes on 2 CPU cores.
RL_DEMO ?= runs/rl-demo
RL_MODEL := model=qwen3-moe-tiny model.embed_dim=64 model.num_heads=4 model.num_kv_heads=2 model.head_dim=16 \
  model.mlp_dim=128 model.parts.moe.mlp_dim=64 model.vocab_size=257 model.max_position=64
RL_COMMON := train.compute_dtype=float32 train.seq_len=64 cpu_devices=1
RL_SFT_STEPS ?= 60
RL_STEPS ?= 400
rl-demo: $(STAMP)
	rm -rf $(RL_DEMO)
	$(BIN)/python -m meshlm.rl.toy $(RL_DEMO)/data --n 2000 --seed 0
	$(BIN)/meshlm train $(RL_MODEL) $(RL_COMMON) data.path=$(RL_DEMO)/data/sft.jsonl train.per_device_batch_size=16 \
	  train.steps=$(RL_SFT_STEPS) train.learning_rate=3e-3 train.warmup_steps=10 train.sample_tokens=0 run_dir=$(RL_DEMO)/sft
	$(BIN)/meshlm rl model=$(RL_DEMO)/sft $(RL_COMMON) rl.prompts=$(RL_DEMO)/data/prompts.jsonl \
	  "rl.reward=[meshlm.rl.toy:reverse_reward]" rl.router_replay=true "train.freeze=['.*\.router']" \
	  rl.prompts_per_step=16 rl.num_generations=8 rl.max_new_tokens=8 train.steps=$(RL_STEPS) \
	  train.learning_rate=4e-4 train.warmup_steps=10 train.weight_decay=0 rl.eval_every=25 rl.eval_prompts=128 \
	  run_dir=$(RL_DEMO)/rl
	$(BIN)/python benchmarks/rl_curve.py $(RL_DEMO)/rl --png $(RL_DEMO)/rl/reward-curve.png

clean:
	rm -rf $(VENV) runs
