"""The run ids of ONE gateway's runs, so "nothing left behind" checks look only at that gateway's objects.

Product netns (`/run/netns/egressgate-<id>`) and cgroups (`egressgate/<id>`) are host-global names: a run of
another test worker (tests/support/scheduling.py runs the host groups side by side) or of another checkout's
test run on this host appears and disappears there at any time. A leftover check that listed them host-wide
failed on other runs' objects; one that only looks at objects of run ids this gateway handed out cannot.

Where the ids come from: every run writes its record `state_dir/runs/<id>.json` BEFORE it creates its first
host object (egressgate/runtimes/records.py), as a temp file renamed into place, and removes it after
teardown. An inotify watch on that directory, set up before the gateway starts, sees every id ever written
there: the kernel queues the events (no polling, so no run is missed however short it lives), and
`RunIds.seen()` drains the queue whenever a test asks. An id whose record a SIGKILL left behind is also in
the directory itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
from pathlib import Path

IN_CREATE, IN_MOVED_TO, IN_Q_OVERFLOW, IN_IGNORED = 0x100, 0x80, 0x4000, 0x8000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then `len` bytes of name
_ID = re.compile(r"^([0-9a-f]{10})\.(json|tmp\d+)$")


class RunIds:
    """Watches `runs_dir` (created here, mode 0700 as records.write makes it) from now on."""

    def __init__(self, runs_dir: Path) -> None:
        runs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runs_dir = runs_dir
        self._ids: set[str] = set()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if self._libc.inotify_add_watch(self._fd, str(runs_dir).encode(), IN_CREATE | IN_MOVED_TO) < 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"inotify_add_watch {runs_dir}")

    def seen(self) -> set[str]:
        """Every run id written to the directory since the watch began (plus the records in it now)."""
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size: offset + _EVENT.size + length].split(b"\0", 1)[0].decode()
                offset += _EVENT.size + length
                if mask & (IN_Q_OVERFLOW | IN_IGNORED):  # never silently incomplete: no check passes on lost ids
                    raise RuntimeError(f"the watch of {self.runs_dir} lost events or ended (mask {mask:#x})")
                if m := _ID.match(name):
                    self._ids.add(m.group(1))
        self._ids |= {p.stem for p in self.runs_dir.glob("*.json") if _ID.match(p.name)}
        return set(self._ids)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
