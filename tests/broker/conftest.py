"""Broker fixtures: one configured OpenBao for the session, fresh ones for tests that kill theirs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.bao import BaoServer


@pytest.fixture(scope="session")
def bao() -> Iterator[BaoServer]:
    server = BaoServer().start()
    try:
        server.configure()
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_bao() -> Iterator[Callable[[], BaoServer]]:
    """Private servers for tests that stop Vault mid-test (never the shared one)."""
    started: list[BaoServer] = []

    def make() -> BaoServer:
        server = BaoServer().start().configure()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
