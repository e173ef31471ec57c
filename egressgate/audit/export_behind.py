"""The OTLP copy of batches already durable in the local file, exported in the background.

Why in the background: with a local file, the file is the durable copy (a record's caller was answered
once it was written there), so a slow or unreachable collector must never hold up or deny a request. Each
durable batch is queued (bounded: a full queue is counted and logged, the records stay in the file) and one
task exports it, 3 attempts; a failure is an alert (`failures`, the log), never a denial. With no local
file the exporter is the only destination and the sink exports in its batch instead (filesink.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from egressgate.audit.record import Record

if TYPE_CHECKING:  # the OpenTelemetry SDK loads only when an OTLP endpoint is configured
    from egressgate.audit.exporter import OtlpHttpExporter

log = logging.getLogger("egressgate.audit.filesink")  # the sink's log, as before the split

_STOP = object()


class ExportBehind:
    """One background export task and its bounded queue."""

    def __init__(self, exporter: OtlpHttpExporter) -> None:
        self.exporter = exporter
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=1024)
        self._task: asyncio.Task | None = None
        self.failures = 0  # batches the collector did not take (or that found the queue full)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="audit-exporter")

    def submit(self, out: list[Record]) -> None:
        """Queue a durable batch for export (never blocks: a full queue is counted and logged)."""
        try:
            self._queue.put_nowait(out)
        except asyncio.QueueFull:
            self.failures += 1
            log.warning("OTLP export queue full; %d records only in the local file", len(out))

    async def stop(self) -> None:
        """Export what is queued, then end the task."""
        if self._task is not None:
            self._queue.put_nowait(_STOP)
            await self._task

    async def _loop(self) -> None:
        while True:
            item = await self._queue.get()
            if item is _STOP:
                return
            for attempt in range(3):
                if await asyncio.to_thread(self.exporter.export, item):
                    break
                if attempt < 2:
                    await asyncio.sleep(0.2 * (attempt + 1))
            else:
                self.failures += 1
                log.error("OTLP export failed for %d audit records (kept in the local file)", len(item))
