"""One batch into the hash chain and onto its destination: the file (or, with no file, the collector).

Why a unit of its own: this is where a batch becomes bytes and the rules that make a trail verifiable
meet: a file's first line is its `chain_start` (followed by the incidents that wait for it), a periodic
checkpoint follows every `checkpoint_every` records, a probe or the last batch writes a checkpoint even
with no records (an empty write proves nothing), and a batch that was not written leaves no trace: the
chain state and the link to the previous file are rolled back, so the next batch is chained as if it never
happened (the file itself is truncated back by inline.py). Before the batch, the file is checked for
outside changes and rotated when it has reached `max_bytes` (trail.py).

The sink's writer task (filesink.py) calls `commit`; the trail's seals (rotation, crash recovery) call
`append` directly. Who waits for the batch and what a failure answers stay in the sink.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from egressgate.audit.chain import KIND_FINAL, KIND_PERIODIC, ChainWriter
from egressgate.audit.checkpointer import Checkpointer
from egressgate.audit.inline import BatchWriter
from egressgate.audit.record import Record
from egressgate.audit.signer import Signer
from egressgate.audit.trail import ChainHead, Trail

if TYPE_CHECKING:  # the OpenTelemetry SDK loads only when an OTLP endpoint is configured
    from egressgate.audit.exporter import OtlpHttpExporter


class ExportFailed(OSError):
    """The OTLP exporter (the only destination) did not accept the batch."""


class ChainAppend:
    """Chains, encodes and writes one batch (+ checkpoints) of a sink; `written` hears of every durable one."""

    def __init__(
        self,
        head: ChainHead,
        cp: Checkpointer,
        batches: BatchWriter,
        signer: Signer,
        clock: Callable[[], int],
        *,
        checkpoint_every: int,
        max_bytes: int,
        exporter: OtlpHttpExporter | None,
        written: Callable[[list[Record]], None],
    ) -> None:
        self._head = head
        self._cp = cp
        self._batches = batches
        self._signer = signer
        self._clock = clock
        self._checkpoint_every = checkpoint_every
        self._max_bytes = max_bytes
        self._exporter = exporter
        self._written = written
        self.trail: Trail | None = None  # set by the sink once made (the trail seals through `append`)

    async def commit(self, records: list[Record], *, checkpoint: bool = False, final: bool = False) -> None:
        """Check (and rotate) the file, then `append`."""
        trail = self.trail
        if trail is not None:
            await trail.ensure(force=final)  # deleted / moved / truncated from outside (trail.py)
            if trail.fd is not None and trail.size >= self._max_bytes and (records or checkpoint):
                await trail.rotate()
        await self.append(records, checkpoint=checkpoint, final=final)

    async def append(self, records: list[Record], *, checkpoint: bool = False, final: bool = False) -> None:
        """Chain, encode and write one batch (+ checkpoints); on failure the chain state is rolled back."""
        head = self._head
        chain = head.writer
        snap = chain.snapshot()
        prev_file = head.prev_file
        lines: list[bytes] = []
        out: list[Record] = []
        try:
            if chain.state.seq == 0:
                start = ChainWriter.start_record(self._clock(), self._signer.key_id, head.prev_file)
                for rec in (start, *head.incident_next):
                    lines.append(chain.append(rec))
                    out.append(rec)
            for rec in records:
                lines.append(chain.append(rec))
                out.append(rec)
                if chain.state.since_checkpoint >= self._checkpoint_every:
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
            trail = self.trail
            if trail is not None and trail.fd is not None:
                trail.size = await self._batches.write(trail.fd, trail.size, data, trail.path)
            elif self._exporter is not None and not await asyncio.to_thread(self._exporter.export, out):
                raise ExportFailed(f"OTLP export to {self._exporter.endpoint} failed")
        except BaseException:
            chain.restore(snap)
            head.prev_file = prev_file
            raise
        head.prev_file = None
        head.incident_next.clear()
        self._written(out)
