"""The embedded backend for `egressgate run`: secrets in owner-only files, JWTs signed by a local key.

Everything that holds a secret must be unreadable to anyone but the gateway user: a capture file or key
with mode 0644 is how a peer leaked a live key. Files with any group/other bit, not owned by us, or not
regular files are refused, and the check is made on the opened descriptor (no check-then-open race).
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from egressgate.broker.config import FileSource, StaticCapability
from egressgate.broker.credential import CredentialUnavailable
from egressgate.broker.jwt import okp_jwk

MAX_SECRET_BYTES = 64 * 1024
KEY_FILE = "jwt-ed25519.pem"


def _check_private(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CredentialUnavailable(f"{path}: not a regular file")
    if st.st_mode & 0o077:
        raise CredentialUnavailable(
            f"{path}: mode {stat.S_IMODE(st.st_mode):04o} is readable by group/other; chmod 600 it"
        )
    if st.st_uid != os.geteuid():
        raise CredentialUnavailable(f"{path}: owned by uid {st.st_uid}, not the gateway user")
    return st


def read_private_file(path: str) -> tuple[bytes, os.stat_result]:
    """Read a file that must be private to the gateway user (refused otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise CredentialUnavailable(f"{path}: cannot open ({exc.strerror})") from None
    try:
        st = _check_private(fd, path)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise CredentialUnavailable(f"{path}: larger than {MAX_SECRET_BYTES} bytes")
    return data, st


def read_secret_file(source: FileSource) -> tuple[str, str]:
    data, st = read_private_file(source.file)
    if data.endswith(b"\n"):
        data = data[:-1]
        if data.endswith(b"\r"):
            data = data[:-1]
    try:
        value = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CredentialUnavailable(f"{source.file}: secret is not UTF-8") from None
    if not value or any(c in value for c in "\r\n\x00"):
        raise CredentialUnavailable(f"{source.file}: secret is empty or contains CR/LF/NUL")
    return value, f"file:{source.file}@{st.st_mtime_ns}"


def load_or_create_key(key_dir: str) -> Ed25519PrivateKey:
    """The local signing key; created 0600 in a 0700 directory on first use, refused if exposed."""
    directory = Path(key_dir)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / KEY_FILE
    if not path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            pass  # another process won the race; fall through and load theirs
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(pem)
    data, _ = read_private_file(str(path))
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise CredentialUnavailable(f"{path}: not an Ed25519 private key")
    return key


class LocalBackend:
    """Static secrets from files, JWTs signed in-process. No OIDC (that needs Vault's identity engine)."""

    name = "local"

    def __init__(self, key_dir: str) -> None:
        self.key_dir = key_dir
        self.calls = 0
        self._key: Ed25519PrivateKey | None = None
        self._jwk: dict[str, str] | None = None

    async def start(self) -> None:
        self._key = await asyncio.to_thread(load_or_create_key, self.key_dir)
        raw = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self._jwk = okp_jwk(raw)

    async def aclose(self) -> None:
        self._key = None

    async def fetch_static(self, capability: StaticCapability) -> tuple[str, str]:
        if not isinstance(capability.source, FileSource):
            raise CredentialUnavailable("a vault source needs broker backend 'vault'")
        self.calls += 1
        return await asyncio.to_thread(read_secret_file, capability.source)

    def _require_key(self) -> tuple[Ed25519PrivateKey, dict[str, str]]:
        if self._key is None or self._jwk is None:
            raise CredentialUnavailable("local backend not started")
        return self._key, self._jwk

    async def signing_kid(self) -> str:
        return self._require_key()[1]["kid"]

    async def sign(self, kid: str, data: bytes) -> bytes:
        key, jwk = self._require_key()
        if kid != jwk["kid"]:
            raise CredentialUnavailable(f"unknown signing key {kid!r}")
        self.calls += 1
        return key.sign(data)

    async def oidc_token(self, role: str) -> str:
        raise CredentialUnavailable("vault_oidc capabilities need broker backend 'vault'")

    async def public_jwks(self) -> list[dict[str, str]]:
        return [dict(self._require_key()[1])]
