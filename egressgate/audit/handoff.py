"""Who commits a batch: the caller itself while the sink's writer task is parked, else that task.

Why: handing a record to the writer task costs a future and two task switches (2 of ~9 event-loop
iterations of a gateway request, issue 25; for outcomes alone, the writer's wake-up). When the writer
task waits on an empty queue and the batch needs nothing that waits, the caller writes it itself, with
no `await` from the decision to the end of the write, so the caller and the writer task never interleave
and the chain has one writer at a time. The bytes are the ones the writer task would write.

This module owns the hand-off state: whether the writer is parked (set by filesink.py's write loop),
when a batch may be committed by its caller (`CallerCommit.commit`), and the wake-up that makes a parked
writer probe the disk after a caller's commit failed. Batching, the chain append with checkpoints, and
the failure answers stay in the sink (filesink.py), which this calls back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from egressgate.audit.afterfact import AfterRecords
from egressgate.audit.inline import BatchWriter
from egressgate.audit.record import Record
from egressgate.audit.trail import ChainHead, Trail

WAKE = object()  # queue item: wake the writer (outcomes to write, or the signer is back: sign the deferred range)


class CallerCommit:
    """The caller-commit / idle-writer hand-off of one sink (its queue, chain head, file and outcomes)."""

    def __init__(
        self,
        queue: asyncio.Queue,
        head: ChainHead,
        trail: Trail | None,
        batches: BatchWriter,
        afterq: AfterRecords,
        *,
        checkpoint_every: int,
        max_bytes: int,
        writer: Callable[[], asyncio.Task | None],
        sink_ready: Callable[[], bool],
        failed: Callable[[list, Exception], None],
        written: Callable[[list[Record]], None],
    ) -> None:
        self.queue = queue  # the writer task's queue (shared with the sink)
        self._head = head
        self._trail = trail
        self._batches = batches
        self._afterq = afterq
        self._checkpoint_every = checkpoint_every
        self._max_bytes = max_bytes
        self._writer = writer  # the writer task (None before start)
        self._sink_ready = sink_ready  # healthy, no retry queue, no signature due
        self._failed = failed  # the sink's answer to a failed batch (AuditUnavailable / retry queue)
        self._written = written  # the sink's count + export of a durable batch
        self.parked = False  # the writer task waits on an empty queue (set by the sink's write loop)

    def commit(self, record: Record | None) -> bool:
        """Write the outcomes waiting for a batch, and `record`, here and now: the writer task's batch, made
        by the caller while that task is parked on an empty queue (no await from here to the end, so the two
        never interleave). Only a batch that needs nothing that waits: a running chain (not its first line),
        no checkpoint, rotation, incident, retry or signature due, a healthy inline-writable file whose
        checks pass. False, with nothing changed, when the writer task must do it; on a failed write, what
        the writer's batch would do: `record`'s caller gets AuditUnavailable, the outcomes go to the retry
        queue."""
        trail, head = self._trail, self._head
        chain = head.writer
        state = chain.state
        own = [] if record is None else [record]
        writer = self._writer()
        if (
            trail is None
            or not self.queue.empty()
            or writer is None
            or writer.done()
            or writer.cancelling()  # going down (its done callback takes the outcomes): not parked
            or not self._sink_ready()
            or head.incident_next
            or state.seq == 0
            or state.since_checkpoint + len(self._afterq.deferred) + len(own) >= self._checkpoint_every
            or trail.size >= self._max_bytes
            or not self._batches.inline_now()
            or not trail.settled()
        ):
            return False
        after = [r for r, _ in self._afterq.take()]
        records = [*after, *own]
        snap = chain.snapshot()
        try:
            data = b"".join([chain.append(r) + b"\n" for r in records])
            if len(data) > self._batches.inline_write_max:  # too large for the loop: the writer's thread
                chain.restore(snap)
                self._afterq.deferred[:0] = after
                return False
            if data:
                trail.size = self._batches.write_inline(trail.fd, trail.size, data, trail.path)
        except Exception as exc:
            chain.restore(snap)
            fut = asyncio.get_running_loop().create_future() if own else None  # the writer's answer
            self._failed([*((r, None) for r in after), *((r, fut) for r in own)], exc)
            self.queue.put_nowait(WAKE)  # the parked writer starts probing the disk (and retrying) now
            if fut is not None:
                fut.result()  # raises AuditUnavailable
            return True
        if records:
            self._written(records)
        return True

    def wake(self) -> None:
        """Outcomes wait for a batch (afterfact.py: the loop is idle, or their timer fired): written here
        when the writer task is parked (no wake-up, no task switch), else by that task."""
        if not (self.parked and self.commit(None)):
            self.queue.put_nowait(WAKE)
