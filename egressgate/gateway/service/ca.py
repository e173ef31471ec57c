"""The gateway CA (mitmproxy's, in `ca_dir`) and the two trust bundles built from it.

* sandbox bundle = system roots + gateway CA: what the sandbox's SSL_CERT_FILE & co. point at, so
  intercepted TLS verifies and ordinary TLS keeps working.
* upstream bundle = system roots + `upstream.ca_bundle`: mitmproxy's `ssl_verify_upstream_trusted_ca`
  *replaces* its trust store (certifi by default), so an extra CA must be added to a full bundle.

The CA private key never leaves `ca_dir` (0700, key files 0600); only certificates are exported.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from mitmproxy import certs

CA_BASENAME = "mitmproxy"
CA_CERT = f"{CA_BASENAME}-ca-cert.pem"
SANDBOX_BUNDLE = "sandbox-ca-bundle.pem"
UPSTREAM_BUNDLE = "upstream-ca-bundle.pem"
_SYSTEM_CANDIDATES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)


class CAError(RuntimeError):
    pass


def system_roots() -> Path:
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile, *_SYSTEM_CANDIDATES):
        if candidate and os.path.isfile(candidate):
            return Path(candidate)
    try:
        import certifi

        return Path(certifi.where())
    except ImportError as exc:  # pragma: no cover - certifi ships with mitmproxy's deps
        raise CAError("no system CA bundle found") from exc


def ensure_ca(ca_dir: Path) -> Path:
    """Create the CA on first use (mitmproxy's format, so mitmproxy loads the same files)."""
    ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(ca_dir, 0o700)
    certs.CertStore.from_store(str(ca_dir), CA_BASENAME, 2048)
    for name in os.listdir(ca_dir):
        path = ca_dir / name
        if name.endswith(".pem") and "cert" not in name and path.is_file() and "bundle" not in name:
            os.chmod(path, 0o600)  # files holding the private key
    cert = ca_dir / CA_CERT
    if not cert.is_file():
        raise CAError(f"CA certificate missing after creation: {cert}")
    return cert


def _write_bundle(out: Path, parts: list[Path]) -> Path:
    data = b""
    for part in parts:
        try:
            chunk = part.read_bytes()
        except OSError as exc:
            raise CAError(f"cannot read CA bundle part {part}: {exc.strerror}") from exc
        if b"-----BEGIN CERTIFICATE-----" not in chunk:
            raise CAError(f"{part} contains no PEM certificate")
        data += chunk.rstrip(b"\n") + b"\n"
    try:
        if out.read_bytes() == data and out.stat().st_mode & 0o777 == 0o644:
            return out  # unchanged: no rewrite (every worker of `run --workers N` builds it at start)
    except OSError:
        pass
    # a temporary name of this process: two workers starting at once each rename a complete file of
    # their own (a shared name let one rename the file the other was still writing, or find it gone)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)  # certificates only, meant to be handed to sandboxes
    tmp.replace(out)
    return out


def sandbox_bundle(ca_dir: Path) -> Path:
    cert = ensure_ca(ca_dir)
    return _write_bundle(ca_dir / SANDBOX_BUNDLE, [system_roots(), cert])


def upstream_bundle(ca_dir: Path, extra: str | None) -> Path:
    parts = [system_roots()]
    if extra:
        parts.append(Path(extra))
    ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return _write_bundle(ca_dir / UPSTREAM_BUNDLE, parts)
