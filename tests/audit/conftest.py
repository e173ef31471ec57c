"""Audit fixtures: a real Ed25519 signer, real files in tmp dirs, real sinks (no mocks), a real full disk,
and the loopback gateway world for the end-to-end test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import LocalEd25519Signer
from tests.support.gwworld import World, open_world
from tests.support.tmpfs import tiny_tmpfs


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



@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 96 KiB tmpfs: a genuinely full disk (ENOSPC), not a simulated one."""
    with tiny_tmpfs(tmp_path / "tiny", "96k") as mnt:
        yield mnt


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The loopback gateway world (tests/support/gwworld.py), for test_gateway_e2e.py."""
    with open_world(tmp_path_factory.mktemp("gwworld")) as w:
        yield w
