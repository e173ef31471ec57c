"""Shared by the trust tests (issue 21 item 3): certificates for tests/runtimes/trust_probe.py and the check of
its JSON answer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import trustme

from egressgate.gateway.service.ca import system_roots

PROBE = Path(__file__).resolve().parent / "trust_probe.py"


def sandbox_bundle(ca: trustme.CA) -> bytes:
    """What gateway/service/ca.py hands sandboxes: the system roots, then the gateway CA."""
    return system_roots().read_bytes().rstrip(b"\n") + b"\n" + ca.cert_pem.bytes()


def probe_dir(dest: Path, bundle_ca: trustme.CA, owner: int | None = None) -> None:
    """The probe and the `good` (CA in the bundle) / `bad` (CA not in it) server certificates in `dest`,
    readable by the sandbox uid."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROBE, dest / "trust_probe.py")
    for name, ca in (("good", bundle_ca), ("bad", trustme.CA())):
        leaf = ca.issue_cert("trust.test", "127.0.0.1")
        leaf.cert_chain_pems[0].write_to_path(str(dest / f"{name}.pem"))
        leaf.private_key_pem.write_to_path(str(dest / f"{name}.key"))
    for path in dest.iterdir():
        path.chmod(0o644)
        if owner is not None:
            os.chown(path, owner, owner)


# node verifies against its own compiled-in roots unless started with --use-openssl-ca (docs/runtimes.md)
# and Java its own keystore (the JDK's public roots) unless given one with the gateway CA (docs/runtimes.md)
NOT_DEFAULT_PATH_CLIENTS = ("node", "java (default store)")


def check_probe_output(stdout: str, bundle: bytes) -> dict:
    """Asserts the probe's findings: every trust path holds exactly `bundle`, every default-path client
    verifies `good` and refuses `bad`, and no CA variable was left to help. Plain `node` (its own roots) is
    asserted to refuse both: the documented exception."""
    line = [text for text in stdout.splitlines() if text.startswith("{")]
    assert line, f"probe printed no JSON: {stdout!r}"
    result = json.loads(line[-1])
    assert result["env_left"] == []
    assert result["files"] == {path: True for path in result["files"]}, result["files"]
    good = {name: value for name, value in result["good"].items() if name not in NOT_DEFAULT_PATH_CLIENTS}
    assert good == {name: "ok" for name in good}, result["good"]
    for name in NOT_DEFAULT_PATH_CLIENTS:
        if name in result["good"]:
            assert any(w in result["good"][name] for w in ("certificate", "PKIX")), result["good"][name]
    assert all("CERTIFICATE_VERIFY_FAILED" in value or "certificate" in value.lower() or "PKIX" in value
               for value in result["bad"].values()), result["bad"]
    return result


def gateway_leaf(ca_dir: Path, dest: Path, name: str) -> None:
    """A `good` leaf for 127.0.0.1 signed by the gateway's own CA (mitmproxy-ca.pem holds key and cert):
    what the sandbox bundle must make verify."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = (ca_dir / "mitmproxy-ca.pem").read_bytes()
    ca_key = serialization.load_pem_private_key(pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=True)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (dest / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (dest / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    for suffix in ("pem", "key"):
        (dest / f"{name}.{suffix}").chmod(0o644)
