"""Audit records for connections the gateway refused or closed because of a limit or timeout.

These events can be caused by anyone who can reach the listener, before any identity is known: one
record per event would let an attacker grow the audit log (and its hash chain) as fast as it can open
sockets. So each (reason, source address) gets at most `limits.audit_per_second` individual records
per second; beyond that, events are *counted*, and one summary record per (reason, source) per second
carries `egressgate.suppressed` = how many were folded into it. Nothing is dropped silently: the sum
of individual records and suppressed counts is the number of events, and a record the sink cannot
take now is queued and retried (emit.write_behind), never dropped; `flush()` at shutdown writes the
last summaries.
"""

from __future__ import annotations

import asyncio
import time

from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.gateway.shared.context import Runtime
from egressgate.gateway.shared.emit import write_behind
from egressgate.policy.reasons import Reason

WINDOW = 1.0  # seconds


class LimitAudit:
    def __init__(self, runtime: Runtime, per_second: int) -> None:
        self.rt = runtime
        self.per_second = per_second
        self._window_start = 0.0
        self._counts: dict[tuple[str, str], int] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._flush_handle: asyncio.TimerHandle | None = None

    def record(self, reason: Reason, source: str, message: str, *, sandbox_id: str | None = None,
               request_id: str | None = None, extra: dict | None = None) -> None:
        """Write one record, or count it into the next summary when over the rate (never blocks)."""
        now = time.monotonic()
        if now - self._window_start >= WINDOW:
            self._window_start = now
            self._counts.clear()
        key = (str(reason), source)
        n = self._counts[key] = self._counts.get(key, 0) + 1
        if n <= self.per_second:
            self._write(build(
                EventKind.CONNECTION, request_id=request_id, sandbox_id=sandbox_id, decision="deny",
                reason=str(reason), client_address=source, message=message, extra=extra))
            return
        self._suppressed[key] = self._suppressed.get(key, 0) + 1
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(WINDOW, self.flush)

    def flush(self) -> None:
        """One summary record per (reason, source) with events counted since the last flush."""
        self._flush_handle = None
        pending, self._suppressed = self._suppressed, {}
        for (reason, source), count in sorted(pending.items()):
            self._write(build(
                EventKind.CONNECTION, decision="deny", reason=reason, client_address=source,
                message=f"{count} more connection(s) from {source} refused or closed for {reason} "
                        f"(over {self.per_second} records/s: counted, not recorded one by one)",
                extra={"egressgate.suppressed": count}))

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self.flush()

    def _write(self, event: AuditEvent) -> None:
        """The refusal already took effect: its record goes through emit.write_behind (queued and
        retried when the sink fails, never dropped; shutdown drains it)."""
        write_behind(self.rt, event)
