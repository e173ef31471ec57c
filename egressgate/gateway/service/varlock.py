"""One gateway per var dir: an exclusive `flock` on `var_dir/gateway.lock`, taken before anything else.

Why: everything in the var dir belongs to the gateway that runs on it — `gateway.json` (where every CLI
command finds the admin API), the audit chain, the CA, the keys and tokens. A second `egressgate run` on the
same var dir used to get as far as its audit writer lock (or a busy port) before it refused, and on the way
out it removed the *running* gateway's `gateway.json`: every later CLI command then aimed at the wrong admin
port. Taking this lock first makes ownership explicit: a refused start has written, rewritten or removed
nothing, and a gateway removes on its way out only what it wrote itself.

`egressgate run` takes it in the process that publishes `gateway.json` (the single gateway, or the
supervisor of `--workers N`; workers run under their supervisor's lock). The kernel drops the lock when its
holder dies, even by kill -9, so a crashed gateway never blocks its restart. The file holds the holder's pid
(for the refusal message only: the lock, not the file's content, decides).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

LOCK_NAME = "gateway.lock"


class VarDirBusy(RuntimeError):
    """Another gateway runs on this var dir; the message is the one sentence `run` prints."""


class VarDirLock:
    """The held lock of one var dir; release() (idempotent) closes it."""

    def __init__(self, var: Path, fd: int) -> None:
        self.var = var
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def claim(var: Path) -> VarDirLock:
    """Create `var` (0700) if needed and lock it for this process; VarDirBusy when another gateway holds it.
    O_CLOEXEC: worker processes and sandboxes started later never inherit (and never keep) the lock."""
    var.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = var / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise VarDirBusy(f"not starting: another gateway (pid {holder}{_admin_of(var)}) already runs on var dir "
                         f"{var.absolute()}; stop it first, or give this one its own var_dir") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return VarDirLock(var, fd)


def _admin_of(var: Path) -> str:
    """", admin 127.0.0.1:8081" from the running gateway's gateway.json, when it is readable."""
    try:
        admin = json.loads((var / "gateway.json").read_text(encoding="utf-8"))["admin"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f", admin {admin}"
