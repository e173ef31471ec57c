"""Audit checkpoints signed by a transit key: verifiable with the out-of-band public key."""

from __future__ import annotations

import pytest

from egressgate.audit.signer import load_public_keys, verify_signature
from egressgate.broker.credential import CredentialUnavailable
from egressgate.broker.signer import TransitSigner
from egressgate.broker.vault import VaultBackend
from tests.support.bao import BaoServer, vault_config


async def test_transit_signer_for_audit(bao: BaoServer, tmp_path) -> None:
    backend = VaultBackend(vault_config(bao))
    await backend.start()
    try:
        signer = await TransitSigner.create(backend)
        sig = await signer.sign(b"checkpoint payload")
        pem = tmp_path / "audit.pub"
        pem.write_bytes(signer.public_pem())
        keys = load_public_keys([pem])
        assert list(keys) == [signer.key_id] and signer.algorithm == "ed25519"
        assert verify_signature(keys[signer.key_id], b"checkpoint payload", sig)
        assert not verify_signature(keys[signer.key_id], b"checkpoint payloaD", sig)
        with pytest.raises(CredentialUnavailable, match="need ed25519"):
            await TransitSigner.create(backend, "not-ed25519")
        with pytest.raises(CredentialUnavailable, match="denied"):  # the policy does not cover it
            await TransitSigner.create(backend, "some-other-key")
    finally:
        await backend.aclose()
