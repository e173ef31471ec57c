"""The audit sink: group-committed, hash-chained OTLP/JSON lines in a local file, optionally exported.

Why group commit: `write()` must not return before its record is durable (intent before effect), but one
write+flush(+fsync) per request would cap the gateway at the disk's flush rate. A single writer task takes
everything queued, chains and encodes it, writes it with one `os.write` (+ one `fsync` when configured) and
then resolves every waiting future, so concurrent requests share one flush (a caller whose record finds the
writer idle commits that batch itself, `_commit_now`: no hand-over). `os.write` on an O_APPEND fd
has no user-space buffer: once it returns, the record survives a gateway crash; `fsync` adds power loss.

Failure never loses an accepted record and never leaves a half line: the file is truncated back to the
last complete batch and the chain state rolled back, the batch's callers get AuditUnavailable (they deny),
and `healthy()` is False until a write succeeds (a periodic checkpoint probes the disk meanwhile).
Records of things that already happened (outcomes) cannot be denied: `write_after` queues them and the
writer retries them first in every later batch (afterfact.py).

Collaborators, one concern each: the live file and its faults (trail.py: crash seal, rotation, outside
moves), where a batch is written (inline.py), outcomes deferred and retried (afterfact.py), checkpoint
signing (checkpointer.py). This module is the writer task: batching, the chain append, failure handling,
health and the optional OTLP export.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from egressgate.audit import writerlock
from egressgate.audit.afterfact import AfterRecords
from egressgate.audit.chain import KIND_FINAL, KIND_PERIODIC, ChainWriter
from egressgate.audit.checkpointer import Checkpointer
from egressgate.audit.event import AuditEvent, AuditUnavailable
from egressgate.audit.filewatch import rotated_name
from egressgate.audit.inline import BatchWriter
from egressgate.audit.record import Record, record_from_event
from egressgate.audit.signer import Signer
from egressgate.audit.spool import RetrySpool
from egressgate.audit.trail import ChainHead, Trail

if TYPE_CHECKING:  # the OpenTelemetry SDK loads only when an OTLP endpoint is configured
    from egressgate.audit.exporter import OtlpHttpExporter

log = logging.getLogger(__name__)

OnFailure = Literal["deny", "allow-and-alert"]
_STOP = object()


class ExportFailed(OSError):
    """The OTLP exporter (the only destination) did not accept the batch."""


_WAKE = object()  # queue item: wake the writer (outcomes to write, or the signer is back: sign the deferred range)


class FileSink:
    """AuditSink writing to `path` (None: exporter only) and/or an OTLP/HTTP exporter."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        signer: Signer,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        fsync: bool = False,
        checkpoint_every: int = 1000,
        on_failure: OnFailure = "deny",
        exporter: OtlpHttpExporter | None = None,
        batch_max: int = 2048,
        probe_interval: float = 1.0,
        clock: Callable[[], int] = time.time_ns,
        inline_write_max: int = 256 * 1024,
        inline_slow: float = 0.005,
        inline_retry: float = 1.0,
        watch_interval: float = 1.0,
        max_unsigned: int = 100_000,
        pending_max: int = 10_000,
        sign_timeout: float = 10.0,
        retry_spool: str | os.PathLike[str] | None = None,
        after_delay: float = 0.002,
    ) -> None:
        if path is None and exporter is None:
            raise ValueError("audit sink needs a file path, an OTLP exporter, or both")
        if on_failure not in ("deny", "allow-and-alert"):
            raise ValueError("audit on_failure must be 'deny' or 'allow-and-alert'")
        if checkpoint_every < 1:
            raise ValueError("audit checkpoint_every must be >= 1")
        self.path = Path(path) if path is not None else None
        self.signer = signer
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.checkpoint_every = checkpoint_every
        self.on_failure: OnFailure = on_failure
        self.exporter = exporter
        self.batch_max = batch_max
        self.probe_interval = probe_interval
        self._clock = clock
        # where a batch is written: inline on the event loop when cheap, else in a thread (inline.py)
        self._batches = BatchWriter(
            fsync=fsync, inline_write_max=inline_write_max, inline_slow=inline_slow, inline_retry=inline_retry
        )
        self._lock: int | None = None  # writerlock fd, held from start() to close()
        self._head = ChainHead(clock)  # the chain: shared with the trail (restarts, incidents)
        self.pending_max = pending_max  # queued after-the-fact records beyond which new requests are denied
        # outcomes: deferred to ride a batch, retried, spooled, never dropped (afterfact.py)
        self._afterq = AfterRecords(
            RetrySpool(Path(retry_spool) if retry_spool is not None else None),
            after_delay,
            wake=self._wake_writer,
            writer_stopped=lambda: self._writer is None or self._writer.done(),
        )
        self._sign_due = False
        self._cp = Checkpointer(
            signer,
            clock,
            max_unsigned=max_unsigned,
            probe_interval=probe_interval,
            sign_timeout=sign_timeout,
            on_restored=self._sign_now,
        )
        # the live file (None: exporter only): crash seal, rotation, outside moves (trail.py)
        self._trail = (
            Trail(self.path, self._head, self._cp, self._append, fsync=fsync, watch_interval=watch_interval)
            if self.path is not None
            else None
        )
        self._queue: asyncio.Queue = asyncio.Queue()
        self._export_queue: asyncio.Queue = asyncio.Queue(maxsize=1024)
        self._writer: asyncio.Task | None = None
        self._parked = False  # the writer task waits on an empty queue (a caller may commit itself: _commit_now)
        self._export_task: asyncio.Task | None = None
        self._healthy = True
        self._closed = False
        # counters (exposed for metrics / alerts)
        self.records_written = 0
        self.batches_written = 0
        self.write_failures = 0
        self.records_dropped = 0  # only in allow-and-alert mode
        self.export_failures = 0

    @property
    def slow_inline_writes(self) -> int:
        """Inline writes slower than `inline_slow` (the writes after each went to a thread for a while)."""
        return self._batches.slow_inline_writes

    @property
    def rotations(self) -> int:
        return self._trail.rotations if self._trail is not None else 0

    @property
    def incidents(self) -> list[dict]:
        """What happened to the trail itself (shown in /healthz)."""
        return self._head.incidents

    @property
    def records_retried(self) -> int:
        """After-the-fact records written on a later attempt."""
        return self._afterq.retried

    @property
    def records_lost(self) -> int:
        """Queued records that could not be written before the sink stopped (nor kept in the spool)."""
        return self._afterq.lost

    @property
    def _after(self) -> list[Record]:
        """Outcomes handed over and not yet in a batch (admin/metrics.py counts them in the queue depth)."""
        return self._afterq.deferred

    @property
    def _pending(self) -> deque[Record]:
        """The retry queue (admin/metrics.py reads its length)."""
        return self._afterq.pending

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> FileSink:
        if self._trail is not None:
            self._lock = await asyncio.to_thread(writerlock.hold, self._trail.path)  # AuditFileBusy: one per chain
            await self._trail.open_initial()  # seals a file a crash left open, then starts a new one
            restored = await asyncio.to_thread(self._afterq.spool.load)  # queued by a run that was killed
            if restored:
                self._afterq.restore(restored)
        self._writer = asyncio.create_task(self._write_loop(), name="audit-writer")
        self._writer.add_done_callback(self._writer_done)
        if self.path is not None and self.exporter is not None:
            self._export_task = asyncio.create_task(self._export_loop(), name="audit-exporter")
        return self

    def _writer_done(self, task: asyncio.Task) -> None:
        """Fail closed if the writer task ever dies outside close(): no caller may wait forever."""
        if task.cancelled() or task.exception() is not None:
            log.critical("audit writer stopped unexpectedly: %s", "cancelled" if task.cancelled() else task.exception())
            self._healthy = False
            self._closed = True
            self.on_failure = "deny"  # a dead writer is never 'allow-and-alert'
        err = AuditUnavailable("audit writer is not running")
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is _STOP or item is _WAKE:
                continue
            if item[1] is None:  # enqueue_after: nobody waits; queued (spooled) and named, never dropped
                self._afterq.retry(item[0], err)
            elif not item[1].done():
                item[1].set_exception(err)
        for record, _ in self._afterq.take():  # enqueue_after records not yet in a batch
            self._afterq.retry(record, err)
        self._afterq.report_lost()

    def healthy(self) -> bool:
        """False after a failed write until one succeeds, and while `pending_max` or more after-the-fact
        records wait for a retry (new requests are denied rather than their records lost). In
        allow-and-alert mode callers are not asked to deny, so it stays True; `degraded` tells the truth."""
        return (self._healthy and len(self._pending) < self.pending_max) or self.on_failure == "allow-and-alert"

    @property
    def degraded(self) -> bool:
        return not self._healthy

    async def close(self) -> None:
        """Drain, write a final signed checkpoint, close the file and the exporter."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._queue.put_nowait(_STOP)
            await self._writer
        if self._export_task is not None:
            self._export_queue.put_nowait(_STOP)
            await self._export_task
        await self._cp.close()
        if self._trail is not None:
            self._trail.close()
        writerlock.release(self._lock)
        self._lock = None
        if self.exporter is not None:
            await asyncio.to_thread(self.exporter.shutdown)

    # --- write path ------------------------------------------------------------------------------

    async def write(self, event: AuditEvent) -> None:
        await self.write_record(record_from_event(event))

    async def _submit(self, record: Record) -> None:
        if self._closed or self._writer is None:
            raise AuditUnavailable("audit sink is not running")
        loop = asyncio.get_running_loop()
        self._afterq.followed(loop.time())  # did it follow the last outcome closely? (afterfact.py)
        if self._parked and self._commit_now(record):
            return
        fut = loop.create_future()
        self._queue.put_nowait((record, fut))
        await fut

    async def write_record(self, record: Record) -> None:
        """Queue one record and wait until it is durable (or raise AuditUnavailable)."""
        try:
            await self._submit(record)
        except AuditUnavailable as exc:
            if self.on_failure == "allow-and-alert":
                self.records_dropped += 1
                log.critical("AUDIT RECORD LOST (on_failure=allow-and-alert): %s", exc)
                return
            raise

    async def write_after(self, event: AuditEvent) -> bool:
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

    def enqueue_after(self, event: AuditEvent) -> None:
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

    def _commit_now(self, record: Record | None) -> bool:
        """Write the outcomes waiting for a batch, and `record`, here and now: the writer task's batch, made
        by the caller while that task is parked on an empty queue (no await from here to the end, so the two
        never interleave and the chain has one writer at a time). Only a batch that needs nothing that
        waits: a running chain (not its first line), no checkpoint, rotation, incident, retry or signature
        due, a healthy inline-writable file whose checks pass. Saves the hand-over to the writer (a future
        and two task switches: 2 of ~9 loop iterations of a gateway request, issue 25; for outcomes alone,
        the writer's wake-up). False, with nothing changed, when the writer task must do it; on a failed
        write, what the writer's batch would do: `record`'s caller gets AuditUnavailable, the outcomes go
        to the retry queue."""
        trail, head = self._trail, self._head
        chain = head.writer
        state = chain.state
        own = [] if record is None else [record]
        if (
            trail is None
            or not self._queue.empty()
            or self._writer is None
            or self._writer.done()
            or self._writer.cancelling()  # going down (its done callback takes the outcomes): not parked
            or not self._healthy
            or self._pending
            or self._sign_due
            or head.incident_next
            or state.seq == 0
            or state.since_checkpoint + len(self._afterq.deferred) + len(own) >= self.checkpoint_every
            or trail.size >= self.max_bytes
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
            self._batch_failed([*((r, None) for r in after), *((r, fut) for r in own)], exc)
            self._queue.put_nowait(_WAKE)  # the parked writer starts probing the disk (and retrying) now
            if fut is not None:
                fut.result()  # raises AuditUnavailable
            return True
        if records:
            self._written(records)
        return True

    def _wake_writer(self) -> None:
        """Outcomes wait for a batch (afterfact.py: the loop is idle, or their timer fired): written here
        when the writer task is parked (no wake-up, no task switch), else by that task."""
        if not (self._parked and self._commit_now(None)):
            self._queue.put_nowait(_WAKE)

    def _sign_now(self) -> None:
        self._sign_due = True
        self._queue.put_nowait(_WAKE)

    def status(self) -> dict:
        """What `/healthz` shows about the trail (no record content)."""
        return {
            "healthy": self.healthy(),
            "degraded": self.degraded,  # a write failed (in allow-and-alert mode healthy() stays True)
            "write_failures": self.write_failures,
            "pending_records": len(self._afterq.pending),
            "records_retried": self.records_retried,
            "records_lost": self.records_lost,
            "signer": self._cp.status(),
            "unsigned_records": self._head.writer.state.since_signed,
            "incidents": list(self.incidents),
        }

    def _idle_timeout(self) -> float | None:
        if not self._healthy or self._pending or self._sign_due:
            return self.probe_interval
        return self._trail.watch_interval if self._trail is not None else None

    async def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            self._parked = True
            try:
                first = await asyncio.wait_for(self._queue.get(), self._idle_timeout())
            except TimeoutError:
                self._parked = False
                if not self._healthy or self._pending or self._sign_due:
                    # probe: does the disk accept a write again? (and drain the retry queue, sign late)
                    await self._run_batch([], checkpoint=not self._healthy or self._sign_due)
                else:
                    await self._run_batch([], watch_only=True)  # is the file still ours?
                continue
            finally:
                self._parked = False
            batch = []
            item = first
            while True:
                if item is _STOP:
                    stopping = True
                    break
                if item is not _WAKE:
                    batch.append(item)
                if len(batch) >= self.batch_max or self._queue.empty():
                    break
                item = self._queue.get_nowait()
            if self._afterq.deferred:
                batch[:0] = self._afterq.take()
            if batch or stopping or self._sign_due:
                await self._run_batch(batch, final=stopping, checkpoint=self._sign_due)
        self._afterq.report_lost()

    async def _run_batch(
        self, batch: list, *, checkpoint: bool = False, final: bool = False, watch_only: bool = False
    ) -> None:
        pending = list(self._pending)
        try:
            if watch_only:
                await self._trail.ensure(force=True)
                return
            await self._commit([*pending, *(r for r, _ in batch)], checkpoint=checkpoint, final=final)
        except Exception as exc:
            self._batch_failed(batch, exc)
            return
        self._healthy = True
        if checkpoint:  # signed, or the signer failed again: its probe asks for the next one
            self._sign_due = False
        if pending:
            self._afterq.written(pending)
        for _, fut in batch:
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _batch_failed(self, batch: list, exc: Exception) -> None:
        """A batch was not written: unhealthy; its callers get AuditUnavailable, its outcomes are retried."""
        self._healthy = False
        self.write_failures += 1
        log.error(
            "audit write failed (%d records rejected, %d queued for retry): %s", len(batch), len(self._pending), exc
        )
        err = AuditUnavailable(f"audit record could not be made durable: {exc}")
        for record, fut in batch:
            if fut is None:  # enqueue_after: cannot be denied, so retried (afterfact.py), never dropped
                self._afterq.retry(record, err)
            elif not fut.done():
                fut.set_exception(err)

    async def _commit(self, records: list[Record], *, checkpoint: bool = False, final: bool = False) -> None:
        trail = self._trail
        if trail is not None:
            await trail.ensure(force=final)  # deleted / moved / truncated from outside (trail.py)
            if trail.fd is not None and trail.size >= self.max_bytes and (records or checkpoint):
                await trail.rotate()
        await self._append(records, checkpoint=checkpoint, final=final)

    async def _append(self, records: list[Record], *, checkpoint: bool = False, final: bool = False) -> None:
        """Chain, encode and write one batch (+ checkpoints); on failure the chain state is rolled back."""
        head = self._head
        chain = head.writer
        snap = chain.snapshot()
        prev_file = head.prev_file
        lines: list[bytes] = []
        out: list[Record] = []
        try:
            if chain.state.seq == 0:
                start = ChainWriter.start_record(self._clock(), self.signer.key_id, head.prev_file)
                for rec in (start, *head.incident_next):
                    lines.append(chain.append(rec))
                    out.append(rec)
            for rec in records:
                lines.append(chain.append(rec))
                out.append(rec)
                if chain.state.since_checkpoint >= self.checkpoint_every:
                    line, cp = await self._cp.make(chain, KIND_PERIODIC)
                    lines.append(line)
                    out.append(cp)
            if final or checkpoint:  # a probe must really write: an empty batch proves nothing
                line, cp = await self._cp.make(chain, KIND_FINAL if final else KIND_PERIODIC)
                lines.append(line)
                out.append(cp)
            if not lines:
                return
            data = b"".join(line + b"\n" for line in lines)
            trail = self._trail
            if trail is not None and trail.fd is not None:
                trail.size = await self._batches.write(trail.fd, trail.size, data, trail.path)
            elif self.exporter is not None and not await asyncio.to_thread(self.exporter.export, out):
                raise ExportFailed(f"OTLP export to {self.exporter.endpoint} failed")
        except BaseException:
            chain.restore(snap)
            head.prev_file = prev_file
            raise
        head.prev_file = None
        head.incident_next.clear()
        self._written(out)

    def _written(self, out: list[Record]) -> None:
        """A batch is durable: count it and hand it to the background export."""
        self.records_written += len(out)
        self.batches_written += 1
        if self._export_task is not None:
            try:
                self._export_queue.put_nowait(out)
            except asyncio.QueueFull:
                self.export_failures += 1
                log.warning("OTLP export queue full; %d records only in the local file", len(out))

    async def _export_loop(self) -> None:
        """Background export when the local file is the durable copy; failures are alerts, not denials."""
        assert self.exporter is not None
        while True:
            item = await self._export_queue.get()
            if item is _STOP:
                return
            for attempt in range(3):
                if await asyncio.to_thread(self.exporter.export, item):
                    break
                if attempt < 2:
                    await asyncio.sleep(0.2 * (attempt + 1))
            else:
                self.export_failures += 1
                log.error("OTLP export failed for %d audit records (kept in the local file)", len(item))


async def open_file_sink(path: str | os.PathLike[str] | None, signer: Signer, **kwargs) -> FileSink:
    return await FileSink(path, signer, **kwargs).start()


__all__ = ["ExportFailed", "FileSink", "open_file_sink", "rotated_name"]
