"""runtimes/truststore.py without a sandbox: the subject hash is OpenSSL's (checked against the `openssl` CLI
over every root of the host's bundle and over CAs with awkward names), and the layout handed to bwrap and to
containers (issue 21 item 3). That the paths are where clients look is proved by real clients in
test_trust_default_paths.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from egressgate.gateway.service.ca import system_roots
from egressgate.runtimes import truststore

HOST_BUNDLE = system_roots().read_bytes()


def openssl_hash(der: bytes) -> str:
    res = subprocess.run(["openssl", "x509", "-inform", "DER", "-noout", "-subject_hash"], input=der,
                         capture_output=True, check=True, timeout=30)
    return res.stdout.decode().strip()


def self_signed(name: x509.Name) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    import datetime

    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


def openssl_rehash(certs: list[bytes], tmp: Path) -> dict[bytes, str]:
    """OpenSSL's subject hash of each certificate from one `openssl rehash` of a directory holding each in a
    file of its own: the HASH.N link it makes names the hash (X509_subject_name_hash, what `x509
    -subject_hash` prints) without a process per certificate (`x509` hashes only the first of its input)."""
    unique = list(dict.fromkeys(certs))  # rehash skips a duplicate certificate: one file per distinct root
    for i, der in enumerate(unique):
        (tmp / f"c{i}.pem").write_bytes(x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM))
    subprocess.run(["openssl", "rehash", str(tmp)], capture_output=True, check=True, timeout=120)
    by_file = {os.readlink(link): link.name.split(".")[0] for link in tmp.iterdir() if link.is_symlink()}
    return {der: by_file[f"c{i}.pem"] for i, der in enumerate(unique)}


def test_subject_hash_matches_openssl_for_every_host_root(tmp_path: Path) -> None:
    certs = truststore.certificates(HOST_BUNDLE)
    assert len(certs) > 50  # the host's real roots, not an empty list that would compare nothing
    hashes_ = openssl_rehash(certs, tmp_path)
    assert len(hashes_) > 50
    mismatched = [i for i, der in enumerate(certs) if truststore.subject_hash(der) != hashes_[der]]
    assert mismatched == []
    # the one-process oracle agrees with the per-certificate one (`x509 -subject_hash`) on a sample
    sample = certs[:: len(certs) // 5]
    assert [hashes_[der] for der in sample] == [openssl_hash(der) for der in sample]


@pytest.mark.parametrize("name", [
    x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "  Mixed   CASE\tname  ")]),  # whitespace, case
    x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Société Générale"),  # non-ASCII (kept)
               x509.NameAttribute(NameOID.COMMON_NAME, "ÉCOLE Root")]),
    x509.Name([x509.RelativeDistinguishedName([  # a multi-valued RDN: SET OF sorted by encoding
        x509.NameAttribute(NameOID.COMMON_NAME, "zz"), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "AA")])]),
    x509.Name([x509.NameAttribute(NameOID.COUNTRY_NAME, "DE"),  # PrintableString next to UTF8String
               x509.NameAttribute(NameOID.EMAIL_ADDRESS, "Root@Example.TEST"),  # IA5String
               x509.NameAttribute(NameOID.SERIAL_NUMBER, "0042")]),
    x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"Unit {i} " + "x" * 50) for i in range(5)]
              + [x509.NameAttribute(NameOID.COMMON_NAME, "long name")]),  # a name of > 255 bytes (long lengths)
])
def test_subject_hash_matches_openssl_for_awkward_names(name: x509.Name) -> None:
    der = self_signed(name)
    assert truststore.subject_hash(der) == openssl_hash(der)


def test_a_changed_name_changes_the_hash() -> None:
    """Positive control of the comparison: canonicalization folds case and spaces, nothing else."""
    a = self_signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Gateway CA")]))
    b = self_signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway  ca ")]))
    c = self_signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Gateway CB")]))
    assert truststore.subject_hash(a) == truststore.subject_hash(b)
    assert truststore.subject_hash(a) != truststore.subject_hash(c)


def each_hash_file_holds_its_certificates(files: dict[str, bytes], bundle: bytes) -> None:
    """Each `<hash>.0` holds only the certificates with that subject hash, and every certificate of the bundle is
    in exactly one of them: a client that loads every file of the directory (GnuTLS, so git over HTTPS; Go)
    parses each certificate once, not the whole bundle once per file."""
    seen: list[bytes] = []
    for name, content in files.items():
        certs = truststore.certificates(content)
        assert certs and {truststore.subject_hash(c) for c in certs} == {name[:8]}, name
        seen += certs
    assert sorted(seen) == sorted(truststore.certificates(bundle))


def test_bwrap_layout_links_every_path_and_copies_every_hash_file() -> None:
    ca = trustme.CA()
    bundle = HOST_BUNDLE + ca.cert_pem.bytes()
    given: dict[int, bytes] = {}

    def data_fd(content: bytes) -> int:
        given[100 + len(given)] = content
        return 99 + len(given)

    args = truststore.bwrap_args(7, bundle, data_fd)
    assert args[:9] == ["--perms", "0755", "--dir", "/etc/ssl/certs", "--perms", "0444", "--ro-bind-data", "7",
                        "/etc/ssl/certs/ca-certificates.crt"]
    links = {args[i + 2]: args[i + 1] for i, word in enumerate(args) if word == "--symlink"}
    for path in truststore.OTHER_FILES:
        assert links[path] == truststore.MAIN_FILE
    assert not any(p.startswith("/etc/ssl/certs/") for p in links)  # no hash name is a link to the bundle
    files = {args[i + 2]: given[int(args[i + 1])] for i, word in enumerate(args) if word == "--file"}
    assert all(args[i - 2 : i] == ["--perms", "0444"] for i, word in enumerate(args) if word == "--file")
    gateway_hash = truststore.subject_hash(truststore.certificates(ca.cert_pem.bytes())[0])
    assert truststore.certificates(files[f"/etc/ssl/certs/{gateway_hash}.0"]) == truststore.certificates(
        ca.cert_pem.bytes())
    assert len(files) == len(truststore.hash_links(bundle)) > 50
    each_hash_file_holds_its_certificates({p.rsplit("/", 1)[1]: c for p, c in files.items()}, bundle)
    assert "/etc/egressgate/ca.pem" in links  # where the CA variables point


def test_host_tree(tmp_path: Path) -> None:
    ca = trustme.CA()
    bundle = HOST_BUNDLE + ca.cert_pem.bytes()
    main = truststore.host_tree(bundle, tmp_path / "certs")
    assert main.read_bytes() == bundle and oct(main.stat().st_mode & 0o777) == "0o444"
    names = sorted(os.listdir(tmp_path / "certs"))
    assert names == sorted(["ca-certificates.crt", *truststore.hash_links(bundle)])
    hashed = {n: (tmp_path / "certs" / n) for n in names if n != "ca-certificates.crt"}
    assert not any(p.is_symlink() for p in hashed.values())
    assert all(oct(p.stat().st_mode & 0o777) == "0o444" for p in hashed.values())
    each_hash_file_holds_its_certificates({n: p.read_bytes() for n, p in hashed.items()}, bundle)
    # OpenSSL's own CApath lookup finds the gateway CA through the links
    leaf = ca.issue_cert("x.test")
    pem = tmp_path / "leaf.pem"
    leaf.cert_chain_pems[0].write_to_path(str(pem))
    ok = subprocess.run(["openssl", "verify", "-no-CAfile", "-CApath", str(tmp_path / "certs"), str(pem)],
                        capture_output=True, text=True, check=False, timeout=30)
    assert ok.returncode == 0, ok.stderr
    other = trustme.CA().issue_cert("x.test")  # positive control: a CA not in the bundle is not found
    other.cert_chain_pems[0].write_to_path(str(pem))
    bad = subprocess.run(["openssl", "verify", "-no-CAfile", "-CApath", str(tmp_path / "certs"), str(pem)],
                         capture_output=True, text=True, check=False, timeout=30)
    assert bad.returncode != 0


def test_hash_links_cache(tmp_path: Path) -> None:
    """The per-bundle cache returns what the computation does, and a tampered entry is recomputed."""
    bundle = HOST_BUNDLE + trustme.CA().cert_pem.bytes()
    links = truststore.hash_links(bundle)
    assert truststore.cached_hash_links(bundle, tmp_path) == links
    (entry,) = tmp_path.glob("trust-groups-*.json")
    assert truststore.cached_hash_links(bundle, tmp_path) == links  # from the cache
    assert truststore.hashed_files(bundle, tmp_path) == truststore.hashed_files(bundle)
    count = len(truststore.certificates(bundle))
    for tampered in ('["../../etc/passwd"]', '{"../../etc/passwd": [0]}', f'{{"{links[0]}": [{count}]}}',
                     f'{{"{links[0]}": []}}'):
        entry.write_text(tampered)
        assert truststore.cached_hash_links(bundle, tmp_path) == links  # refused, recomputed, rewritten
        assert entry.read_text() != tampered
    # positive control: an entry of the right shape is what the cache returns (it is read, not recomputed)
    entry.write_text(f'{{"{links[0]}": [0]}}')
    assert truststore.cached_hash_links(bundle, tmp_path) == [links[0]]
