# Two commands for a fresh clone: `make demo` (the main job on a small local model, CPU, no network)
# and `make test` (the whole CPU test suite). Both build .venv with pinned dependencies first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_OUT ?= runs/demo
# gpu-check runs on a GPU machine's own Python (a CUDA build of torch), not the CPU venv.
GPU_PYTHON ?= python3
GSM8K_DIR ?= ../shared/data/gsm8k

.PHONY: demo test test-fast lint gpu-check gpu-test gpu-smoke venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch, pinned so that no multi-GB CUDA build is pulled on CPU machines.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m rlvr demo --out $(DEMO_OUT)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The inner loop: every test but those marked slow (the learning proofs and the fault drills), stopping
# at the first failure.
test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

# ruff (lint, then format check) over the tree and mypy over src/rlvr; settings in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# What only a GPU runs: the tests marked gpu (Triton and cascade attention over head_dims and batch sizes,
# CUDA-graph replay, compiled training, a train step per engine, a learning smoke run), then every
# section of the speed benchmark on a small model. Record its output in docs/benchmarks_history.md. Its two
# halves are targets of their own, for a machine lent in calls shorter than the whole check; the whole
# check runs both even when the first fails and ends with a table of both outcomes (scripts/gpu_check.sh).
gpu-check:
	MAKE="$(MAKE)" bash scripts/gpu_check.sh

gpu-test:
	PYTHONPATH=src:benchmarks:$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu

gpu-smoke:
	PYTHONPATH=src:benchmarks:$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/bench_speed.py --smoke --no-trl --strict \
		--data-dir $(GSM8K_DIR)

clean:
	rm -rf $(VENV) runs
