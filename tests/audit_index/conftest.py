"""Audit index fixtures: a real Ed25519 signer and real FileSinks writing real files (no mocks)."""

from __future__ import annotations

import pytest

from egressgate.audit.filesink import FileSink
from egressgate.audit.index import AuditIndex
from egressgate.audit.signer import LocalEd25519Signer


@pytest.fixture
def signer(tmp_path) -> LocalEd25519Signer:
    return LocalEd25519Signer.load_or_create(tmp_path / "keys" / "audit-signing.key")


@pytest.fixture
async def make_sink(tmp_path, signer):
    """Factory for started sinks; every sink still open is closed at teardown."""
    sinks: list[FileSink] = []

    async def factory(path=None, **kw) -> FileSink:
        path = tmp_path / "audit" / "audit.jsonl" if path is None else path
        sink = await FileSink(path, kw.pop("signer", signer), **kw).start()
        sinks.append(sink)
        return sink

    yield factory
    for s in sinks:
        await s.close()


@pytest.fixture
def index(tmp_path):
    idx = AuditIndex(tmp_path / "index" / "audit.index.sqlite")
    yield idx
    idx.close()
