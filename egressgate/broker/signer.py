"""Audit checkpoint signing by a Vault/OpenBao transit key (the `audit.signer.Signer` protocol).

The audit chain's checkpoints are only as trustworthy as their signing key; a key file on the gateway
host can be stolen with the host. A transit key never leaves Vault: the gateway can ask for signatures
but cannot take the key, and every signature request is in Vault's own audit log. Use a key separate
from the JWT key (`egressgate-audit`), so token signing and audit signing can be revoked independently.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from egressgate.audit.signer import ALGORITHM, key_id_for, public_pem
from egressgate.broker.vault import VaultBackend


class TransitSigner:
    """Signs with one pinned version of a transit ed25519 key, so `key_id` always matches signatures.

    `sign` raises `CredentialUnavailable` when Vault cannot sign (the sink must treat it as a failure to
    make the checkpoint durable). Rotate by creating a new signer (a new key id starts a new segment).
    """

    algorithm = ALGORITHM

    def __init__(self, backend: VaultBackend, key_name: str, version: int, public_raw: bytes) -> None:
        self._backend = backend
        self.key_name = key_name
        self.version = version
        self.public_key = Ed25519PublicKey.from_public_bytes(public_raw)
        self.key_id = key_id_for(self.public_key)

    @classmethod
    async def create(cls, backend: VaultBackend, key_name: str = "egressgate-audit") -> TransitSigner:
        latest, keys = await backend.transit_key_info(key_name)
        return cls(backend, key_name, latest, keys[latest])

    async def sign(self, data: bytes) -> bytes:
        return await self._backend.transit_sign(self.key_name, self.version, data)

    def public_pem(self) -> bytes:
        """For `egressgate audit verify --key`: verification keys are given out of band."""
        return public_pem(self.public_key)
