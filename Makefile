# The single place where the CPU torch build is pinned.
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN := torch==2.13.0
BIN := $(VENV)/bin
NPROC ?= 2
CONFIG ?= grpo_tiny

.PHONY: setup test test-explore run bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,megatron,tq]'
	touch $@

# HYPOTHESIS_PROFILE=ci: derandomized property tests with fixed example budgets and no example database, so every
# run checks the same examples (profiles in tests/conftest.py).
test: setup
	HYPOTHESIS_PROFILE=ci OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

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
