"""Records of what already happened (outcomes) in the audit sink: deferred to ride a batch, retried, never dropped.

An outcome is written after the response, so it cannot be denied. `FileSink.enqueue_after` hands it here
(no task, no future per record: issue 11) and the sink's single writer takes it with the next batch
(`take`). While traffic is dense it waits up to `after_delay` for that batch (at c=1 the next request's
decision: one os.write and one writer wake-up per request instead of two); while traffic is sparse (the last
outcome was not followed by a record within `after_delay`) the writer is woken as soon as the event loop is
idle, so a kill -9 exposes only what the current loop turn handed over (issue 23 item 4, docs/audit.md).

A batch that fails puts its outcomes on the retry queue (`retry`): written first in every later batch,
copied to the spool when one is configured (survives kill -9), named in the log; while `pending_max` or
more wait, the sink reports unhealthy so new requests are denied instead. If the writer has stopped, every
queued record is named (`report_lost`): never silently.

One object per sink, owned by it; only the event loop's thread calls it (no lock).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from egressgate.audit.record import Record
from egressgate.audit.spool import RetrySpool

log = logging.getLogger("egressgate.audit.filesink")
K_REQUEST_ID = "egressgate.request.id"


class AfterRecords:
    def __init__(
        self, spool: RetrySpool, after_delay: float, wake: Callable[[], None], writer_stopped: Callable[[], bool]
    ) -> None:
        self.spool = spool
        self.after_delay = after_delay  # a deferred record waits at most this long for a batch to join
        self._wake = wake  # puts a wake-up on the writer's queue
        self._writer_stopped = writer_stopped
        self.deferred: list[Record] = []  # handed over, not yet taken by a batch
        self._timer: asyncio.Handle | None = None
        self.idle = True  # sparse traffic: write at idle, not after the timer
        self._at: float | None = None  # loop time of the last record deferred, until a record follows it
        self.pending: deque[Record] = deque()  # the retry queue: written first in every later batch
        self.spooled: set[int] = set()  # ids of queued records that also have a copy in the spool
        self.retried = 0  # written on a later attempt
        self.lost = 0  # could not be written before the sink stopped (and not in the spool)

    # --- deferral ----------------------------------------------------------------------------------

    def defer(self, record: Record) -> None:
        """Hold `record` for the writer's next batch; wake the writer at idle (sparse) or after the timer."""
        self.deferred.append(record)
        loop = asyncio.get_running_loop()
        self._at = loop.time()
        if self._timer is None:
            self._timer = (
                loop.call_soon(self._kick)
                if self.idle or self.after_delay <= 0
                else loop.call_later(self.after_delay, self._kick)
            )

    def followed(self, now: float) -> None:
        """A record is being submitted at loop time `now`: did it follow the last deferred one closely
        (dense traffic: keep waiting for batches) or not (sparse: write at idle)?"""
        if self._at is not None:
            self.idle = now - self._at > self.after_delay
            self._at = None

    def _kick(self) -> None:
        self._timer = None
        if self.deferred:
            self._wake()

    def take(self) -> list:
        """The deferred records, as batch items with no future (the writer's only caller)."""
        items = [(r, None) for r in self.deferred]
        self.deferred.clear()  # the timer is left to fire (a no-op then): one timer per window, not per record
        return items

    # --- the retry queue ---------------------------------------------------------------------------

    def restore(self, records: list[Record]) -> None:
        """Records the previous run left in the spool: written first."""
        self.pending.extend(records)
        self.spooled.update(id(r) for r in records)
        log.warning(
            "%d audit records queued by the previous run are written first (request ids: %s)",
            len(records),
            ", ".join(str(r.attributes.get(K_REQUEST_ID)) for r in records[:20]),
        )

    def retry(self, record: Record, exc: Exception) -> None:
        """A record whose write failed: retried first in every later batch (and copied to the spool when one
        is configured); named in the log; reported if the writer has stopped."""
        self.pending.append(record)
        if self.spool.add(record):
            self.spooled.add(id(record))
        log.error(
            "audit record of request %s (%s) not written (%s); queued for retry, %d pending",
            record.attributes.get(K_REQUEST_ID),
            record.attributes.get("egressgate.operation"),
            exc,
            len(self.pending),
        )
        if self._writer_stopped():
            self.report_lost()

    def written(self, records: list[Record]) -> None:
        """`records` (the head of the retry queue) were written."""
        for _ in records:
            self.pending.popleft()
        self.retried += len(records)
        if not self.pending:
            self.spool.clear()
            self.spooled.clear()
        ids = ", ".join(str(r.attributes.get(K_REQUEST_ID)) for r in records[:20])
        log.warning(
            "%d queued audit records written on retry (request ids: %s%s)",
            len(records),
            ids,
            ", ..." if len(records) > 20 else "",
        )

    def report_lost(self) -> None:
        """The writer has stopped with records still queued: say exactly which (never silently)."""
        while self.pending:
            rec = self.pending.popleft()
            what = (
                rec.attributes.get("egressgate.operation"),
                rec.attributes.get(K_REQUEST_ID),
                rec.attributes.get("egressgate.request.hash"),
            )
            if id(rec) in self.spooled:
                log.critical(
                    "audit record not written before the audit sink stopped, kept in the retry spool "
                    "%s for the next start: %s record of request %s (request hash %s)",
                    self.spool.path,
                    *what,
                )
                continue
            self.lost += 1
            log.critical(
                "AUDIT RECORD LOST: %s record of request %s could not be written before the audit "
                "sink stopped (request hash %s)",
                *what,
            )
