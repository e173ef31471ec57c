"""Fixtures of the state-store contract tests: every test runs on each backend (`store`), and the
Redis ones on a real redis-server of this session (tests/support/redis.py) under a key prefix of their own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from egressgate.state.base import StateStore
from egressgate.state.memory import MemoryState
from tests.state.helpers import redis_store
from tests.support.redis import RedisServer

BACKENDS = ["memory", "redis"]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("r12-redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "redis":
        made: StateStore = await redis_store(request.getfixturevalue("redis_server"))
    else:
        made = MemoryState()
    try:
        yield made
    finally:
        await made.close()
