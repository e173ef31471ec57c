# The two set-up commands: `make run` and `make test`. Everything else is optional.
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-durations lint bench bench-state bench-all venv test-deps clean

# scripts/make-venv.sh: a Python >= 3.12, then `uv pip install -e .[dev]` with pip's own index settings (uv
# caches the wheels pip here cannot: ~100 s -> ~20 s of a fresh clone's `make test`); pip if uv cannot install.
$(STAMP): pyproject.toml
	scripts/make-venv.sh $(VENV) dev
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/egressgate run $(ARGS)

test-deps:
	@scripts/install-test-deps.sh
	@scripts/install-axe.sh

# Parallel: tests/support/scheduling.py puts every test in an xdist group (its module, or an exclusive group for
# host-global resources) and hands out the heaviest groups first; the suite mostly waits on sockets and child
# processes, so 4 workers fit 2 cores. The 20 slowest tests are printed at the end of every run.
# Bytecode first: this environment sets PYTHONDONTWRITEBYTECODE=1, so every gateway, CLI and helper process
# the suite starts (~500 outside tests/runtimes/ alone, 140 of them gateways) would compile the egressgate
# modules it imports from source again (~0.25-0.45 s CPU per gateway start). compileall writes the .pyc files
# regardless (into the gitignored __pycache__/), and the run may write its own: pytest then keeps its
# rewritten test modules instead of rewriting ~440 files in every worker at every run (~8 s CPU per worker);
# scripts/prewarm-tests.py has them rewritten once, one process per core, before the workers start (a fresh
# clone: ~21 CPU-s of collection per worker -> ~7).
TEST_WORKERS ?= 4
PYTEST_PAR := PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=20
test: $(STAMP) test-deps
	$(BIN)/python -m compileall -q -j 0 egressgate tests
	$(BIN)/python scripts/prewarm-tests.py
	$(PYTEST_PAR) $(PYTEST_ARGS)

# Refresh the group weights the scheduler orders by (seconds per group, from one full run; a partial run
# refreshes only the groups it ran).
test-durations: $(STAMP) test-deps
	$(BIN)/python -m compileall -q -j 0 egressgate tests
	$(BIN)/python scripts/prewarm-tests.py
	$(PYTEST_PAR) -q --group-durations=tests/durations.json $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check egressgate tests loadtests

# One interleaved run in a closed namespace world (loadtests/bench.py; needs root): direct, Squid (CONNECT tunnel
# and ssl-bump MITM: squid-openssl, installed by test-deps), bare mitmdump, egressgate. `make bench BENCH_ARGS="--quick"` for a smoke run, "--record" to append to RESULTS.md.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP) pyproject.toml
	scripts/make-venv.sh $(VENV) dev,bench
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) test-deps
	$(BIN)/python -m loadtests.bench $(BENCH_ARGS)

# Issue 12 (loadtests/state_bench.py; needs root): memory vs Redis state backend, `--workers 2` vs 1 (rps and
# requests per gateway CPU-second), p99 of the budget check on loopback Redis; interleaved, medians, load printed.
# `make bench-state BENCH_ARGS="--quick"` for a smoke run, "--record" to append to RESULTS.md.
bench-state: $(STAMP) test-deps
	$(BIN)/python -m loadtests.state_bench $(BENCH_ARGS)

# Every benchmark module (loadtests/*_bench.py), each with its defaults.
bench-all: $(STAMP) test-deps
	$(BIN)/python -m loadtests.run_all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
