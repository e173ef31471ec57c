"""Audit fixtures: a real Ed25519 signer, real files in tmp dirs, real sinks (no mocks; shared with
tests/audit_index: tests/support/audit_sinks.py), a real full disk, and the loopback gateway world for the
end-to-end test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.audit_sinks import make_sink, pubkey, signer  # noqa: F401  (fixtures, shared)
from tests.support.gwworld import World, open_world
from tests.support.tmpfs import tiny_tmpfs


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
