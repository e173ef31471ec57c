"""The run's watchdog: cleans up after a `sandbox run` killed with SIGKILL, within about a second, without
waiting for an operator's `sandbox gc`.

Why: a docker/gvisor container is owned by dockerd, not by `sandbox run`, so it keeps running after a
SIGKILL, its admission valid and its network path through the gateway open, with no wall-time limit;
for netns the workload dies (--die-with-parent) but namespace, veth, nft table, cgroups, address slot and
admission stay. `sandbox gc` remains the backstop (it needs nothing from this process).

How: right after the run record exists, `sandbox run` forks (no exec: ~1 ms, no second interpreter
start-up competing for the CPU) a child that starts a new session (no terminal signals), drops every
inherited fd but the read end of a pipe (so a caller reading `sandbox run`'s stdout/stderr sees EOF when
`sandbox run` exits, not when the watchdog does) and blocks reading that pipe. Only `sandbox run` holds
the write end (O_CLOEXEC: no workload, bwrap or docker process inherits it), so EOF means `sandbox run`
is gone, however it ended. Then the watchdog reads the record of ITS run id (known from before the
fork, never taken from the record): none → the teardown finished, exit; else it runs exactly the gc path
for that one record (gc.clean_record: processes killed, container removed, plumbing, cgroups and netns
deleted, then the revocation with `ended_by: watchdog`, then the record) and exits. clean_record only
touches names derived from the run id, so a watchdog cannot delete another run's objects.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

ENDED_BY = "watchdog"


def start(state_dir: Path, run_id: str, var_dir: Path, lock_fd: int | None = None) -> int:
    """Fork the watchdog of `run_id`; returns its pid. The pipe's write end stays open in this process
    until it exits (deliberately never closed: its closing by the kernel is the signal). `lock_fd`, the
    run's lock (runlock.py), stays open in the watchdog too: the run counts as live to `sandbox gc` until
    the watchdog has cleaned up after it."""
    read_end, write_end = (_above_stdio(fd) for fd in os.pipe())  # both O_CLOEXEC (PEP 446)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the watchdog
        code = 0
        try:
            os.close(write_end)
            _detach(read_end, lock_fd)
            _watch(read_end, parent, state_dir, run_id, var_dir)
        except BaseException:  # never return into `sandbox run`'s code in the child
            code = 1
        os._exit(code)
    os.close(read_end)
    _KEEP.append(write_end)
    return pid


_KEEP: list[int] = []  # the write ends, referenced so nothing closes them before exit


def _above_stdio(fd: int) -> int:
    """`sandbox run` started with stdio closed gets a pipe end as fd 0-2: its own prints would then write
    into the pipe, and the watchdog's /dev/null redirection would close it. Moved to fd >= 3."""
    if fd > 2:
        return fd
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return high


def _detach(read_end: int, lock_fd: int | None = None) -> None:
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    low = 3  # every other descriptor closes, `null` included (it is > 2 unless stdio was closed)
    for keep in sorted(fd for fd in (read_end, lock_fd) if fd is not None and fd > 2):
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, _max_fd())


def _max_fd() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


def _watch(read_end: int, parent: int, state_dir: Path, run_id: str, var_dir: Path) -> None:
    while os.read(read_end, 64):  # nothing is ever written: only EOF (b"") ends this
        pass
    # EOF alone is not proof: the kernel closes a dying process's files just before it reparents its
    # children, and an EOF from anything else (a bug, a closed fd reused) must never tear down a LIVE run.
    # The parent is gone once this process has been handed to another one.
    deadline = time.monotonic() + 5
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return  # still our parent: not ours to clean (`sandbox gc` is the backstop)
        time.sleep(0.005)
    cleanup(state_dir, run_id, var_dir)
    from egressgate.runtimes import records, runlock

    if records.read(state_dir, run_id) is None:  # all cleaned up: the lock file goes (the lock with this process)
        with contextlib.suppress(OSError):
            os.unlink(runlock.LOCK_DIR / run_id)


def cleanup(state_dir: Path, run_id: str, var_dir: Path) -> list[str]:
    """The gc path for one run whose `sandbox run` is gone; returns what was removed (tests)."""
    from egressgate.runtimes import records

    record = records.read(state_dir, run_id)
    if record is None:  # the teardown finished (the record goes last)
        return []
    record["run_id"] = run_id  # the id this watchdog was started for, whatever the file says
    from egressgate.runtimes import endpoints, gc

    removed = gc.clean_record(record, state_dir)
    try:
        info: endpoints.GatewayInfo | None = endpoints.load(var_dir)
    except endpoints.GatewayNotRunning:
        info = None
    if gc.revoke(info, record, ended_by=ENDED_BY) is None:
        records.remove(state_dir, run_id)  # else kept: `sandbox gc` retries the revocation
    return removed
