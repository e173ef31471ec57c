"""Fixtures for the escape tests: one closed network world per session (see tests/networld/).

The world is session-scoped because building it (4 namespaces, 3 server processes, a CA) takes about a
second and every escape test only *observes* it (hit logs are read from a mark, never truncated), so
tests stay independent while the suite stays fast on a 2-core machine shared with other engineers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.networld import World
from tests.support.netgateway import Gateway, Sandbox
from tests.support.replay_check import assert_replays_unchanged


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World.create(tmp_path_factory.mktemp("networld"))
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="session")
def gateway(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The real gateway, started once with every escape policy (tests/escape/policies/)."""
    gw = Gateway.start(world, tmp_path_factory.mktemp("gateway"))
    try:
        yield gw
    finally:
        gw.stop()
    # every escape attempt's decision (address denials, DNS, transparent, tunnels) replays the same under
    # the same policies (issue 23, item 1)
    assert_replays_unchanged(gw.tmp / "var", gw.tmp / "policies")


@pytest.fixture(scope="session")
def sbx(gateway: Gateway) -> Sandbox:
    """A sandbox under escape-https: names and IP literals allowed by rule, only 198.18.1.0/24 private."""
    return gateway.admit("escape-https")


@pytest.fixture(scope="session")
def sbx_private(gateway: Gateway) -> Sandbox:
    """Positive control: allow_private covers 10.0.0.5, so the gateway itself can reach that canary."""
    return gateway.admit("escape-private")


@pytest.fixture(autouse=True)
def gateway_survives(request: pytest.FixtureRequest) -> Iterator[None]:
    """An escape attempt that crashes the gateway (denial of service) or raises inside it (an error
    path that might fail open) is a finding, not noise: fail the test that caused it."""
    if "gateway" not in request.fixturenames:
        yield
        return
    gw: Gateway = request.getfixturevalue("gateway")
    before = len(gw.stderr)
    yield
    if gw.proc.poll() is not None:
        pytest.fail(f"the gateway exited ({gw.proc.returncode}) during this test:\n{gw.stderr[-3000:]}")
    new = gw.stderr[before:]
    errors = [line for line in new.splitlines() if " ERROR " in line or "Traceback" in line]
    if errors:
        pytest.fail("the gateway logged errors during this test:\n" + new[-3000:])
