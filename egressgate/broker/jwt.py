"""Compact JWS (EdDSA / Ed25519) assembly, JWK thumbprints and JWKS documents.

Signing itself is the backend's job (a local key or a Vault transit key that never leaves Vault); this
module only builds the exact bytes that get signed and the public-key documents upstreams verify with,
so both backends produce byte-identical token shapes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from typing import Any


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def okp_jwk(public_raw: bytes) -> dict[str, str]:
    """The public JWK of a raw 32-byte Ed25519 key, with its RFC 7638 thumbprint as `kid`."""
    if len(public_raw) != 32:
        raise ValueError("Ed25519 public keys are 32 bytes")
    x = b64url(public_raw)
    # RFC 7638: required members only, lexicographic order, no whitespace.
    thumb = b64url(hashlib.sha256(_json({"crv": "Ed25519", "kty": "OKP", "x": x})).digest())
    return {"kty": "OKP", "crv": "Ed25519", "x": x, "kid": thumb, "alg": "EdDSA", "use": "sig"}


def claims(issuer: str, subject: str, audience: str, now: float, ttl_seconds: int) -> dict[str, Any]:
    """Registered claims for a sandbox-bound token; `jti` makes every mint distinct (replay tracking)."""
    iat = int(now)
    return {
        "iss": issuer,
        "sub": subject,
        "aud": audience,
        "iat": iat,
        "nbf": iat,
        "exp": iat + ttl_seconds,
        "jti": secrets.token_urlsafe(16),
    }


def signing_input(kid: str, payload: dict[str, Any]) -> bytes:
    header = {"alg": "EdDSA", "typ": "JWT", "kid": kid}
    return f"{b64url(_json(header))}.{b64url(_json(payload))}".encode("ascii")


def assemble(signing_input_bytes: bytes, signature: bytes) -> str:
    return f"{signing_input_bytes.decode('ascii')}.{b64url(signature)}"


def unverified_parts(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Header and payload of a token we received from a trusted issuer (Vault), for exp/kid only."""
    try:
        h, p, _sig = token.split(".")
        return json.loads(b64url_decode(h)), json.loads(b64url_decode(p))
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError("malformed JWT") from exc
