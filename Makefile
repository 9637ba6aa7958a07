# Entry points: `make demo` (and `make demo-basics`) and `make test`. Both create the venv and install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CONSTRAINTS := requirements/dev-constraints.txt
STAMP := $(VENV)/.installed
# Node tools of the tests (the Azurite emulator), kept out of git in .tools/.
TOOLS := .tools
AZURITE_VERSION := 3.37.0
AZURITE := $(TOOLS)/node_modules/.bin/azurite-blob

.PHONY: venv azurite demo demo-basics test typecheck lint bench bench-quick clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,torch,jax]'
	touch $(STAMP)

# The Azure Blob Storage emulator the storage tests start on loopback (needs node and npm).
azurite: $(AZURITE)

$(AZURITE):
	mkdir -p $(TOOLS)
	npm install --prefix $(TOOLS) --no-save --no-package-lock --no-audit --no-fund \
		--loglevel=error azurite@$(AZURITE_VERSION)
	test -x $@ && touch $@

$(VENV)/.bench-installed: $(STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,torch,jax,bench]'
	touch $@

# The main demo: train, kill -9 mid-run, resume, compare bit for bit with an uninterrupted run.
demo: venv
	$(PY) examples/train_resume.py

# A tour of the basics: save, inspect, verify, load, partial load, corruption caught.
demo-basics: venv
	$(PY) examples/demo.py

# Test processes (pytest-xdist; 0: the suite in this process). Most of the suite's time
# is waiting (timeouts, dead ranks, stalled stores, subprocesses starting), so more
# workers than cores pay: on 2 cores the suite took 18-20 min alone, 15 with 2 workers
# and 12 with 4 (2026-12-07).
TEST_WORKERS ?= 4

test: venv $(AZURITE)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests src/statestream

typecheck: venv
	$(VENV)/bin/mypy

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples

bench: $(VENV)/.bench-installed
	$(PY) benchmarks/bench_core.py

bench-quick: $(VENV)/.bench-installed
	$(PY) benchmarks/bench_core.py --quick

clean:
	rm -rf $(VENV) $(TOOLS) build dist src/*.egg-info
