"""The gateway's versions of mitmproxy's per-hook helpers behave like mitmproxy's originals."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy.proxy import server
from mitmproxy.utils import asyncio_utils

from egressgate.gateway.mitm import hotpaths as mitm_hotpaths


async def _noop() -> None:
    return None


@pytest.fixture
def restore():
    yield
    mitm_hotpaths.uninstall()


@pytest.mark.parametrize("test_name", [None, "tests/x.py::t (call)"])
@pytest.mark.parametrize("client", [None, ("127.0.0.1", 5)])
async def test_task_debug_info_matches_mitmproxy(monkeypatch, restore, test_name, client):
    if test_name is None:
        monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    else:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test_name)
    results = []
    for impl in (mitm_hotpaths._ORIGINAL_DEBUG_INFO, None):
        if impl is None:
            mitm_hotpaths.install()
            impl = asyncio_utils.set_task_debug_info
            assert impl is not mitm_hotpaths._ORIGINAL_DEBUG_INFO
        task = asyncio.get_running_loop().create_task(_noop())
        impl(task, name="handle_hook(request)", client=client)
        await task
        results.append((task.get_name(), getattr(task, "client", None), isinstance(task.created, float)))
    assert results[0] == results[1]


async def test_create_task_still_names_tasks(restore):
    mitm_hotpaths.install()
    task = asyncio_utils.create_task(_noop(), name="hook", keep_ref=True, client=("127.0.0.1", 1))
    await task
    assert task.get_name().startswith("hook") and task.client == ("127.0.0.1", 1)


def _watchdog() -> server.TimeoutWatchdog:
    async def callback() -> None:
        return None

    return server.TimeoutWatchdog(30, callback)


def _trace(disarm) -> list:
    """The watchdog's state through nested disarms, one of them ending in an exception."""
    w = _watchdog()
    w.last_activity = 0.0
    seen = []
    with disarm(w):
        seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity))
        with pytest.raises(KeyError), disarm(w):
            seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity))
            raise KeyError("body failed")
        seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity))
    seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity > 0))
    return seen


async def test_disarm_matches_mitmproxy(restore):
    theirs = _trace(mitm_hotpaths._ORIGINAL_DISARM)
    mitm_hotpaths.install()
    assert server.TimeoutWatchdog.disarm is not mitm_hotpaths._ORIGINAL_DISARM
    ours = _trace(server.TimeoutWatchdog.disarm)
    assert ours == theirs == [(1, False, 0.0), (2, False, 0.0), (1, False, 0.0), (0, True, True)]
