"""Processes the tests started, seen through /proc: a supervisor's worker pids, and whether a pid still runs.

Shared by the supervisor tests without Redis (tests/gateway/test_supervisor.py) and with it
(tests/state_redis/workers_support.py)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> set[int]:
    """The pids of `pid`'s children (empty once it is gone)."""
    try:
        return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def alive(pid: int) -> bool:
    """True while `pid` runs: a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:  # the state follows the command name in parentheses, which may itself hold spaces or ")"
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
