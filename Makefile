# archscale: `make demo` trains a small model end to end; `make test` runs the test suite.
# Both create/reuse .venv and install what is missing (a second run skips work already done).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without an NVIDIA GPU, pin the CPU torch build; with one, keep whatever CUDA torch pip picks / you installed.
CONSTRAINTS := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "-c constraints-cpu.txt")
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-gpu bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml constraints-cpu.txt | $(PY)
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/archscale demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m cuda

bench: $(STAMP)
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
