"""The sink's answers to faults of the trail itself: a crashed previous run, the file deleted, moved or
truncated from outside, after-the-fact records that could not be written (the retry queue), and the
status `/healthz` reports. A mixin of `FileSink` (filesink.py keeps the write path); the writer task is the
only caller of the methods that touch the chain, so no lock is needed.

Rules enforced here:
* a file a crash left unsealed is sealed at restart by a signed `recovery` checkpoint, only if its unsigned
  tail verifies (recovery.py);
* when the file at `path` is no longer the one being written (deleted, moved, truncated), the old file is
  sealed (a deleted one is copied out of its still-open inode first), a new file continues the chain from
  the last record, and an `audit_incident` record right after its `chain_start` says what happened;
* an after-the-fact record (outcome) is never dropped: it is retried in every later batch; while
  `pending_max` or more wait, `healthy()` is False so new requests are denied instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from egressgate.audit.chain import KIND_RECOVERY, ChainWriter, incident_record
from egressgate.audit.event import AuditEvent, AuditUnavailable
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
from egressgate.audit.record import record_from_event
from egressgate.audit.recovery import TailState, append_seal, inspect_tail

if TYPE_CHECKING:
    from egressgate.audit.filesink import FileSink

log = logging.getLogger("egressgate.audit.filesink")
K_REQUEST_ID = "egressgate.request.id"
MAX_INCIDENTS = 20
FSTAT_INTERVAL = 0.01
WAKE = object()  # queue item: the signer is back, sign the deferred range now even without traffic


class TrailMixin:
    # --- start: seal what a crash left, then start a new file linked to it ------------------------

    async def _open_initial(self: FileSink) -> None:
        assert self.path is not None
        tail_path, tail = await asyncio.to_thread(self._previous_tail)
        restored = await asyncio.to_thread(self._afterq.spool.load)  # queued by a run that was killed
        if restored:
            self._afterq.restore(restored)
        last = tail.last_hash if tail is not None and tail.last_hash else None
        since_signed = tail.since_signed if tail is not None else 0
        if tail is not None and not tail.sealed:
            last, since_signed = await self._seal_crashed(tail, tail_path)
        if os.path.lexists(self.path) and os.stat(self.path, follow_symlinks=False).st_size > 0:
            rotated = rotated_name(self.path)  # a previous run's file: never append to it
            os.rename(self.path, rotated)
            self._chain = ChainWriter(prev=last or ChainWriter().state.prev, since_signed=since_signed)
            self._prev_file = rotated.name
        elif tail is not None and tail_path != self.path:  # an empty live file: link to the rotated one
            self._chain = ChainWriter(prev=last or ChainWriter().state.prev, since_signed=since_signed)
            self._prev_file = tail_path.name
        await asyncio.to_thread(self._open_new)

    def _previous_tail(self: FileSink) -> tuple[Path, TailState | None]:
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

    async def _seal_crashed(self: FileSink, tail: TailState, path: Path) -> tuple[str, int]:
        """Append a `recovery` checkpoint to a file the previous run did not seal (kill -9, power loss)."""
        assert self.path is not None
        if tail.problem is not None:
            detail = (f"the previous audit file was not sealed and its unsigned tail does not verify "
                      f"({tail.problem}); it was NOT signed at restart - run `egressgate audit verify`")
            self._incident("crash_tail_invalid", detail)
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
        detail = (f"the previous run stopped without sealing its audit file after seq {tail.last_seq}; "
                  f"sealed at restart with a recovery checkpoint"
                  + (f" ({tail.partial} bytes of an unacknowledged partial line cut)" if tail.partial else ""))
        self._incident("crash_recovered", detail, {"egressgate.incident.last_seq": tail.last_seq})
        return chain.state.prev, chain.state.since_signed

    def _open_new(self: FileSink) -> None:
        assert self.path is not None
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o600)
        os.fchmod(self._fd, 0o600)
        self._size = os.fstat(self._fd).st_size

    def _open_fresh(self: FileSink) -> None:
        """Open a new file at `path`; whatever someone else left there (non-empty) is moved aside."""
        assert self.path is not None
        secure_directory(self.path.parent)  # the whole directory may have been removed
        if os.path.lexists(self.path) and os.stat(self.path, follow_symlinks=False).st_size > 0:
            aside = rotated_name(self.path)
            os.rename(self.path, aside)
            log.warning("foreign content found at %s after an outside change; moved aside to %s", self.path, aside)
        self._open_new()

    # --- while running: is `path` still the file we write? ------------------------------------------

    async def _ensure_file(self: FileSink, force: bool = False) -> None:
        if self._fd is None:
            # a failed rotation/reopen left no open file: retry. Fresh: the chain restarted, so a non-empty
            # file at `path` (the sealed one a failed rename left there) is moved aside, never appended to
            await asyncio.to_thread(self._open_fresh)
            return
        assert self.path is not None
        now = time.monotonic()
        if force or now - self._last_watch >= self.watch_interval:
            self._last_watch = now
            change = file_change(self._fd, self.path, self._size)
        elif now - self._last_fstat >= FSTAT_INTERVAL:
            # one fstat (~1 us) at most every 10 ms: stop writing into an unlinked or truncated file at once
            # without adding a syscall to every batch of a busy DNS resolver
            self._last_fstat = now
            st = os.fstat(self._fd)
            change = "deleted" if st.st_nlink == 0 else "truncated" if st.st_size < self._size else "ok"
        else:
            return
        if change != "ok":
            await self._reopen(change)

    async def _reopen(self: FileSink, change: FileChange) -> None:
        assert self.path is not None and self._fd is not None
        last_seq = self._chain.state.seq - 1
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
                size = await asyncio.to_thread(salvage_deleted, self._fd, target, self.fsync)
                prev_file = target.name
                detail = (f"the audit file was deleted while in use; its {last_seq + 1} records (sealed) were "
                          f"restored from the open file to {target.name} ({size} bytes)")
            except OSError as exc:
                extra["egressgate.incident.lost_records"] = last_seq + 1
                detail = (f"the audit file was deleted while in use and could not be restored ({exc}): "
                          f"records seq 0..{last_seq} of that file are lost")
        elif change == "moved":
            prev_file = find_by_inode(self.path.parent, self._fd)
            detail = (f"the audit file was moved from outside to "
                      f"{prev_file or 'a place outside the audit directory'}; it was sealed there and the "
                      f"chain continues in a new file")
        else:
            detail = (f"the audit file was truncated from outside ({self._size} bytes written, fewer left; e.g. "
                      f"logrotate copytruncate): the records before are only in that copy, unsealed; the chain "
                      f"continues here")
        os.close(self._fd)
        self._fd = None
        state = self._chain.state
        self._chain = ChainWriter(prev=state.prev, since_signed=state.since_signed)
        self._prev_file = prev_file
        self._incident(f"file_{change}", detail, extra)
        await asyncio.to_thread(self._open_fresh)
        await self._append([])  # chain_start + the incident record, at once

    async def _rotate(self: FileSink) -> None:
        """Final checkpoint in the old file, rename it, start a new file whose chain links to it.

        An operator's `mv` (or logrotate) may race this at any point. Whatever the interleaving, the file
        our descriptor writes is sealed (the final checkpoint follows the inode, wherever it now is), the
        next file starts with `chain_start` linked to it, and a move we did not make is a `file_moved`
        incident naming where the sealed file is. `os.rename` works by name, so it may fail (the file is
        gone from `path`) or rename someone else's file that now has the name: afterwards we look up where
        OUR inode is instead of assuming. `_rotation_step` (None in production) lets tests drive each
        interleaving deterministically (tests/audit/test_rotation_race.py)."""
        assert self.path is not None and self._fd is not None
        self._step("check")
        change = await asyncio.to_thread(file_change, self._fd, self.path, self._size)
        if change != "ok":  # moved/deleted/truncated since the last check: that path seals and starts anew
            await self._reopen(change)
            return
        self._step("seal")
        await self._append([], final=True)
        if self.fsync:
            await asyncio.to_thread(os.fsync, self._fd)
        state = self._chain.state
        fd, target = self._fd, rotated_name(self.path)
        self._step("rename", target)
        renamed, error = await asyncio.to_thread(rename_by_name, self.path, target)
        self._step("locate")
        ours = await asyncio.to_thread(located, fd, self.path.parent, target if renamed else None)
        os.close(fd)
        self._fd = None
        # The old file is sealed whatever happened to its name: the chain restarts here, never continues it.
        self._chain = ChainWriter(prev=state.prev, since_signed=state.since_signed)
        self._prev_file = ours
        if not renamed and ours == self.path.name and error is not None:
            # the rename itself failed (nothing moved the file): fail this batch; the next one moves the sealed
            # file aside (`_ensure_file` -> `_open_fresh`), never appends to it
            self._prev_file = None
            raise error
        self.rotations += 1
        if renamed and ours == target.name:
            log.info("audit file rotated to %s", target)
        else:
            where = ours or "a place outside the audit directory"
            detail = (f"the audit file was moved from outside while the gateway rotated it; it was sealed and is "
                      f"now {where}; the chain continues in a new file")
            if renamed:  # we renamed a file someone created at the name meanwhile (logrotate `create`)
                await asyncio.to_thread(give_back, target, self.path)
                detail += f" (a file someone created at {self.path.name} meanwhile is used if empty, else moved aside)"
            elif error is not None:
                detail += f" (rename failed: {error})"
            self._incident("file_moved", detail)
        self._step("reopen")
        await asyncio.to_thread(self._open_fresh)  # a non-empty file at `path` (ours, if rename failed) moves aside
        self._step("opened")

    def _step(self: FileSink, name: str, target: Path | None = None) -> None:
        if self._rotation_step is not None:
            self._rotation_step(name, target)

    def _incident(self: FileSink, kind: str, detail: str, extra: dict | None = None) -> None:
        log.critical("AUDIT TRAIL INCIDENT %s: %s", kind, detail)
        self._incident_next.append(incident_record(self._clock(), kind, detail, extra))
        self.incidents.append({"incident": kind, "detail": detail, "at": time.time()})
        del self.incidents[:-MAX_INCIDENTS]

    # --- after-the-fact records: retried, never dropped --------------------------------------------

    async def write_after(self: FileSink, event: AuditEvent) -> bool:
        """Write the record of something that already happened (an outcome): it cannot be denied, so
        a failed write queues it for retry in every later batch instead of dropping it. True when
        durable now, False when queued (the log names the request id)."""
        record = record_from_event(event)
        try:
            await self._submit(record)
            return True
        except AuditUnavailable as exc:
            self._afterq.retry(record, exc)
            return False

    def enqueue_after(self: FileSink, event: AuditEvent) -> None:
        """`write_after` for a caller that does not wait for the answer (the gateway's outcome records):
        the record is handed to the writer with no future, and no task or coroutine is created for it
        (one per request was ~2 % of the gateway's CPU at c=1, issue 11). It rides the next batch, or is
        written at idle / after `after_delay` (afterfact.py). The same never-dropped rule: if its batch
        fails, the writer moves it to the retry queue (`_run_batch`); if the writer dies first,
        `_writer_done` does and names it; `close()` drains it through the final batch."""
        record = record_from_event(event)
        if self._closed or self._writer is None or self._writer.done():
            self._afterq.retry(record, AuditUnavailable("audit sink is not running"))
            return
        self._afterq.defer(record)

    def _sign_now(self: FileSink) -> None:
        self._sign_due = True
        self._queue.put_nowait(WAKE)

    def status(self: FileSink) -> dict:
        """What `/healthz` shows about the trail (no record content)."""
        return {
            "healthy": self.healthy(),
            "degraded": self.degraded,  # a write failed (in allow-and-alert mode healthy() stays True)
            "write_failures": self.write_failures,
            "pending_records": len(self._afterq.pending),
            "records_retried": self.records_retried,
            "records_lost": self.records_lost,
            "signer": self._cp.status(),
            "unsigned_records": self._chain.state.since_signed,
            "incidents": list(self.incidents),
        }
