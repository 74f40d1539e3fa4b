# The single place where the CPU torch build is pinned.
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN := torch==2.13.0
BIN := $(VENV)/bin
NPROC ?= 2
CONFIG ?= configs/grpo_tiny.yaml

.PHONY: setup test run bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,megatron,tq]'
	touch $@

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

run: setup
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc_per_node=$(NPROC) scripts/train.py --config $(CONFIG) $(ARGS)

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_balance.py --out runs/bench_balance.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_dataproto.py --out runs/bench_dataproto.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_store.py --out runs/bench_store.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_engine.py --out runs/bench_engine.json
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench_algorithms.py --out runs/bench_algorithms.json
