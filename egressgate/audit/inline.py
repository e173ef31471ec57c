"""How a batch reaches the file: inline on the event loop when that is cheap, in a thread when not, and
the caller's own commit of a single record when the writer task is idle.

Kept apart from filesink.py (the writer task, batching and failure handling) because this is the part
that decides *where* the bytes are written; both share FileSink's state (this is a mixin of it).

Why a caller may commit itself: with one request at a time (a sandbox's usual pattern) every record was
its own batch, and the hand-over to the writer task (queue, future, two task switches and loop
iterations) cost more than chaining, encoding and writing the record. When the writer task is waiting
on an empty queue it holds no batch and no chain state, so the caller runs exactly what the writer would
have run for a batch of one — chain, encode, one `os.write` — synchronously, on the event loop, and
returns only once the record is durable. Anything out of the ordinary (a checkpoint, a rotation, a file
check, a retry queue, fsync, a disk that was slow) is left to the writer task, by returning False.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from egressgate.audit.event import AuditUnavailable
from egressgate.audit.record import Record
from egressgate.audit.trail import FSTAT_INTERVAL

if TYPE_CHECKING:
    from egressgate.audit.filesink import FileSink

log = logging.getLogger("egressgate.audit.filesink")


class WriteMixin:
    def _commit_now(self: FileSink, record: Record) -> bool:
        """Write `record` as the writer task would write a batch of one; False (nothing done) when the
        writer must handle it. Raises AuditUnavailable when the write failed (state as after a failed
        batch: unhealthy, chain rolled back, file truncated back to the last complete line)."""
        state = self._chain.state
        if (not self._healthy or self._pending or self._sign_due or self.fsync or self._fd is None
                or self._incident_next or not self._inline_ok or state.seq == 0
                or state.since_checkpoint + 1 >= self.checkpoint_every or self._size >= self.max_bytes):
            return False
        now = time.monotonic()
        if now - self._last_watch >= self.watch_interval:
            return False  # the full file check (moved, replaced...) is the writer's
        if now - self._last_fstat >= FSTAT_INTERVAL:
            st = os.fstat(self._fd)
            if st.st_nlink == 0 or st.st_size < self._size:
                return False  # deleted or truncated: the writer's _ensure_file reopens and records it
            self._last_fstat = now
        snap = self._chain.snapshot()
        try:
            data = self._chain.append(record) + b"\n"
            if len(data) > self.inline_write_max:
                self._chain.restore(snap)
                return False
            started = time.perf_counter()
            self._write_durable(data)
            elapsed = time.perf_counter() - started
        except Exception as exc:
            self._chain.restore(snap)
            self._healthy = False
            self.write_failures += 1
            log.error("audit write failed (1 record rejected, %d queued for retry): %s", len(self._pending), exc)
            raise AuditUnavailable(f"audit record could not be made durable: {exc}") from None
        if elapsed > self.inline_slow:
            self.slow_inline_writes += 1
            self._inline_ok = False
            self._inline_retry_at = time.monotonic() + self.inline_retry
        self.records_written += 1
        self.batches_written += 1
        if self._export_task is not None:
            try:
                self._export_queue.put_nowait([record])
            except asyncio.QueueFull:
                self.export_failures += 1
                log.warning("OTLP export queue full; 1 record only in the local file")
        return True

    async def _write_batch(self: FileSink, data: bytes) -> None:
        """One batch to the file: inline on the event loop when that is cheap, else in a worker thread.

        Why inline: without fsync the write is one `os.write` into the page cache (tens of microseconds for a
        batch), while handing it to a thread costs a GIL round trip that, measured with the DNS resolver at
        32 queries in flight, halved throughput (every waiting caller waits for the thread). Durability is
        the same either way (callers are released only after `os.write` returned). The loop must not stall
        on a slow disk, though: with fsync and for large batches the write goes to a thread, and after an
        inline write slower than `inline_slow` (dirty-page throttling, a slow device) so do all writes until
        one of them is fast again - a slow disk stalls the loop at most once per slow period.

        "Fast again" is also assumed `inline_retry` seconds after the slow write: a thread's own timing
        includes getting the GIL back from a busy event loop (up to the 5 ms switch interval), so on a
        loaded gateway every thread write looked slow and the sink never returned inline - it paid the
        thread round trip for every batch from the first hiccup on (measured: 5-15 % of the CPU of a busy
        gateway, issue 11). A disk that is still slow costs one inline stall per `inline_retry`."""
        if not self.fsync and len(data) <= self.inline_write_max and (
                self._inline_ok or time.monotonic() >= self._inline_retry_at):
            started = time.perf_counter()
            self._write_durable(data)
            finished = time.perf_counter()
            if finished - started > self.inline_slow:
                self.slow_inline_writes += 1
                self._inline_ok = False
                self._inline_retry_at = time.monotonic() + self.inline_retry
            else:
                self._inline_ok = True
            return
        elapsed = await asyncio.to_thread(self._timed_write, data)
        if not self.fsync and elapsed <= self.inline_slow:
            self._inline_ok = True

    def _timed_write(self: FileSink, data: bytes) -> float:
        started = time.perf_counter()
        self._write_durable(data)
        return time.perf_counter() - started

    def _write_durable(self: FileSink, data: bytes) -> None:
        assert self._fd is not None
        start = self._size
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            try:  # never leave a partial line: the file must stay verifiable
                os.ftruncate(self._fd, start)
            except OSError:
                log.critical("audit file %s could not be truncated after a failed write", self.path)
            raise
        self._size = start + len(data)
