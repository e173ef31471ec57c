"""One writer per audit file: an exclusive lock held for as long as a sink writes a file.

A hash chain has one writer. Without this, a second process started on the same audit file (two gateways
with one config, replicas sharing a var dir, a supervisor restarted while its old workers still drain;
SO_REUSEPORT lets both serve) finds the live file unsealed, appends a `recovery` seal and a chain of its
own to it while the first keeps appending: the trail no longer verifies. The second one is refused at
start instead.

The lock is `flock` on `<file>.lock` beside the audit file (not on the file itself: the live file is
renamed at rotation and after outside changes, the lock file never is). The kernel drops it when the
holder dies, even by kill -9, so a crashed writer never blocks its restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class AuditFileBusy(RuntimeError):
    """Another process writes this audit file."""


def hold(path: Path) -> int:
    """acquire(), creating the audit directory first (0700, like the sink does)."""
    from egressgate.audit.filewatch import secure_directory

    secure_directory(path.parent)
    return acquire(path)


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def acquire(path: Path) -> int:
    """Take the writer lock of audit file `path` (its directory exists); the fd to pass to release()."""
    lock = lock_path(path)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AuditFileBusy(
            f"another process (pid {holder}) is writing the audit file {path}: a hash chain has one writer. "
            "Stop that gateway, or give this one its own `audit.path` / var dir") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the only descriptor drops the flock
