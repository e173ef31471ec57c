"""Audit events for the trail's own tests: a realistic allowed HTTPS request, numbered so each is distinct;
and `crash`, a file sink stopped as kill -9 stops it."""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest

from egressgate.audit.event import AuditEvent, AuditUnavailable, EventKind
from egressgate.audit.filesink import FileSink

_ids = itertools.count()


def http_event(i: int = 0, **kw) -> AuditEvent:
    """Event `i` (its time and request id follow `i`); `kw` overrides any field."""
    base = dict(
        kind=EventKind.HTTP_REQUEST,
        time_ns=1_795_000_000_000_000_000 + i * 1_000_000,
        request_id=f"req-{i}-{next(_ids)}",
        sandbox_id="sbx-1",
        sandbox_labels={"team": "finance"},
        decision="allow",
        reason="rule_matched",
        rule_id="openai",
        policy_name="invoice-analysis",
        policy_hash="sha256:" + "ab" * 32,
        target_as_sent="https://api.openai.com/v1/responses",
        scheme="https",
        host="api.openai.com",
        port=443,
        method="POST",
        path="/v1/responses",
        pinned_address="198.18.0.10",
        bytes_out=120,
    )
    base.update(kw)
    return AuditEvent(**base)


async def fill_until_failure(sink, start: int = 0) -> tuple[list[str], AuditEvent]:
    """Write events until the sink refuses one (a full disk): the accepted request ids and the refused event."""
    accepted, i = [], start
    while True:
        ev = http_event(i)
        try:
            await sink.write(ev)
        except AuditUnavailable:
            return accepted, ev
        accepted.append(ev.request_id)
        i += 1
        assert i < start + 10_000, "disk never filled"


async def crash(sink: FileSink) -> None:
    """Stop the writer without the final checkpoint, as kill -9 does (the process-level tests really
    SIGKILL `egressgate run` and its workers: tests/gateway/test_audit_faults.py,
    tests/state_redis/test_workers.py)."""
    sink._writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sink._writer
    sink._trail.close()
    os.close(sink._lock)  # the kernel drops a dead process's writer lock (audit/writerlock.py)
