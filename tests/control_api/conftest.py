"""Fixtures of the control-API tests: the loopback world and one gateway (harness.py) for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.control_api.harness import start_control_gateway
from tests.support.gwworld import Gateway, World, open_world
from tests.support.launcher import stop_gateway
from tests.support.replay_check import assert_config_replays


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("c12world")) as w:
        yield w


@pytest.fixture(scope="session")
def cgw(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_control_gateway(world, tmp_path_factory.mktemp("c12gw"))
    try:
        yield gw
    finally:
        stop_gateway(gw)
    # every decision the session's tests made replays the same under the same policies (issue 23, item 1)
    assert_config_replays(gw.config)
