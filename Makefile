# Two commands for a fresh clone: `make demo` (the main job on a small local model, CPU, no network)
# and `make test` (the whole CPU test suite). Both build .venv with pinned dependencies first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_OUT ?= runs/demo

.PHONY: demo test venv clean

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

clean:
	rm -rf $(VENV) runs
