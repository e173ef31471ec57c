"""Fixtures for the gateway tests: the loopback world and one gateway for the session (see
tests/support/gwworld.py for what they contain). Tests stay independent by admitting a fresh sandbox."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gwworld import Gateway, World, open_world, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.replay_check import assert_replays_unchanged
from tests.support.scripted_dns import ScriptedDns
from tests.support.tmpfs import tiny_tmpfs


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("gwworld")) as w:
        yield w


@pytest.fixture(scope="session")
def gateway(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(world, tmp_path_factory.mktemp("gw"))
    try:
        yield gw
    finally:
        stop_gateway(gw)
    # every decision the session's tests made replays the same under the same policies (issue 23, item 1)
    assert_replays_unchanged(gw.var, gw.policy_dir)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 128 KiB tmpfs for the audit file: a full disk the gateway must fail closed on."""
    with tiny_tmpfs(tmp_path / "auditfs", "128k") as mnt:
        yield mnt


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedDns]:
    """A scripted DNS server (tests/support/scripted_dns.py), one per module: each module scripts its own plans."""
    server = ScriptedDns()
    try:
        yield server
    finally:
        server.close()
