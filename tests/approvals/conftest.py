"""Fixtures for the approval tests: a real redis-server (loopback, free port, own tmp dir) per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.approvals import harness
from tests.support.gwworld import Gateway, World, open_world
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer
from tests.support.replay_check import assert_replays_unchanged


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("a12-redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_prefix(redis_server: RedisServer) -> str:
    return redis_server.prefix()


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("a12-world")) as w:
        yield w


@pytest.fixture(scope="session")
def gateway(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway for the module's tests; each test admits its own sandboxes (approvals are per sandbox)."""
    gw = harness.start(world, tmp_path_factory.mktemp("a12-gw"))
    try:
        yield gw
    finally:
        stop_gateway(gw)
    assert_replays_unchanged(gw.var, gw.policy_dir)  # approvals included (issue 23, item 1)
