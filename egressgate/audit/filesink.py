"""The audit sink: group-committed, hash-chained OTLP/JSON lines in a local file, optionally exported.

Why group commit: `write()` must not return before its record is durable (intent before effect), but one
write+flush(+fsync) per request would cap the gateway at the disk's flush rate. A single writer task takes
everything queued, chains and encodes it, writes it with one `os.write` (+ one `fsync` when configured) and
then resolves every waiting future, so concurrent requests share one flush (a caller whose record finds the
writer idle commits that batch itself: handoff.py). `os.write` on an O_APPEND fd
has no user-space buffer: once it returns, the record survives a gateway crash; `fsync` adds power loss.

Failure never loses an accepted record and never leaves a half line: the file is truncated back to the
last complete batch and the chain state rolled back, the batch's callers get AuditUnavailable (they deny),
and `healthy()` is False until a write succeeds (a periodic checkpoint probes the disk meanwhile).
Records of things that already happened (outcomes) cannot be denied: `write_after` queues them and the
writer retries them first in every later batch (afterfact.py).

Collaborators, one concern each: the live file and its faults (trail.py: crash seal, rotation, outside
moves), where a batch is written (inline.py), who commits it, the caller or the writer task (handoff.py),
outcomes deferred and retried (afterfact.py), one batch into the chain with its checkpoints (batch.py),
checkpoint signing (checkpointer.py), the background OTLP copy (export_behind.py). This module is the sink
and its writer task: the write API, batching, the failure answers and health.
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
from egressgate.audit.batch import ChainAppend, ExportFailed
from egressgate.audit.checkpointer import Checkpointer
from egressgate.audit.event import AuditEvent, AuditUnavailable
from egressgate.audit.export_behind import ExportBehind
from egressgate.audit.filewatch import rotated_name
from egressgate.audit.handoff import WAKE, CallerCommit
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
            wake=lambda: self._handoff.wake(),
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
        # one batch into the chain, with its checkpoints, onto the file or the collector (batch.py)
        self._chain = ChainAppend(
            self._head,
            self._cp,
            self._batches,
            signer,
            clock,
            checkpoint_every=checkpoint_every,
            max_bytes=max_bytes,
            exporter=exporter,
            written=self._written,
        )
        # the live file (None: exporter only): crash seal, rotation, outside moves (trail.py)
        self._trail = (
            Trail(self.path, self._head, self._cp, self._chain.append, fsync=fsync, watch_interval=watch_interval)
            if self.path is not None
            else None
        )
        self._chain.trail = self._trail
        self._queue: asyncio.Queue = asyncio.Queue()
        self._writer: asyncio.Task | None = None
        # a caller commits its own batch while the writer task is parked (handoff.py)
        self._handoff = CallerCommit(
            self._queue,
            self._head,
            self._trail,
            self._batches,
            self._afterq,
            checkpoint_every=checkpoint_every,
            max_bytes=max_bytes,
            writer=lambda: self._writer,
            sink_ready=lambda: self._healthy and not self._pending and not self._sign_due,
            failed=self._batch_failed,
            written=self._written,
        )
        self._export: ExportBehind | None = None  # the background OTLP copy of the file, from start()
        self._healthy = True
        self._closed = False
        # counters (exposed for metrics / alerts)
        self.records_written = 0
        self.batches_written = 0
        self.write_failures = 0
        self.records_dropped = 0  # only in allow-and-alert mode

    @property
    def slow_inline_writes(self) -> int:
        """Inline writes slower than `inline_slow` (the writes after each went to a thread for a while)."""
        return self._batches.slow_inline_writes

    @property
    def export_failures(self) -> int:
        """Batches the background OTLP export did not deliver (the records are in the local file)."""
        return self._export.failures if self._export is not None else 0

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
        if self.path is not None and self.exporter is not None:  # the file is the durable copy (export_behind.py)
            self._export = ExportBehind(self.exporter)
            self._export.start()
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
            if item is _STOP or item is WAKE:
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
        if self._export is not None:
            await self._export.stop()
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
        if self._handoff.parked and self._handoff.commit(record):
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

    def _sign_now(self) -> None:
        self._sign_due = True
        self._queue.put_nowait(WAKE)

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
            self._handoff.parked = True
            try:
                first = await asyncio.wait_for(self._queue.get(), self._idle_timeout())
            except TimeoutError:
                self._handoff.parked = False
                if not self._healthy or self._pending or self._sign_due:
                    # probe: does the disk accept a write again? (and drain the retry queue, sign late)
                    await self._run_batch([], checkpoint=not self._healthy or self._sign_due)
                else:
                    await self._run_batch([], watch_only=True)  # is the file still ours?
                continue
            finally:
                self._handoff.parked = False
            batch = []
            item = first
            while True:
                if item is _STOP:
                    stopping = True
                    break
                if item is not WAKE:
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
            await self._chain.commit([*pending, *(r for r, _ in batch)], checkpoint=checkpoint, final=final)
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

    def _written(self, out: list[Record]) -> None:
        """A batch is durable: count it and hand it to the background export."""
        self.records_written += len(out)
        self.batches_written += 1
        if self._export is not None:
            self._export.submit(out)


async def open_file_sink(path: str | os.PathLike[str] | None, signer: Signer, **kwargs) -> FileSink:
    return await FileSink(path, signer, **kwargs).start()


__all__ = ["ExportFailed", "FileSink", "open_file_sink", "rotated_name"]
