"""The live audit file and its answers to faults of the trail itself: a crashed previous run, size rotation,
the file deleted, moved or truncated from outside. A collaborator of `FileSink` (filesink.py keeps the
writer task and the write path); the writer task is its caller (see below), so no lock is needed.

Rules enforced here:
* a file a crash left unsealed is sealed at restart by a signed `recovery` checkpoint, only if its unsigned
  tail verifies (recovery.py);
* when the file at `path` is no longer the one being written (deleted, moved, truncated), the old file is
  sealed (a deleted one is copied out of its still-open inode first), a new file continues the chain from
  the last record, and an `audit_incident` record right after its `chain_start` says what happened;
* rotation seals the file it wrote, wherever an outside `mv` put it, and restarts the chain in a new file.

The chain itself (`ChainHead`: the writer, the previous file's name, the incidents to write after the next
`chain_start`) is shared with the sink, which appends every batch to it; sealing and restarting go through
the sink's `append` (one batch: chain, encode, write). Besides the writer task, only a batch the sink
writes while that task is parked on an empty queue calls in (`settled`, no await: never both at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from egressgate.audit.chain import KIND_RECOVERY, ChainWriter, incident_record
from egressgate.audit.checkpointer import Checkpointer
from egressgate.audit.event import AuditUnavailable
from egressgate.audit.filewatch import (
    FileChange,
    file_change,
    find_by_inode,
    give_back,
    located,
    newest_rotated,
    rename_by_name,
    rotated_name,
    salvage_deleted,
    secure_directory,
)
from egressgate.audit.record import Record
from egressgate.audit.recovery import TailState, append_seal, inspect_tail

log = logging.getLogger("egressgate.audit.filesink")
MAX_INCIDENTS = 20
FSTAT_INTERVAL = 0.01
Append = Callable[..., Awaitable[None]]  # FileSink._append(records, *, checkpoint=False, final=False)


class ChainHead:
    """Where the chain stands: its writer, the file the next `chain_start` links to, and the incident records
    written right after it. Shared by the sink (every batch) and the trail (restarts, incidents)."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self.writer = ChainWriter()
        self.prev_file: str | None = None
        self.incident_next: list[Record] = []  # written right after the next chain_start
        self.incidents: list[dict] = []  # shown in /healthz

    def restart(self, prev_file: str | None) -> None:
        """A new file: seq 0 again, linked to the last hash (and still counting what no signature covers)."""
        state = self.writer.state
        self.writer = ChainWriter(prev=state.prev, since_signed=state.since_signed)
        self.prev_file = prev_file

    def incident(self, kind: str, detail: str, extra: dict | None = None) -> None:
        log.critical("AUDIT TRAIL INCIDENT %s: %s", kind, detail)
        self.incident_next.append(incident_record(self._clock(), kind, detail, extra))
        self.incidents.append({"incident": kind, "detail": detail, "at": time.time()})
        del self.incidents[:-MAX_INCIDENTS]


class Trail:
    """The file at `path` the sink writes: its descriptor and size, its checks, rotation and fault answers."""

    def __init__(
        self, path: Path, head: ChainHead, cp: Checkpointer, append: Append, *, fsync: bool, watch_interval: float
    ) -> None:
        self.path = path
        self.head = head
        self._cp = cp
        self._append = append
        self.fsync = fsync
        self.watch_interval = watch_interval  # how often the writer checks the file is still `path`
        self.fd: int | None = None
        self.size = 0
        self._last_watch = time.monotonic()
        self._last_fstat = 0.0
        self.rotations = 0
        self.rotation_step: Callable[[str, Path | None], None] | None = None  # tests: outside moves (rotate)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # --- start: seal what a crash left, then start a new file linked to it ------------------------

    async def open_initial(self) -> None:
        assert self.path is not None
        tail_path, tail = await asyncio.to_thread(self._previous_tail)
        last = tail.last_hash if tail is not None and tail.last_hash else None
        since_signed = tail.since_signed if tail is not None else 0
        if tail is not None and not tail.sealed:
            last, since_signed = await self._seal_crashed(tail, tail_path)
        if os.path.lexists(self.path) and os.stat(self.path, follow_symlinks=False).st_size > 0:
            rotated = rotated_name(self.path)  # a previous run's file: never append to it
            os.rename(self.path, rotated)
            self.head.writer = ChainWriter(prev=last or ChainWriter().state.prev, since_signed=since_signed)
            self.head.prev_file = rotated.name
        elif tail is not None and tail_path != self.path:  # an empty live file: link to the rotated one
            self.head.writer = ChainWriter(prev=last or ChainWriter().state.prev, since_signed=since_signed)
            self.head.prev_file = tail_path.name
        await asyncio.to_thread(self._open_new)

    def _previous_tail(self) -> tuple[Path, TailState | None]:
        """The file the new chain continues and its tail: the live file, or, when the live file exists
        but is empty, the newest rotated one. An empty live file is what a run leaves that rotated (or
        opened) it and was stopped before its first record (chain_start is written with the first
        batch): without the link, the next file started a new chain and the history of this chain's
        writer (e.g. a restarted worker of `run --workers N`) was cut in two. A MISSING live file is not
        linked over: if it held records, that is a deletion `verify` must still see as a break."""
        assert self.path is not None
        secure_directory(self.path.parent)
        if not os.path.lexists(self.path):
            return self.path, None
        st = os.stat(self.path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise AuditUnavailable(f"{self.path}: audit path is not a regular file")
        if st.st_size > 0:
            return self.path, inspect_tail(self.path)
        prior = newest_rotated(self.path)
        return (prior, inspect_tail(prior)) if prior is not None else (self.path, None)

    async def _seal_crashed(self, tail: TailState, path: Path) -> tuple[str, int]:
        """Append a `recovery` checkpoint to a file the previous run did not seal (kill -9, power loss)."""
        assert self.path is not None
        if tail.problem is not None:
            detail = (
                f"the previous audit file was not sealed and its unsigned tail does not verify "
                f"({tail.problem}); it was NOT signed at restart - run `egressgate audit verify`"
            )
            self.head.incident("crash_tail_invalid", detail)
            return tail.last_hash, tail.since_signed
        chain = ChainWriter(prev=tail.last_hash, seq=tail.last_seq + 1, since_signed=tail.since_signed)
        extra = {
            "egressgate.recovery.reason": "the gateway stopped without sealing this file (crash, kill -9 or "
            "power loss); sealed when it started again",
            "egressgate.recovery.last_record_time": str(tail.last_time_ns),
            "egressgate.recovery.cut_bytes": tail.partial,
        }
        line, _ = await self._cp.make(chain, KIND_RECOVERY, extra)
        await asyncio.to_thread(append_seal, path, line, tail.complete_size, self.fsync)
        detail = (
            f"the previous run stopped without sealing its audit file after seq {tail.last_seq}; "
            f"sealed at restart with a recovery checkpoint"
            + (f" ({tail.partial} bytes of an unacknowledged partial line cut)" if tail.partial else "")
        )
        self.head.incident("crash_recovered", detail, {"egressgate.incident.last_seq": tail.last_seq})
        return chain.state.prev, chain.state.since_signed

    def _open_new(self) -> None:
        assert self.path is not None
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.path, flags, 0o600)
        os.fchmod(self.fd, 0o600)
        self.size = os.fstat(self.fd).st_size

    def _open_fresh(self) -> None:
        """Open a new file at `path`; whatever someone else left there (non-empty) is moved aside."""
        assert self.path is not None
        secure_directory(self.path.parent)  # the whole directory may have been removed
        if os.path.lexists(self.path) and os.stat(self.path, follow_symlinks=False).st_size > 0:
            aside = rotated_name(self.path)
            os.rename(self.path, aside)
            log.warning("foreign content found at %s after an outside change; moved aside to %s", self.path, aside)
        self._open_new()

    # --- while running: is `path` still the file we write? ------------------------------------------

    async def ensure(self, force: bool = False) -> None:
        if self.fd is None:
            # a failed rotation/reopen left no open file: retry. Fresh: the chain restarted, so a non-empty
            # file at `path` (the sealed one a failed rename left there) is moved aside, never appended to
            await asyncio.to_thread(self._open_fresh)
            return
        assert self.path is not None
        now = time.monotonic()
        if force or now - self._last_watch >= self.watch_interval:
            self._last_watch = now
            change = file_change(self.fd, self.path, self.size)
        elif now - self._last_fstat >= FSTAT_INTERVAL:
            # one fstat (~1 us) at most every 10 ms: stop writing into an unlinked or truncated file at once
            # without adding a syscall to every batch of a busy DNS resolver
            self._last_fstat = now
            st = os.fstat(self.fd)
            change = "deleted" if st.st_nlink == 0 else "truncated" if st.st_size < self.size else "ok"
        else:
            return
        if change != "ok":
            await self._reopen(change)

    def settled(self) -> bool:
        """`ensure` for a batch the sink writes without its writer task (handoff.py `CallerCommit.commit`): the
        checks `ensure` would run now, run here; True when the file is still ours. False, with nothing
        consumed (the check stays due), when there is no file or it changed: the writer task's `ensure`
        must handle that, so the batch goes to it."""
        if self.fd is None:
            return False
        now = time.monotonic()
        try:
            if now - self._last_watch >= self.watch_interval:
                if file_change(self.fd, self.path, self.size) != "ok":
                    return False
                self._last_watch = now
            elif now - self._last_fstat >= FSTAT_INTERVAL:
                st = os.fstat(self.fd)
                if st.st_nlink == 0 or st.st_size < self.size:
                    return False
                self._last_fstat = now
        except OSError:
            return False
        return True

    async def _reopen(self, change: FileChange) -> None:
        assert self.path is not None and self.fd is not None
        last_seq = self.head.writer.state.seq - 1
        extra: dict = {}
        if change in ("deleted", "moved"):
            try:  # the old file stays a complete, sealed file
                await self._append([], final=True)
            except Exception as exc:
                log.error("could not seal the %s audit file: %s", change, exc)
        prev_file: str | None = None
        if change == "deleted":
            try:
                await asyncio.to_thread(secure_directory, self.path.parent)  # `rm -rf` took the directory too
                target = rotated_name(self.path)
                size = await asyncio.to_thread(salvage_deleted, self.fd, target, self.fsync)
                prev_file = target.name
                detail = (
                    f"the audit file was deleted while in use; its {last_seq + 1} records (sealed) were "
                    f"restored from the open file to {target.name} ({size} bytes)"
                )
            except OSError as exc:
                extra["egressgate.incident.lost_records"] = last_seq + 1
                detail = (
                    f"the audit file was deleted while in use and could not be restored ({exc}): "
                    f"records seq 0..{last_seq} of that file are lost"
                )
        elif change == "moved":
            prev_file = find_by_inode(self.path.parent, self.fd)
            detail = (
                f"the audit file was moved from outside to "
                f"{prev_file or 'a place outside the audit directory'}; it was sealed there and the "
                f"chain continues in a new file"
            )
        else:
            detail = (
                f"the audit file was truncated from outside ({self.size} bytes written, fewer left; e.g. "
                f"logrotate copytruncate): the records before are only in that copy, unsealed; the chain "
                f"continues here"
            )
        os.close(self.fd)
        self.fd = None
        self.head.restart(prev_file)
        self.head.incident(f"file_{change}", detail, extra)
        await asyncio.to_thread(self._open_fresh)
        await self._append([])  # chain_start + the incident record, at once

    async def rotate(self) -> None:
        """Final checkpoint in the old file, rename it, start a new file whose chain links to it.

        An operator's `mv` (or logrotate) may race this at any point. Whatever the interleaving, the file
        our descriptor writes is sealed (the final checkpoint follows the inode, wherever it now is), the
        next file starts with `chain_start` linked to it, and a move we did not make is a `file_moved`
        incident naming where the sealed file is. `os.rename` works by name, so it may fail (the file is
        gone from `path`) or rename someone else's file that now has the name: afterwards we look up where
        OUR inode is instead of assuming. `_rotation_step` (None in production) lets tests drive each
        interleaving deterministically (tests/audit/test_rotation_race.py)."""
        assert self.path is not None and self.fd is not None
        self._step("check")
        change = await asyncio.to_thread(file_change, self.fd, self.path, self.size)
        if change != "ok":  # moved/deleted/truncated since the last check: that path seals and starts anew
            await self._reopen(change)
            return
        self._step("seal")
        await self._append([], final=True)
        if self.fsync:
            await asyncio.to_thread(os.fsync, self.fd)
        fd, target = self.fd, rotated_name(self.path)
        self._step("rename", target)
        renamed, error = await asyncio.to_thread(rename_by_name, self.path, target)
        self._step("locate")
        ours = await asyncio.to_thread(located, fd, self.path.parent, target if renamed else None)
        os.close(fd)
        self.fd = None
        # The old file is sealed whatever happened to its name: the chain restarts here, never continues it.
        self.head.restart(ours)
        if not renamed and ours == self.path.name and error is not None:
            # the rename itself failed (nothing moved the file): fail this batch; the next one moves the sealed
            # file aside (`ensure` -> `_open_fresh`), never appends to it
            self.head.prev_file = None
            raise error
        self.rotations += 1
        if renamed and ours == target.name:
            log.info("audit file rotated to %s", target)
        else:
            where = ours or "a place outside the audit directory"
            detail = (
                f"the audit file was moved from outside while the gateway rotated it; it was sealed and is "
                f"now {where}; the chain continues in a new file"
            )
            if renamed:  # we renamed a file someone created at the name meanwhile (logrotate `create`)
                await asyncio.to_thread(give_back, target, self.path)
                detail += f" (a file someone created at {self.path.name} meanwhile is used if empty, else moved aside)"
            elif error is not None:
                detail += f" (rename failed: {error})"
            self.head.incident("file_moved", detail)
        self._step("reopen")
        await asyncio.to_thread(self._open_fresh)  # a non-empty file at `path` (ours, if rename failed) moves aside
        self._step("opened")

    def _step(self, name: str, target: Path | None = None) -> None:
        if self.rotation_step is not None:
            self.rotation_step(name, target)
