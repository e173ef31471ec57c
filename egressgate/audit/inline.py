"""How a batch reaches the file: inline on the event loop when that is cheap, in a thread when not.

A collaborator of `FileSink` (filesink.py keeps the writer task, batching and failure handling): this is the
part that decides *where* the bytes are written, and writes them whole or not at all (a failed write is cut
back to the last complete batch, so the file stays verifiable). It owns no file: the sink passes its
descriptor and the size it has written so far, and gets the new size back.

A caller may also write its batch itself (`write_inline`), without the writer task, when the writer is
parked on an empty queue and the batch needs nothing that waits (handoff.py `CallerCommit.commit`): the
hand-over (queue, future, two task switches) was 2 of ~9 event-loop iterations of a gateway request at
c=1 (issue 25). Issue 11 had tried it and measured it inside the noise; the counts are what it saves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

log = logging.getLogger("egressgate.audit.filesink")


class BatchWriter:
    def __init__(self, *, fsync: bool, inline_write_max: int, inline_slow: float, inline_retry: float) -> None:
        self.fsync = fsync
        self.inline_write_max = inline_write_max  # 0: always write in a worker thread
        self.inline_slow = inline_slow
        self.inline_retry = inline_retry  # seconds after a slow inline write before writing inline again
        self.inline_ok = True  # False after a slow inline write, until a write (in a thread) is fast again
        self.inline_retry_at = 0.0  # ... or until this monotonic time has passed
        self.slow_inline_writes = 0

    async def write(self, fd: int, size: int, data: bytes, path: object = None) -> int:
        """Append `data` to `fd` (whose file holds `size` bytes); the new size. Inline on the event loop
        when that is cheap, else in a worker thread.

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
        if len(data) <= self.inline_write_max and self.inline_now():
            return self.write_inline(fd, size, data, path)
        size, elapsed = await asyncio.to_thread(self._timed_write, fd, size, data, path)
        if not self.fsync and elapsed <= self.inline_slow:
            self.inline_ok = True
        return size

    def inline_now(self) -> bool:
        """May a batch (of at most `inline_write_max` bytes) be written on the event loop now?"""
        return not self.fsync and (self.inline_ok or time.monotonic() >= self.inline_retry_at)

    def write_inline(self, fd: int, size: int, data: bytes, path: object = None) -> int:
        """`write_durable` on the event loop, timed: a slow write sends the next ones to a thread."""
        started = time.perf_counter()
        size = self.write_durable(fd, size, data, path)
        if time.perf_counter() - started > self.inline_slow:
            self.slow_inline_writes += 1
            self.inline_ok = False
            self.inline_retry_at = time.monotonic() + self.inline_retry
        else:
            self.inline_ok = True
        return size

    def _timed_write(self, fd: int, size: int, data: bytes, path: object) -> tuple[int, float]:
        started = time.perf_counter()
        size = self.write_durable(fd, size, data, path)
        return size, time.perf_counter() - started

    def write_durable(self, fd: int, size: int, data: bytes, path: object = None) -> int:
        """Write all of `data` (+ fsync when configured) or, on failure, cut the file back to `size` and raise."""
        view = memoryview(data)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(fd)
        except OSError:
            try:  # never leave a partial line: the file must stay verifiable
                os.ftruncate(fd, size)
            except OSError:
                log.critical("audit file %s could not be truncated after a failed write", path)
            raise
        return size + len(data)
