"""Audit settings: defaults work with no config; the signing key is created 0600 and refused when loose."""

from __future__ import annotations

import os
import stat

import pytest
from pydantic import ValidationError

from egressgate.audit.config import AuditSinkConfig, open_audit_sink
from egressgate.audit.signer import LocalEd25519Signer, SigningKeyError, load_public_keys
from egressgate.audit.verify import verify_file
from tests.support.audit_events import http_event


async def test_defaults_open_a_verifiable_sink(tmp_path):
    var = tmp_path / "var"
    sink = await open_audit_sink(AuditSinkConfig(), var)
    await sink.write(http_event(1))
    await sink.close()
    key = var / "audit-signing.key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert sink.path == var / "audit.jsonl"
    assert verify_file(sink.path, load_public_keys([var / "audit-signing.key.pub"])).ok


def test_loose_key_permissions_are_refused(tmp_path):
    key = tmp_path / "k.key"
    LocalEd25519Signer.load_or_create(key)
    os.chmod(key, 0o644)
    with pytest.raises(SigningKeyError, match="must be 0600"):
        LocalEd25519Signer.load_or_create(key)


def test_no_destination_is_a_config_error():
    with pytest.raises(ValidationError, match="records would go nowhere"):
        AuditSinkConfig(local_file=False)
    with pytest.raises(ValidationError):
        AuditSinkConfig(on_failure="ignore")
    with pytest.raises(ValidationError):
        AuditSinkConfig(fsnyc=True)
