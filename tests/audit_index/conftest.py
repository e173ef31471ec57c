"""Audit index fixtures: the shared real signer and FileSinks (tests/support/audit_sinks.py), and a real
index file."""

from __future__ import annotations

import pytest

from egressgate.audit.index import AuditIndex
from tests.support.audit_sinks import make_sink, signer  # noqa: F401  (fixtures)


@pytest.fixture
def index(tmp_path):
    idx = AuditIndex(tmp_path / "index" / "audit.index.sqlite")
    yield idx
    idx.close()
