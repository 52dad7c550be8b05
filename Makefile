# Two entry points: `make repro` runs the whole pipeline, `make test` runs the tests.
# Both create .venv and install what is missing on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: repro test test-fast bench install clean-results

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or run: make PY=python3 ...)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: a bare `torch` requirement would pull a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

repro: $(STAMP)
	@[ -d .dvc ] || $(BIN)/dvc init -q
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dvc repro $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m pipelines.bench_verify
