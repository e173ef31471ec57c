"""Fixtures and hooks shared by every test folder. Component fixtures live in tests/<component>/conftest.py;
helper code (worlds, launchers, clients) lives in tests/support/ (see its README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import cpu_usage, scheduling
from tests.support.dockerd import dockerd  # noqa: F401 - the session's private dockerd, for every folder
from tests.support.env import IN_CI, netns_unavailable_reason

TESTS_ROOT = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--group-durations",
        metavar="PATH",
        default=None,
        help="write seconds per xdist group as JSON (refresh tests/durations.json with it)",
    )
    parser.addoption(
        "--cpu-report",
        metavar="PATH",
        default=None,
        help="CPU seconds per test module (worker + reaped children + its cpuacct cgroup) as JSON, top in the "
        "summary (tests/support/cpu_usage.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    cpu_usage.register(config, config.getoption("--cpu-report"))
    if hasattr(config, "workerinput"):  # the controller sees every worker's reports
        return
    config.pluginmanager.register(scheduling.GroupWallTimes(), "group-wall-times")
    path = config.getoption("--group-durations")
    if path:
        config.pluginmanager.register(scheduling.GroupDurations(Path(path), TESTS_ROOT), "group-durations")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks it adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets its xdist group, heaviest groups first (tests/support/scheduling.py); netns tests
    skip outside CI when namespaces are unavailable; in CI (CI=true) they never skip."""
    scheduling.assign_groups(items, TESTS_ROOT)
    reason = netns_unavailable_reason()
    if reason is None or IN_CI:
        return
    skip = pytest.mark.skip(reason=f"netns test skipped outside CI: {reason}")
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail fast when xdist ignores the groups (pytest-xdist 3.8 marks a group by rewriting `item._nodeid`,
    which pytest 9 no longer reads): the suite would run with every host-global test spread over workers."""
    config = session.config
    if getattr(config.option, "loadgroup", False) and session.items and "@" not in session.items[0].nodeid:
        raise pytest.UsageError(
            "xdist ignored the test groups (tests/support/scheduling.py): "
            "this pytest/pytest-xdist pair cannot run `make test` in parallel safely"
        )
