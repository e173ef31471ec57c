"""How a batch reaches the file: inline on the event loop when that is cheap, in a thread when not.

Kept apart from filesink.py (the writer task, batching and failure handling) because this is the part
that decides *where* the bytes are written; both share FileSink's state (this is a mixin of it).

Tried and not kept (issue 11): letting a caller commit a lone record itself while the writer task was
idle, to save the hand-over (queue, future, two task switches). Interleaved against the same tree
without it, c=1: rps 1.06x / 1.08x, per CPU-second 0.99x, p50 unchanged — inside the noise, so the
single writer stays the only code path that touches the chain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from egressgate.audit.filesink import FileSink

log = logging.getLogger("egressgate.audit.filesink")


class WriteMixin:
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
