"""The backend protocol: the only place secrets are fetched or signatures made.

The broker (cache, single-flight, claims) is backend-agnostic; a backend answers four questions. Every
method raises `CredentialUnavailable` on any failure so the gateway can fail closed with one reason.
`calls` counts round trips to the secret store, which is how tests prove caching and single-flight.
"""

from __future__ import annotations

from typing import Protocol

from egressgate.broker.config import StaticCapability


class Backend(Protocol):
    name: str
    calls: int

    async def start(self) -> None:
        """Authenticate / load keys; raise CredentialUnavailable when that is impossible."""

    async def aclose(self) -> None: ...

    async def fetch_static(self, capability: StaticCapability) -> tuple[str, str]:
        """Return (value, key_id) for a static secret; key_id identifies the version, never the value."""

    async def signing_kid(self) -> str:
        """The kid of the key the next `sign` uses (it goes into the signed header)."""

    async def sign(self, kid: str, data: bytes) -> bytes:
        """Raw Ed25519 signature of `data` by key `kid`."""

    async def oidc_token(self, role: str) -> str:
        """A signed identity token for `role` (vault only)."""

    async def public_jwks(self) -> list[dict[str, str]]:
        """Public JWKs of every signing key version still accepted."""
