"""An independent JWT verifier (cryptography + base64 only), playing the upstream that checks tokens.

Deliberately does not import egressgate.broker.jwt: a bug in our encoder must not be mirrored here.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


class TokenRejected(Exception):
    pass


def _d(seg: str) -> bytes:
    return base64.urlsafe_b64decode(seg + "=" * (-len(seg) % 4))


def verify(token: str, jwks: dict[str, Any], *, audience: str, now: float) -> dict[str, Any]:
    try:
        h64, p64, s64 = token.split(".")
    except ValueError:
        raise TokenRejected("not a compact JWS") from None
    header = json.loads(_d(h64))
    if header.get("alg") != "EdDSA":
        raise TokenRejected(f"alg {header.get('alg')}")
    keys = [k for k in jwks["keys"] if k.get("kid") == header.get("kid")]
    if len(keys) != 1 or keys[0]["kty"] != "OKP" or keys[0]["crv"] != "Ed25519":
        raise TokenRejected("unknown kid")
    pub = Ed25519PublicKey.from_public_bytes(_d(keys[0]["x"]))
    try:
        pub.verify(_d(s64), f"{h64}.{p64}".encode())
    except InvalidSignature:
        raise TokenRejected("bad signature") from None
    claims = json.loads(_d(p64))
    aud = claims.get("aud")
    if audience not in (aud if isinstance(aud, list) else [aud]):
        raise TokenRejected(f"aud {aud!r}")
    if not claims.get("exp") or claims["exp"] <= now:
        raise TokenRejected("expired")
    return claims
