"""Polling for a condition the gateway reaches asynchronously (a batched audit write, a reload)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.05) -> Any:
    """True as soon as `predicate()` is truthy; after `timeout`, whatever one final call returns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
