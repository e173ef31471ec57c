"""One host uid/gid per run, from `runtime.uid_range`: no sandbox can read, signal or trace another's
files or processes, because none of them shares a uid with another (or with `nobody`).

Why a range and not 65534 for everyone: a uid is the kernel's unit of "same principal". Two sandboxes
running as the same host uid could read each other's owner-only workspace files, /proc/<pid>/environ and
signal or ptrace each other whatever the mounts hide, and a local `nobody` process could do the same.

The uid is taken together with the run's /30 (addressing.allocate, under the same flock on
`state_dir/addresses.lock`) and written to the run record (`uid`, `gid`) before the lock is released;
it stays taken while the record exists, so a run killed with SIGKILL keeps its uid until its watchdog or
`sandbox gc` has killed what was left and removed the record. A uid that still owns a host process is
skipped too (a leftover the record no longer names). gid = uid: the same number, one group per run.

Gateways that share a host must be given disjoint ranges: allocation is per state dir, like addresses.
Stdlib only (`sandbox run` start-up budget).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

# above every 16-bit id (real users, `nobody` 65534, systemd's dynamic users 61184-65519) and below
# 100000, where useradd starts the subordinate ranges of /etc/subuid (rootless containers) and far below
# systemd's container range (524288+). 34464 uids: more than the 8192 /30s of the default runtime.subnet.
DEFAULT_UID_RANGE = "65536-99999"
# uids below this are the host's own (users, system accounts, nobody); (uid_t)-1 is "no change" to chown
MIN_UID = 65536
MAX_UID = 2**32 - 2
RANGE_RE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


class UidsExhausted(RuntimeError):
    """Every uid of the range is held by a run record or a live process: run `sandbox gc` or widen it."""


def parse_range(value: str, key: str = "runtime.uid_range") -> tuple[int, int]:
    """"FIRST-LAST" (inclusive) → (first, last); ValueError naming `key` for anything else, and for a
    range that reaches the host's own ids (0-65535: root, users, nobody) or past the largest valid uid."""
    match = RANGE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{key} must be 'FIRST-LAST' (e.g. {DEFAULT_UID_RANGE!r}), got {value!r}")
    first, last = int(match.group(1)), int(match.group(2))
    if first > last:
        raise ValueError(f"{key} {value!r}: the first uid is larger than the last")
    if first < MIN_UID:
        raise ValueError(f"{key} {value!r} overlaps the host's own ids 0-{MIN_UID - 1} (root, users, nobody): "
                         f"sandboxes would share a uid with them; start at {MIN_UID} or above")
    if last > MAX_UID:
        raise ValueError(f"{key} {value!r} goes past the largest valid uid {MAX_UID}")
    return first, last


def _alive(pid: str) -> bool:
    """Not a zombie: a killed sandbox process waits for init to reap it, and must not hold its uid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def host_process_uids(first: int, last: int) -> set[int]:
    """Owners (effective uid, the owner of /proc/<pid>) of live host processes within [first, last]. A
    stat per process: about a millisecond for a few hundred processes."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    uid = os.stat(f"/proc/{name}").st_uid
                    if first <= uid <= last and uid not in found and _alive(name):
                        found.add(uid)
    return found


def pick(taken: set[int], first: int, last: int, where: str) -> int:
    """The lowest uid of [first, last] not in `taken` (record uids) and owning no host process."""
    busy = taken | host_process_uids(first, last)
    for uid in range(first, last + 1):
        if uid not in busy:
            return uid
    raise UidsExhausted(f"all {last - first + 1} uids of runtime.uid_range {first}-{last} are held by run "
                        f"records in {where} or by running processes: run `egressgate sandbox gc` or widen "
                        "runtime.uid_range")


def uid_pids(uid: int) -> list[int]:
    """Live (not zombie) host processes whose real, effective, saved or filesystem uid is `uid`."""
    pids = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status", encoding="ascii", errors="replace") as fh:
                    line = next((x for x in fh if x.startswith("Uid:")), "")
            except OSError:
                continue
            if str(uid) in line.split()[1:] and _alive(name):
                pids.append(int(name))
    return pids


def kill_uid(uid: object) -> list[int]:
    """SIGKILL every host process of a dead run's uid (a record is data: only uids of a sandbox range,
    never the host's own below MIN_UID, are ever touched). Returns the pids signalled."""
    if not isinstance(uid, int) or isinstance(uid, bool) or not MIN_UID <= uid <= MAX_UID:
        return []
    pids = uid_pids(uid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def is_sandbox_uid(uid: int, uid_range: tuple[int, int] | None) -> bool:
    """A uid some sandbox runs or ran as: the range's, or 65534 (every run before per-run uids, and
    RunSpecs built outside `sandbox run`)."""
    return uid == 65534 or (uid_range is not None and uid_range[0] <= uid <= uid_range[1])


def chown_tree(top: Path, uid: int, gid: int, owned: Callable[[int], bool]) -> int:
    """Give every entry of the tree at `top` (itself included) whose owner satisfies `owned` to uid:gid;
    returns how many changed. Walked by directory fds without following any symlink (a link is chowned
    itself, never its target), so an entry a sandbox swapped for a link mid-walk cannot send the chown
    outside the tree. Files the operator placed (other owners) keep theirs. A chown by root clears set-id
    bits of regular files, which is wanted here too."""
    changed = 0
    top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(top_fd)
        if owned(st.st_uid) and (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(top_fd, uid, gid)
            changed += 1
        for _root, dirs, files, dir_fd in os.fwalk(".", follow_symlinks=False, dir_fd=top_fd):
            for name in [*dirs, *files]:
                with contextlib.suppress(FileNotFoundError):
                    entry = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if owned(entry.st_uid) and (entry.st_uid, entry.st_gid) != (uid, gid):
                        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
                        changed += 1
    finally:
        os.close(top_fd)
    return changed
