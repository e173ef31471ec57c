"""cgroup primitives for the resource limits of a run: find the hierarchies, one group directory, kill a tree.

Two kernel interfaces exist and a host may have both ("hybrid": v1 controllers under /sys/fs/cgroup/<name>
plus a controller-less cgroup2 at /sys/fs/cgroup/unified, as on the machines this was written on). Nothing
here decides policy: limits.py picks the hierarchies and writes the limits; this module only reads
/proc/self/mountinfo, creates/removes directories, reads/writes interface files, and kills what a group
holds. Interface files are opened WITHOUT O_CREAT: on cgroupfs a missing file means a missing feature, and
creating a plain file instead would make an unenforced limit look set.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
KILL_TIMEOUT = 10.0  # seconds kill_group may take before it gives up and says which processes remain


class CgroupError(RuntimeError):
    """A cgroup operation failed in a way the caller must not ignore (processes survived a kill, ...)."""


@dataclass(frozen=True)
class Mounts:
    """The cgroup hierarchies this process sees: the cgroup2 mount (if any) and v1 controller → mount point."""

    v2: Path | None = None
    v1: dict[str, Path] = field(default_factory=dict)

    def v2_controllers(self) -> set[str]:
        """Controllers the cgroup2 root offers (empty on a hybrid host: they are bound to v1 hierarchies)."""
        if self.v2 is None:
            return set()
        try:
            return set((self.v2 / "cgroup.controllers").read_text().split())
        except OSError:
            return set()


def _unescape(field_: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def read_mounts(mountinfo: Path = MOUNTINFO) -> Mounts:
    """Parse mountinfo (proc(5)): fields before " - " are the mount, after it fstype, source, super options.

    cgroup2 at /sys/fs/cgroup is preferred over any other cgroup2 mount (the pure-v2 layout); for v1, the
    super options name the controllers bound to that hierarchy ("rw,cpu,cpuacct"); named hierarchies
    (name=systemd) bind none and are ignored. The first mount of a hierarchy wins."""
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in mountinfo.read_text().splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = Path(_unescape(fields[4]))
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            if v2 is None or point == Path("/sys/fs/cgroup"):
                v2 = point
        elif fstype == "cgroup":
            for opt in options:
                if opt in ("rw", "ro") or "=" in opt or opt in ("noprefix", "clone_children", "xattr"):
                    continue
                v1.setdefault(opt, point)
    return Mounts(v2=v2, v1=v1)


def swap_active(swaps: Path = Path("/proc/swaps")) -> bool:
    """Whether any swap device is on (then "swap off for the workload" needs the cgroup's swap limit)."""
    try:
        return len(swaps.read_text().strip().splitlines()) > 1
    except OSError:
        return False


def make_dir(path: Path) -> None:
    """mkdir of a cgroup (the kernel populates its interface files). make_dir and remove_dir are module
    functions so a fake cgroupfs in tests can play the kernel's part."""
    os.mkdir(path, 0o755)


def remove_dir(path: Path) -> None:
    """rmdir of a cgroup (allowed with its interface files in it, refused with EBUSY while populated)."""
    os.rmdir(path)


@dataclass(frozen=True)
class Group:
    """One cgroup directory in one hierarchy (version 1 or 2)."""

    path: Path
    version: int

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def write(self, name: str, value: str) -> None:
        """Write one value; no O_CREAT (see the module docstring). Raises OSError as the kernel reports it."""
        fd = os.open(self.path / name, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def events(self, name: str) -> dict[str, int]:
        """A flat-keyed file ("key value" per line: memory.events, pids.events, memory.oom_control)."""
        out: dict[str, int] = {}
        for line in self.read(name).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
        return out

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.read("cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def populated(self) -> bool:
        """v2: cgroup.events says so (it counts every descendant); v1: any process listed."""
        if self.version == 2 and self.has("cgroup.events"):
            return self.events("cgroup.events").get("populated", 0) != 0
        return bool(self.pids())

    def exists(self) -> bool:
        return self.path.is_dir()

    def remove(self, timeout: float = 2.0) -> None:
        """rmdir, idempotent. EBUSY right after a kill is transient (exiting tasks still charged): retry."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                remove_dir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise CgroupError(f"cannot remove cgroup {self.path}: {e.strerror}") from e
                time.sleep(0.02)


def _sigkill_all(groups: list[Group]) -> int:
    """One round of SIGKILL to every listed process; returns how many were signalled."""
    n = 0
    for g in groups:
        for pid in g.pids():
            try:
                os.kill(pid, signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
    return n


def _wait_frozen(freezer: Group, deadline: float) -> None:
    while time.monotonic() < deadline:
        if freezer.read("freezer.state").strip() == "FROZEN":
            return
        time.sleep(0.005)


def kill_group(groups: list[Group], timeout: float = KILL_TIMEOUT) -> None:
    """SIGKILL every process in `groups` (the same processes seen through several hierarchies) until none is
    left, so a fork bomb cannot outrun the kill.

    Strongest available first: a v2 group with cgroup.kill (one atomic kernel operation: the tasks, and any
    task forked meanwhile, are killed); else a v1 freezer group (freeze: no task runs so none can fork; list;
    SIGKILL; thaw: each dies on return to user space); else repeated SIGKILL rounds (a task with SIGKILL
    pending cannot complete a fork, so rounds converge). A final SIGKILL sweep over every group runs in all
    cases. Raises CgroupError if processes remain after `timeout`."""
    deadline = time.monotonic() + timeout
    live = [g for g in groups if g.exists()]
    v2 = next((g for g in live if g.version == 2 and g.has("cgroup.kill")), None)
    freezer = next((g for g in live if g.version == 1 and g.has("freezer.state")), None)
    if v2 is not None:
        v2.write("cgroup.kill", "1")
    while time.monotonic() < deadline:
        if not any(g.populated() for g in live):
            return
        if v2 is None and freezer is not None:
            freezer.write("freezer.state", "FROZEN")
            try:
                _wait_frozen(freezer, min(deadline, time.monotonic() + 1.0))
                _sigkill_all(live)
            finally:
                freezer.write("freezer.state", "THAWED")  # killed tasks die only once thawed
        elif v2 is not None:
            v2.write("cgroup.kill", "1")
            _sigkill_all(live)
        else:
            _sigkill_all(live)
        time.sleep(0.01)
    left = sorted({p for g in live for p in g.pids()})
    raise CgroupError(f"processes survived SIGKILL for {timeout:.0f} s in {[str(g.path) for g in live]}: {left}")
