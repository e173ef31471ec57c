"""`sandbox.workspace.max_bytes`: watch the bytes a run keeps in its workspace and end the run past the limit.

Why polling: the workspace is a host directory that survives the run (`--workspace`), on whatever file system
the operator has. Kernel-enforced alternatives were considered and rejected for this version: a size-capped
tmpfs or loop-mounted image does not persist as a plain directory (copying in and out costs time and disk);
ext4/XFS project quotas need the file system created and mounted for them, which a runtime cannot assume;
RLIMIT_FSIZE caps one file, not the total. So a thread walks the tree and calls `on_exceed` (the run's kill)
once the total is over the limit.

What counts: st_size of regular files, from lstat (symlinks are not followed, so a link to a big host file
costs nothing and cannot make the walk leave the workspace), each inode once (hard links), not descending into
other file systems. Bounded work: at most `entries_per_tick` entries are examined per tick, then the thread
sleeps `interval`; a pass over E entries therefore takes ceil(E / entries_per_tick) ticks and the CPU spent is
bounded whatever the workload creates.

Overshoot bound: bytes written in a part of the tree the current pass has already walked are seen by the
next pass, so the total is found over the limit at most 2 x D after it crossed it, D being the duration of a
pass including its sleeps (D = ceil(E / entries_per_tick) x interval + walk time; for E <= entries_per_tick,
one pass per tick, detection takes at most interval + 2 x walk time, about 0.2 s with the defaults). The
workspace can thus hold up to `max_bytes + write_rate x 2 x D`, plus what is written while on_exceed kills
the tree. Sizes are summed over a pass while the
workload changes files, so a workload that churns files close to the limit can be judged over it (the error
is on the side of ending the run). Apparent sizes are counted: a sparse file counts at its full length.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


def _entries(root: Path) -> Iterator[tuple[int, int, int] | None]:
    """(dev, ino, size) for each regular file under root, None for any other entry (it still costs work).
    Errors (a file removed mid-walk, an unreadable directory) skip that entry: the workload can only make
    its own files vanish, which can only lower the total."""
    try:
        top = os.lstat(root)
    except OSError:
        return
    stack = [os.fspath(root)]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        yield None
                        continue
                    if stat.S_ISREG(st.st_mode):
                        yield st.st_dev, st.st_ino, st.st_size
                        continue
                    if stat.S_ISDIR(st.st_mode) and st.st_dev == top.st_dev:
                        stack.append(entry.path)
                    yield None
        except OSError:
            yield None


class WorkspaceWatch:
    """Started after the workload starts, stopped at the end (then `exceeded` says whether it fired)."""

    def __init__(self, path: Path, max_bytes: int, on_exceed: Callable[[], None], interval: float = 0.2,
                 entries_per_tick: int = 20_000) -> None:
        if max_bytes <= 0 or entries_per_tick <= 0 or interval <= 0:
            raise ValueError("max_bytes, interval and entries_per_tick must be positive")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.on_exceed = on_exceed
        self.interval = interval
        self.entries_per_tick = entries_per_tick
        self.exceeded = False
        self.used = 0  # total of the last complete pass
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._walk: Iterator[tuple[int, int, int] | None] | None = None
        self._seen: set[tuple[int, int]] = set()
        self._total = 0

    def tick(self, stop_early: bool = True) -> bool:
        """One bounded step of the current pass; True once the total is over the limit (then on_exceed ran).
        The pass stops at the first byte over the limit unless `stop_early` is False (scan: full total)."""
        if self._walk is None:
            self._walk, self._seen, self._total = _entries(self.path), set(), 0
        for _ in range(self.entries_per_tick):
            item = next(self._walk, StopIteration)
            if item is StopIteration:
                self.used, self._walk = self._total, None
                self.passes += 1
                break
            if item is None:
                continue
            dev, ino, size = item
            if (dev, ino) in self._seen:
                continue
            self._seen.add((dev, ino))
            self._total += size
            if stop_early and self._total > self.max_bytes:
                break
        if self._total > self.max_bytes and not self.exceeded:
            self.exceeded = True
            self.used = max(self.used, self._total)  # a lower bound when the pass stopped early
            self.on_exceed()
        return self.exceeded

    def scan(self) -> int:
        """A complete pass now, in the caller's thread, with the watch thread stopped (the final check at the
        end of a run: it also fires on_exceed if the total is over); returns the total in bytes."""
        self._walk = None
        passes = self.passes
        while self.passes == passes:
            self.tick(stop_early=False)
        return self.used

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.tick():
                return
            self._stop.wait(self.interval)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("WorkspaceWatch already started")
        self._thread = threading.Thread(target=self._run, name=f"workspace-watch:{self.path}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
