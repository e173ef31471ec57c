"""Checkpoint signing: a pluggable `Signer` and the local Ed25519 key file.

Why a protocol: the broker can later hand the audit sink a Vault/OpenBao transit signer (the key never
leaves Vault); the local key file is the embedded default. Verification never trusts a key found in the
log itself: `audit verify` is given the public key(s) out of band.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALGORITHM = "ed25519"


class Signer(Protocol):
    key_id: str
    algorithm: str

    async def sign(self, data: bytes) -> bytes:
        """Raw signature over `data` (Ed25519 signs the message itself, no pre-hash)."""


class SigningKeyError(RuntimeError):
    """The signing key file is unusable (bad permissions, bad format)."""


def key_id_for(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"ed25519:{hashlib.sha256(raw).hexdigest()[:16]}"


def public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class LocalEd25519Signer:
    """Ed25519 key in a PEM (PKCS#8) file with mode 0600, created on first use; `<key>.pub` beside it."""

    algorithm = ALGORITHM

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id_for(self.public_key)

    async def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    @classmethod
    def generate(cls) -> LocalEd25519Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> LocalEd25519Signer:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(pem)
            signer = cls(key)
            pub = path.with_name(path.name + ".pub")
            pub.write_bytes(public_pem(signer.public_key))
            return signer
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise SigningKeyError(f"{path}: audit signing key is not a regular file")
        if st.st_mode & 0o077:
            raise SigningKeyError(
                f"{path}: audit signing key has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0600"
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except ValueError as exc:
            raise SigningKeyError(f"{path}: not a PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(f"{path}: audit signing key must be Ed25519")
        return cls(key)


def load_public_keys(paths: list[str | os.PathLike[str]]) -> dict[str, Ed25519PublicKey]:
    """Trusted verification keys by key id. Accepts PEM public keys, PEM private keys, or base64 raw keys."""
    keys: dict[str, Ed25519PublicKey] = {}
    for p in paths:
        data = Path(p).read_bytes()
        pub: object
        if b"PRIVATE KEY" in data:
            pub = serialization.load_pem_private_key(data, password=None).public_key()
        elif b"PUBLIC KEY" in data:
            pub = serialization.load_pem_public_key(data)
        else:
            pub = Ed25519PublicKey.from_public_bytes(base64.b64decode(data.strip(), validate=True))
        if not isinstance(pub, Ed25519PublicKey):
            raise SigningKeyError(f"{p}: not an Ed25519 key")
        keys[key_id_for(pub)] = pub
    return keys


def verify_signature(public_key: Ed25519PublicKey, data: bytes, signature: bytes) -> bool:
    try:
        public_key.verify(signature, data)
        return True
    except InvalidSignature:
        return False
