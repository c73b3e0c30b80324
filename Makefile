# Two commands on a fresh machine with only Python 3.11:
#   make demo   set up .venv and train the demo model on the built-in corpus
#   make test   set up .venv and run the whole test suite (what CI runs)
#   make test-fast   the tier to run while editing: no end-to-end, multi-process or compile tests
PYTHON ?= python3
VENV ?= .venv
# The CPU build that is available locally; GPU users: make demo TORCH_SPEC="torch==2.13.0" with their index.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmforge-installed

.PHONY: setup demo test test-fast lint format clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

# Build the offline demo corpus (skipped when complete), train the demo model on CPU (a few minutes),
# then print a sample from its last checkpoint. OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep instead
# of spinning while they wait, which keeps a busy (shared) CPU from slowing each step down ~10x.
demo: $(STAMP)
	$(VENV)/bin/lmforge data demo --output data/demo
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/lmforge train --config configs/demo.yaml
	$(VENV)/bin/lmforge generate --checkpoint output/demo/checkpoints --prompt "And God said" --max-new-tokens 48 --temperature 0.7

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not distributed"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format src tests bench
	$(VENV)/bin/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
