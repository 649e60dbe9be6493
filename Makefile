# Two entry points for a fresh machine: `make train` (set up, then the default training job) and `make test`.
# The CPU build of torch is pinned here: an unpinned torch pulls a multi-GB CUDA build on a CPU-only machine.
# On a GPU machine set TORCH_SPEC to the build you want, e.g. `make train TORCH_SPEC=torch`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Test processes: the suite's distributed tests wait on their own processes much of the time, so two test processes
# keep both cores of a small machine busy (each test process and what it spawns use one intra-op thread).
TEST_WORKERS ?= 2

.PHONY: setup train test test-fast lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

train: setup
	$(VENV)/bin/stratum train $(ARGS)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# ruff and mypy as configured in pyproject.toml (rules, checked files); both must pass.
lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/plain_engine.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
