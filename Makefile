# archscale: `make demo` trains and compares two small models end to end; `make test` runs the test suite.
# Both create/reuse .venv and install what is missing (a second run skips work already done).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without an NVIDIA GPU, pin the CPU torch build; with one, keep whatever CUDA torch pip picks / you installed.
CONSTRAINTS := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "-c constraints-cpu.txt")
# --no-compile: pip byte-compiles every installed .py file (torch alone has thousands), which is over half of a
# fresh install's time; Python compiles only the modules actually imported, on first import, instead.
PIP_FLAGS ?= --no-compile
# Two install stamps: the package alone (all `make demo` needs) and the package with the test extras
# (pytest, transformers, lm-eval, deepspeed, ...: about 2 GB more), so the demo does not pay for the tests.
CORE_STAMP := $(VENV)/.installed-core
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test demo test test-fast test-gpu bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(CORE_STAMP): pyproject.toml constraints-cpu.txt | $(PY)
	$(PY) -m pip install -q $(PIP_FLAGS) $(CONSTRAINTS) -e .
	@touch $(CORE_STAMP)

# The test install contains the core one, so it refreshes both stamps.
$(TEST_STAMP): pyproject.toml constraints-cpu.txt | $(PY)
	$(PY) -m pip install -q $(PIP_FLAGS) $(CONSTRAINTS) -e ".[test]"
	@touch $(TEST_STAMP) $(CORE_STAMP)

install: $(CORE_STAMP)

install-test: $(TEST_STAMP)

demo: $(CORE_STAMP)
	$(VENV)/bin/archscale demo

test: $(TEST_STAMP)
	$(PY) -m pytest -q

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow"

test-gpu: $(TEST_STAMP)
	$(PY) -m pytest -q -m cuda

bench: $(TEST_STAMP)
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
