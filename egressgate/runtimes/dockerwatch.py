"""The counters of a container's cgroups, watched while it runs: a pids-limit hit and an OOM kill.

Why watch and not ask afterwards: a container's cgroups are removed as soon as it exits, and Docker's own
`State.OOMKilled` comes from containerd's OOM event, which is not reliable for every runtime (under gVisor a
memory-limit kill was reported as a plain SIGKILL now and then: the sentry is the process the kernel kills).
The kernel's counters are the truth, so they are read while the cgroup exists:

* pids (v1 or v2): `pids.events` `max N`, woken by poll(POLLPRI) on the kernel's notification;
* memory, cgroup v2: `memory.events` `oom_kill N`, woken the same way;
* memory, cgroup v1: `memory.oom_control` `oom_kill N` (kernel >= 4.13). Its file cannot be polled, so an
  eventfd is registered for the OOM notification through `cgroup.event_control` (what containerd does).
  The kernel signals it when the group hits OOM, which is before the kill, and once more when the group
  is removed; after a wake the counter is read until the kill shows (or the group is gone). An eventfd
  that counted 2 or more while the group went away saw an OOM (the removal signals exactly once).

Local daemon only (the cgroup must be visible here); with a remote daemon nothing is reported beyond
`State.OOMKilled`. A limit that is not hit costs one sleeping thread and a poll every 100 ms.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
TICK_MS = 100


def cgroup_files(pid: int, root: Path = CGROUP_ROOT) -> dict[str, Path]:
    """{'pids': pids.events, 'memory_v2': memory.events, 'memory_v1': the v1 memory group dir} of process
    `pid`, for those that exist."""
    found: dict[str, Path] = {}
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return found
    unified = (root / "cgroup.controllers").exists()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        rel = path.lstrip("/")
        if "pids" in names and (root / "pids" / rel / "pids.events").exists():
            found["pids"] = root / "pids" / rel / "pids.events"
        if "memory" in names and (root / "memory" / rel / "memory.oom_control").exists():
            found["memory_v1"] = root / "memory" / rel
        if controllers == "" and unified:
            for key, name in (("pids", "pids.events"), ("memory_v2", "memory.events")):
                if key not in found and (root / rel / name).exists():
                    found[key] = root / rel / name
    return found


def counter(text: str, key: str) -> int:
    """The value of `key N` in a cgroup counter file (0 when absent)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


class CgroupWatch:
    """One thread per container; `pids_hit` / `oom_killed` are set once the kernel counted the event."""

    def __init__(self, pid: int, root: Path = CGROUP_ROOT) -> None:
        self.files = cgroup_files(pid, root)
        self.pids_hit = threading.Event()
        self.oom_killed = threading.Event()
        self._stop = threading.Event()
        self._fds: dict[str, int] = {}
        self._oom_signals = 0
        self._gone: set[str] = set()
        for key in ("pids", "memory_v2"):
            if key in self.files:
                with contextlib.suppress(OSError):
                    self._fds[key] = os.open(self.files[key], os.O_RDONLY | os.O_CLOEXEC)
        if "memory_v1" in self.files:
            with contextlib.suppress(OSError):
                self._fds["eventfd"] = self._register_oom(self.files["memory_v1"])
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # stop() ends the poll at once
        self._thread = threading.Thread(target=self._run, name="cgroup-watch", daemon=True)

    @staticmethod
    def _register_oom(group: Path) -> int:
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            ofd = os.open(group / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                with open(group / "cgroup.event_control", "w") as fh:
                    fh.write(f"{efd} {ofd}")
            finally:
                os.close(ofd)  # the kernel holds its own reference to the file
        except OSError:
            os.close(efd)
            raise
        return efd

    def start(self) -> CgroupWatch:
        if self._fds:
            self._thread.start()
        return self

    def stop(self, grace: float = 2.0) -> None:
        """After the container exited: a last look at every counter, then the thread ends."""
        self._stop.set()
        if self._wake < 0:  # stopped before (wait(), then teardown())
            return
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)
        if self._thread.is_alive():
            self._thread.join(grace)
        if not self._thread.is_alive():
            for fd in [*self._fds.values(), self._wake]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds = {}
            self._wake = -1

    def _read(self, key: str) -> str | None:
        try:
            return os.pread(self._fds[key], 4096, 0).decode()
        except (OSError, KeyError):
            self._gone.add(key)  # the group is gone (the container exited): stop polling it
            return None

    def _check(self) -> None:
        text = self._read("pids") if "pids" in self._fds and "pids" not in self._gone else None
        if text is not None and counter(text, "max") > 0:
            self.pids_hit.set()
        text = self._read("memory_v2") if "memory_v2" in self._fds and "memory_v2" not in self._gone else None
        if text is not None and counter(text, "oom_kill") > 0:
            self.oom_killed.set()
        if "eventfd" in self._fds and not self.oom_killed.is_set():
            self._check_v1()

    def _drain(self) -> int:
        try:
            return os.eventfd_read(self._fds["eventfd"])
        except OSError:  # BlockingIOError: nothing signalled since the last read
            return 0

    def _check_v1(self) -> None:
        new = self._drain()
        if new == 0:
            return
        self._oom_signals += new
        # signalled: the OOM (before its kill) or the removal. Read the counter until the kill shows or the
        # group is gone (a kill follows its notification within microseconds; the removal takes far longer)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                text = (self.files["memory_v1"] / "memory.oom_control").read_text()
            except OSError:
                break
            if counter(text, "oom_kill") > 0:
                self.oom_killed.set()
                return
            time.sleep(0.002)
        self._oom_signals += self._drain()
        if self._oom_signals >= 2:  # an OOM notification besides the removal's
            self.oom_killed.set()

    def _run(self) -> None:
        poller = select.poll()
        for key, fd in self._fds.items():
            poller.register(fd, select.POLLIN if key == "eventfd" else select.POLLPRI | select.POLLERR)
        poller.register(self._wake, select.POLLIN)
        while True:
            self._check()
            for key in self._gone & self._fds.keys():
                with contextlib.suppress(KeyError):
                    poller.unregister(self._fds[key])  # a removed group's file polls ready for ever
            if self._stop.is_set() or (self.pids_hit.is_set() and self.oom_killed.is_set()):
                return
            poller.poll(TICK_MS)
