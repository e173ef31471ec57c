"""Fixtures and hooks shared by every test folder. Component fixtures live in tests/<component>/conftest.py;
helper code (worlds, launchers, clients) lives in tests/support/ (see its README.md)."""

from __future__ import annotations

import pytest

from tests.support.dockerd import dockerd  # noqa: F401 - the session's private dockerd, for every folder
from tests.support.env import IN_CI, netns_unavailable_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """netns tests skip outside CI when namespaces are unavailable; in CI (CI=true) they never skip."""
    reason = netns_unavailable_reason()
    if reason is None or IN_CI:
        return
    skip = pytest.mark.skip(reason=f"netns test skipped outside CI: {reason}")
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(skip)
