# Two entry points that work on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 first: on the project's CPU machines it is a local CPU build, and installing it before the
# package keeps pip from pulling a multi-GB CUDA build to satisfy torch>=2.11.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint install

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/higgs-talker demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check higgs_talker tests benchmarks

test: lint
	$(PY) -m pytest -q
