"""Polling for a condition the gateway reaches asynchronously (a batched audit write, a reload)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Every caller waits for something that must happen (none uses a timeout to prove that something does not), so a
# longer deadline costs nothing when the test passes. Deadlines of 5 s failed on a 2-core machine with one core
# busy and four test workers (an outcome record behind a tunnel's close took longer): a timing assumption.
TIMEOUT_FLOOR = 60.0


def wait_for(predicate: Callable[[], Any], timeout: float = TIMEOUT_FLOOR, interval: float = 0.05) -> Any:
    """True as soon as `predicate()` is truthy; after max(`timeout`, TIMEOUT_FLOOR), whatever one final call
    returns."""
    deadline = time.monotonic() + max(timeout, TIMEOUT_FLOOR)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
