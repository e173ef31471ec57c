"""Audit fixtures: a real Ed25519 signer, real files in tmp dirs, real sinks (no mocks)."""

from __future__ import annotations

import itertools
import time

import pytest

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import LocalEd25519Signer

_ids = itertools.count()


@pytest.fixture
def signer(tmp_path) -> LocalEd25519Signer:
    return LocalEd25519Signer.load_or_create(tmp_path / "keys" / "audit-signing.key")


@pytest.fixture
def pubkey(signer, tmp_path):
    return tmp_path / "keys" / "audit-signing.key.pub"


def http_event(i: int = 0, **kw) -> AuditEvent:
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


@pytest.fixture
async def make_sink(tmp_path, signer):
    """Factory for started sinks; every sink is closed at teardown (final checkpoint written)."""
    sinks: list[FileSink] = []

    async def factory(path=None, **kw) -> FileSink:
        path = tmp_path / "audit" / "audit.jsonl" if path is None else path
        sink = await FileSink(path, kw.pop("signer", signer), **kw).start()
        sinks.append(sink)
        return sink

    yield factory
    for s in sinks:
        await s.close()


def now_ns() -> int:
    return time.time_ns()
