"""Two helpers mitmproxy 12.3.1 runs for every hook of every flow, with the same effects at less cost.

Why: mitmproxy runs each hook in a task of its own (`asyncio_utils.create_task`), whose debug helper
`set_task_debug_info` reads `os.environ["PYTEST_CURRENT_TEST"]` every time (an encode + a dict lookup
through `os._Environ`), and wraps it in `TimeoutWatchdog.disarm()`, a `@contextmanager` generator. Four
hooks or more per request: in the issue 11 profiles the environment lookup was ~1.6 % and the generator
context manager ~2.4 % of the gateway's samples. Neither does anything the gateway needs to pay for:

* `set_task_debug_info`: the same name, creation time and client on every task; the test name it adds
  exists only under pytest, so it is read once, at install, instead of per task.
* `TimeoutWatchdog.disarm`: the same bookkeeping (clear `can_timeout`, count blockers, on the last exit
  register activity and set `can_timeout`, also when the body raises) as a plain class.

Re-check both against mitmproxy's source on any upgrade (tests/gateway/test_mitm_hotpaths.py compares
the behaviour with mitmproxy's originals).
"""

from __future__ import annotations

import asyncio
import os
import time

from mitmproxy.proxy import server
from mitmproxy.utils import asyncio_utils

_ORIGINAL_DEBUG_INFO = asyncio_utils.set_task_debug_info
_ORIGINAL_DISARM = server.TimeoutWatchdog.disarm


def _make_debug_info(test: str | None):
    suffix = f" [created in {test}]" if __debug__ and test else ""

    def set_task_debug_info(task: asyncio.Task, *, name: str, client: tuple | None = None) -> None:
        """mitmproxy's set_task_debug_info, with the test name read once (see the module docstring)."""
        task.created = time.time()  # type: ignore[attr-defined]
        task.set_name(name + suffix if suffix else name)
        if client:
            task.client = client  # type: ignore[attr-defined]

    return set_task_debug_info


class _Disarmed:
    """`with watchdog.disarm():` as mitmproxy's generator does it, without the generator."""

    __slots__ = ("_w",)

    def __init__(self, watchdog: server.TimeoutWatchdog) -> None:
        self._w = watchdog

    def __enter__(self) -> None:
        w = self._w
        w.can_timeout.clear()
        w.blocker += 1

    def __exit__(self, *exc: object) -> bool:
        w = self._w
        w.blocker -= 1
        if w.blocker == 0:
            w.register_activity()
            w.can_timeout.set()
        return False


def _disarm(self: server.TimeoutWatchdog) -> _Disarmed:
    return _Disarmed(self)


def install() -> None:
    """Swap both in for this process (idempotent)."""
    asyncio_utils.set_task_debug_info = _make_debug_info(os.environ.get("PYTEST_CURRENT_TEST"))
    server.TimeoutWatchdog.disarm = _disarm  # type: ignore[method-assign]


def uninstall() -> None:
    asyncio_utils.set_task_debug_info = _ORIGINAL_DEBUG_INFO
    server.TimeoutWatchdog.disarm = _ORIGINAL_DISARM  # type: ignore[method-assign]
