"""Run records: `state_dir/runs/<run_id>.json`, one per `sandbox run`, written BEFORE each host object is
created and removed after teardown, so `sandbox gc` can find what a run killed with SIGKILL left behind.

A record names every object of the run (netns, veth, nft table, cgroups, container, address slot) and
the pid of its `sandbox run` (`owner_pid`): a record whose owner is dead is garbage. Writes are atomic
(temp file + rename), so a crash never leaves a half-written record that gc could not read.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_ID_RE = re.compile(r"^[0-9a-f]{10}$")


def new_run_id() -> str:
    """10 hex characters: unique on this host in practice, and short enough for interface names
    (`egh` + id = 13 bytes, the kernel allows 15)."""
    return secrets.token_hex(5)


def runs_dir(state_dir: Path) -> Path:
    return state_dir / "runs"


def record_path(state_dir: Path, run_id: str) -> Path:
    return runs_dir(state_dir) / f"{run_id}.json"


def write(state_dir: Path, run_id: str, record: dict[str, Any]) -> None:
    path = record_path(state_dir, run_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    tmp.replace(path)


def update(state_dir: Path, run_id: str, **changes: Any) -> dict[str, Any]:
    record = read(state_dir, run_id) or {"run_id": run_id}
    record.update(changes)
    write(state_dir, run_id, record)
    return record


def read(state_dir: Path, run_id: str) -> dict[str, Any] | None:
    try:
        return json.loads(record_path(state_dir, run_id).read_text())
    except (OSError, ValueError):
        return None


def remove(state_dir: Path, run_id: str) -> None:
    record_path(state_dir, run_id).unlink(missing_ok=True)


def all_records(state_dir: Path) -> Iterator[dict[str, Any]]:
    """Every readable record (unreadable ones are skipped: gc reports them by name)."""
    directory = runs_dir(state_dir)
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("*.json")):
        if not RUN_ID_RE.match(path.stem):
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            record["run_id"] = path.stem
            yield record


def pid_alive(pid: int | None) -> bool:
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
