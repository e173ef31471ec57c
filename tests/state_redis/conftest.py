"""Fixtures of the multi-process state tests (two gateways or `--workers N` on one real Redis).

Each is module-scoped: every test file gets its own world and its own redis-server (its gateways'
budgets, audit trails and hit logs never mix with another file's). test_restart.py keeps its own
per-test Redis (it restarts and kills it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.budgetworld import BudgetWorld, budget_world
from tests.support.gwworld import World, open_world
from tests.support.redis import RedisServer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The loopback world of tests/support/gwworld.py (the workers and restart tests)."""
    with open_world(tmp_path_factory.mktemp("sr-world")) as w:
        yield w


@pytest.fixture(scope="module")
def bw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BudgetWorld]:
    """The byte-exact upload world of tests/support/budgetworld.py (the budget tests)."""
    with budget_world(tmp_path_factory.mktemp("sr-budgetworld")) as w:
        yield w


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("sr-redis")) as server:
        yield server
