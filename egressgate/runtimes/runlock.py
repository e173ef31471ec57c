"""Host-wide liveness of sandbox runs, for `sandbox gc`'s orphan sweep (runtimes/gc.py).

Why: product objects carry host-global names (netns `egressgate-<id>`, veths `egh<id>`, nft tables
`egressgate_<id>`, cgroups, containers), but a run's record lives in its own gateway's state dir. A gc
reading another state dir (a second gateway on the host, or `sandbox gc --state-dir`) cannot tell a live run
of another gateway from an orphan by records alone, and the sweep takes veths and nft tables with no grace.

So every run holds an exclusive flock on LOCK_DIR/<run_id> from before its first host object until its
watchdog exits (runtimes/watchdog.py: a fork that keeps the descriptor, so the lock outlives a SIGKILLed
`sandbox run` until the watchdog has cleaned up after it). gc counts every run id whose lock is held as live,
whatever state dir it belongs to. The kernel drops the lock when the last holder dies, so a run killed
together with its watchdog leaves an unlocked file: its objects are orphans, and gc takes them and the file.
Stdlib only (the CLI's start-up is measured).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path

LOCK_DIR = Path("/run/egressgate-runs")
ID = re.compile(r"[0-9a-f]{10}")


class LockFailed(RuntimeError):
    """The run's lock could not be taken (its directory is unusable, or the id is held by another run)."""


def hold(run_id: str, lock_dir: Path = LOCK_DIR) -> int:
    """Take `run_id`'s lock; returns the descriptor (>= 3, close-on-exec: exec'd helpers never carry it).
    The caller keeps it open for the run's life; the watchdog's fork inherits it."""
    try:
        lock_dir.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise LockFailed(f"cannot create the run lock directory {lock_dir}: {exc.strerror}") from None
    path = lock_dir / run_id
    for _ in range(3):  # gc unlinks an unlocked file: take the lock on the file that is still the path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise LockFailed(f"cannot create the run lock {path}: {exc.strerror}") from None
        if fd <= 2:  # stdio was closed: keep fds 0-2 free for the watchdog's /dev/null
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
            os.close(fd)
            fd = high
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockFailed(f"run id {run_id} is already held by another run") from None
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise LockFailed(f"the run lock {path} kept disappearing")


def release(run_id: str, fd: int, lock_dir: Path = LOCK_DIR) -> None:
    """A clean end: the file goes while still locked (nobody can mistake the run for an orphan meanwhile);
    the lock itself ends when the watchdog, the other holder, exits."""
    with contextlib.suppress(OSError):
        os.unlink(lock_dir / run_id)
    with contextlib.suppress(OSError):
        os.close(fd)


def held(lock_dir: Path = LOCK_DIR) -> set[str]:
    """Run ids whose lock is held right now. A lock file nobody holds is a dead run's: removed here (under
    the lock gc took for the check, so a run re-taking that id would see the path gone and retry).

    Fail closed: a lock that cannot be checked counts as held, and a directory that exists but cannot be
    listed raises LockFailed (gc then sweeps no orphans: it cannot tell live runs from dead ones)."""
    live: set[str] = set()
    try:
        names = os.listdir(lock_dir)
    except FileNotFoundError:  # no run of this version ever started on this host
        return live
    except OSError as exc:
        raise LockFailed(f"cannot list the run locks in {lock_dir}: {exc.strerror}") from None
    for name in names:
        if not ID.fullmatch(name):
            continue
        try:
            fd = os.open(lock_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # its run ended meanwhile
            continue
        except OSError:
            live.add(name)  # cannot be checked: treated as a live run's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(name)
        else:
            with contextlib.suppress(OSError):
                os.unlink(lock_dir / name)
        finally:
            os.close(fd)
    return live
