"""The audit sink interface the gateway, the DNS resolver and the admin API write to."""

from __future__ import annotations

from typing import Protocol

from egressgate.audit.event import AuditEvent


class AuditSink(Protocol):
    async def write(self, event: AuditEvent) -> None:
        """Return only once the record is durable (written and flushed). Raise AuditUnavailable when it
        cannot be; the caller then denies. Never drops an accepted record."""

    async def write_after(self, event: AuditEvent) -> bool:
        """For the record of something that already happened (an outcome): never raises, never drops;
        a record that cannot be written now is queued and retried (True: durable now, False: queued)."""

    def enqueue_after(self, event: AuditEvent) -> None:
        """`write_after` without waiting (no task per record): the same never-dropped rule, the result
        only in the sink's log and status."""

    def healthy(self) -> bool:
        """False after a write failure until a write succeeds again; callers deny new requests."""

    def status(self) -> dict:
        """Trail status for /healthz: pending records, signer, incidents (file deleted/moved, crash)."""

    async def close(self) -> None: ...
