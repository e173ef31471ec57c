"""Fixtures for the escape tests: one closed network world per session (see tests/networld.py).

The world is session-scoped because building it (4 namespaces, 3 server processes, a CA) takes about a
second and every escape test only *observes* it (hit logs are read from a mark, never truncated), so
tests stay independent while the suite stays fast on a 2-core machine shared with other engineers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from networld import World


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World.create(tmp_path_factory.mktemp("networld"))
    try:
        yield w
    finally:
        w.close()
