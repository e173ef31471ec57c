# The two set-up commands: `make run` and `make test`. Everything else is optional.
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench venv test-deps clean

$(STAMP): pyproject.toml
	@py=$$(scripts/find-python.sh) && echo "using $$py" && \
	  { [ -x $(BIN)/python ] || $$py -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/egressgate run $(ARGS)

test-deps:
	@scripts/install-test-deps.sh

test: $(STAMP) test-deps
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check egressgate tests loadtests

bench: $(STAMP) test-deps
	$(BIN)/python -m loadtests.run_all

clean:
	rm -rf $(VENV) .pytest_cache
