"""Fixtures for the credential tests: the credential world, one OpenBao dev server and one gateway using
it through AppRole, for the session (see tests/support/credworld.py). Tests admit a fresh sandbox each."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.bao import BaoServer
from tests.support.credworld import Gateway, World, launch, open_world
from tests.support.launcher import stop_gateway
from tests.support.replay_check import assert_config_replays


@pytest.fixture(scope="session")
def cworld(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("credworld")) as w:
        yield w


@pytest.fixture(scope="session")
def cbao() -> Iterator[BaoServer]:
    server = BaoServer().start()
    try:
        server.configure()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cgw(cworld: World, cbao: BaoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = launch(cworld, tmp_path_factory.mktemp("credgw"), cbao)
    cworld.jwks_url["url"] = f"http://{gw.admin}/.well-known/jwks.json"
    try:
        yield gw
    finally:
        stop_gateway(gw)
    # every decision the session's tests made replays the same under the same policies (issue 23, item 1)
    assert_config_replays(gw.config)
