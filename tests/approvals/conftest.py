"""Fixtures for the approval tests: a real redis-server (loopback, free port, own tmp dir) per session."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.approvals.redisproc import RedisProcess


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(Path(tmp_path_factory.mktemp("a12-redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_prefix() -> str:
    return f"a12test-{secrets.token_hex(4)}:"
