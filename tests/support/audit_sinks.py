"""The audit fixtures tests/audit and tests/audit_index share: a real Ed25519 signer and a factory of
started FileSinks writing real files (no mocks). Import them into a conftest.py."""

from __future__ import annotations

import pytest

from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import LocalEd25519Signer


@pytest.fixture
def signer(tmp_path) -> LocalEd25519Signer:
    return LocalEd25519Signer.load_or_create(tmp_path / "keys" / "audit-signing.key")


@pytest.fixture
def pubkey(signer, tmp_path):
    return tmp_path / "keys" / "audit-signing.key.pub"


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
