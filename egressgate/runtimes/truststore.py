"""Where the sandbox CA bundle goes inside a sandbox, so programs trust the gateway without being told (issue 21).

Environment variables (admitenv.CA_ENV_VARS) reach only the clients that read them: wget, grpcio's default
credentials without GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, Go, OpenSSL's own tools, an agent that cleared its
environment or a subprocess started with a fresh one read the *system* trust store. So every runtime puts the
bundle at each path the common distributions' TLS libraries read by default, the same bytes everywhere:

* one file: Debian/Ubuntu/Arch `/etc/ssl/certs/ca-certificates.crt` (also OpenSSL's default cafile on Debian,
  through /usr/lib/ssl/cert.pem), Alpine/LibreSSL `/etc/ssl/cert.pem` (also the default cafile of an OpenSSL
  built with OPENSSLDIR=/etc/ssl, such as node's), RHEL/Fedora `/etc/pki/tls/certs/ca-bundle.crt` and
  `/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem`, openSUSE `/etc/ssl/ca-bundle.pem`, `/etc/pki/tls/cacert.pem`
  (together: Go's crypto/x509 list), and egressgate's own `/etc/egressgate/ca.pem` (the variables point there);
* the OpenSSL hashed directory `/etc/ssl/certs` (CApath users: `openssl`, Python's `capath=`, curl `--capath`):
  `<subject hash>.0` for every subject hash of the bundle, a file holding only the certificates with that hash,
  as `openssl rehash` lays it out. Not a link to ca-certificates.crt (which OpenSSL's lookup alone would accept):
  clients that load every file of the directory — GnuTLS's trust directory, so libcurl-gnutls with its default
  CApath (git over HTTPS on Debian), Go's crypto/x509 — would parse the whole bundle once per link, ~150 x 150
  certificates: seconds of CPU on every TLS connection of `git clone`. The directory holds nothing else of the
  host's per-certificate files (in the netns runtime the host's Java keystore directory /etc/ssl/certs/java is
  bound too: Debian's JDKs find their default store through it).

The bundle is the system roots plus the gateway CA (gateway/service/ca.py), not the gateway CA alone: routes the policy
splices (`tls: passthrough`, TLS inside `network.tcp`) show the upstream's real certificate, and a policy reload
can add one while a sandbox runs, so a bundle cut to the policy at start would go stale. The public roots give a
sandbox no way around the gateway (it has no route but the gateway, and which hosts are spliced is the policy's
choice, not the client's); on an intercepted route the gateway presents its own certificate, so a public root
never vouches for it.

Stdlib only (imported on `sandbox run`'s start-up path). The subject hash is OpenSSL's X509_NAME_hash
(crypto/x509/x_name.c: SHA-1 of the canonical name encoding), computed here without linking OpenSSL; a test
compares it with `openssl x509 -subject_hash` over the host's roots.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from egressgate.runtimes.base import CA_PATH_IN_SANDBOX

HASHED_DIR = "/etc/ssl/certs"
MAIN_FILE = f"{HASHED_DIR}/ca-certificates.crt"
# every other path that gets the same bundle (each a symlink to MAIN_FILE where the runtime can make one)
OTHER_FILES = (
    "/etc/ssl/cert.pem",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    CA_PATH_IN_SANDBOX,
)
BUNDLE_PATHS = (MAIN_FILE, *OTHER_FILES)

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n(.+?)-----END CERTIFICATE-----", re.S)
# ASN.1 string tags OpenSSL canonicalizes (ASN1_MASK_CANON): UTF8, Printable, T61, IA5, Universal, BMP, Visible
_UTF8, _PRINTABLE, _T61, _IA5, _VISIBLE, _UNIVERSAL, _BMP = 0x0C, 0x13, 0x14, 0x16, 0x1A, 0x1C, 0x1E
_CANON_TAGS = {_UTF8, _PRINTABLE, _T61, _IA5, _VISIBLE, _UNIVERSAL, _BMP}
_SPACE = b" \t\n\v\f\r"


class BadCertificate(ValueError):
    """A bundle entry that is not a DER certificate this parser understands."""


def certificates(bundle: bytes) -> list[bytes]:
    """The DER certificates of a PEM bundle, in order."""
    out = []
    for match in _PEM.finditer(bundle):
        try:
            out.append(base64.b64decode(b"".join(match.group(1).split()), validate=True))
        except ValueError as exc:
            raise BadCertificate("a PEM block of the CA bundle is not base64") from exc
    return out


def _tlv(data: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at `pos` (single-byte tags only: X.509 names)."""
    if pos + 2 > len(data):
        raise BadCertificate("truncated DER")
    tag, first = data[pos], data[pos + 1]
    pos += 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if count == 0 or count > 4 or pos + count > len(data):
            raise BadCertificate("unsupported DER length")
        length = int.from_bytes(data[pos : pos + count], "big")
        pos += count
    if pos + length > len(data):
        raise BadCertificate("truncated DER")
    return tag, pos, pos + length


def _children(data: bytes, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(tag, element start, value start, value end) of each element in data[start:end]."""
    out, pos = [], start
    while pos < end:
        tag, vstart, vend = _tlv(data, pos)
        out.append((tag, pos, vstart, vend))
        pos = vend
    return out


def _der(tag: int, value: bytes) -> bytes:
    n = len(value)
    if n < 0x80:
        return bytes((tag, n)) + value
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((tag, 0x80 | len(size))) + size + value


def subject_der(cert: bytes) -> bytes:
    """The subject Name (whole DER element) of a DER certificate."""
    _, cstart, cend = _tlv(cert, 0)  # Certificate SEQUENCE
    tbs_tag, _, tstart, tend = _children(cert, cstart, cend)[0]
    fields = _children(cert, tstart, tend)
    if tbs_tag != 0x30 or not fields:
        raise BadCertificate("not an X.509 certificate")
    i = 1 if fields[0][0] == 0xA0 else 0  # [0] version is optional
    # serial, signature algorithm, issuer, validity, subject
    if len(fields) < i + 5:
        raise BadCertificate("not an X.509 certificate")
    _, start, _, end = fields[i + 4]
    return cert[start:end]


def _canon_string(tag: int, value: bytes) -> bytes:
    """OpenSSL's asn1_string_canon: as UTF-8, outer whitespace dropped, inner runs collapsed to one space,
    ASCII lower-cased (bytes >= 0x80 kept)."""
    if tag in (_PRINTABLE, _T61, _IA5, _VISIBLE):
        text = value.decode("latin-1")  # one byte per character (OpenSSL treats T61String as Latin-1)
    elif tag == _BMP:
        text = value.decode("utf-16-be")
    elif tag == _UNIVERSAL:
        text = value.decode("utf-32-be")
    else:
        text = value.decode("utf-8")
    raw = text.encode("utf-8").strip(_SPACE)
    out, in_space = bytearray(), False
    for byte in raw:
        if byte < 0x80 and bytes((byte,)) in _SPACE:
            if not in_space:
                out.append(0x20)
            in_space = True
            continue
        in_space = False
        out.append(byte + 32 if 0x41 <= byte <= 0x5A else byte)
    return bytes(out)


def name_canon(name: bytes) -> bytes:
    """OpenSSL's x509_name_canon: each RDN as a DER SET of its canonical entries, concatenated (no outer
    SEQUENCE)."""
    tag, start, end = _tlv(name, 0)
    if tag != 0x30:
        raise BadCertificate("subject is not a Name")
    out = b""
    for rdn_tag, _, rstart, rend in _children(name, start, end):
        if rdn_tag != 0x31:
            raise BadCertificate("RDN is not a SET")
        entries = []
        for atv_tag, _, astart, aend in _children(name, rstart, rend):
            parts = _children(name, astart, aend)
            if atv_tag != 0x30 or len(parts) != 2:
                raise BadCertificate("malformed attribute")
            (_, ostart, _, oend), (vtag, vpos, vstart, vend) = parts
            value = name[vpos:vend]
            if vtag in _CANON_TAGS:
                value = _der(_UTF8, _canon_string(vtag, name[vstart:vend]))
            entries.append(_der(0x30, name[ostart:oend] + value))
        out += _der(0x31, b"".join(sorted(entries)))  # DER SET OF: members in ascending encoding order
    return out


def subject_hash(cert: bytes) -> str:
    """`openssl x509 -subject_hash` of a DER certificate (eight hex digits)."""
    digest = hashlib.sha1(name_canon(subject_der(cert)), usedforsecurity=False).digest()
    return f"{int.from_bytes(digest[:4], 'little'):08x}"


def hash_groups(bundle: bytes) -> dict[str, list[int]]:
    """`<hash>.0` → the positions (in `certificates(bundle)` order) of the certificates with that subject hash;
    one name per distinct hash (two subjects sharing a hash share the file, as with `openssl rehash`'s .0)."""
    groups: dict[str, list[int]] = {}
    for i, cert in enumerate(certificates(bundle)):
        groups.setdefault(f"{subject_hash(cert)}.0", []).append(i)
    return dict(sorted(groups.items()))


def hash_links(bundle: bytes) -> list[str]:
    """The `<hash>.0` names of the hashed directory for `bundle`, sorted, one per distinct subject hash."""
    return list(hash_groups(bundle))


# keystores other runtimes keep under /etc/ssl/certs, bound from the host when it has them: Debian's JDKs link
# $JAVA_HOME/lib/security/cacerts here (public roots only; docs/runtimes.md adds the gateway CA to a copy)
HOST_KEYSTORES = ("/etc/ssl/certs/java",)


_LINK = re.compile(r"[0-9a-f]{8}\.0")


def _valid_groups(cached: object, count: int) -> bool:
    return (isinstance(cached, dict) and bool(cached)
            and all(isinstance(k, str) and _LINK.fullmatch(k) and isinstance(v, list) and v
                    and all(isinstance(i, int) and 0 <= i < count for i in v) for k, v in cached.items()))


def cached_hash_groups(bundle: bytes, cache_dir: Path | None) -> dict[str, list[int]]:
    """hash_groups, remembered in `cache_dir` (the runtime's root-owned state dir) per bundle digest: parsing and
    hashing ~150 roots costs 15-70 ms, paid at every `sandbox run` otherwise. A cache entry that is not a map of
    `<8 hex>.0` names to positions of the bundle's certificates is ignored and rewritten."""
    if cache_dir is None:
        return hash_groups(bundle)
    path = cache_dir / f"trust-groups-{hashlib.sha256(bundle).hexdigest()[:32]}.json"
    try:
        cached = json.loads(path.read_text())
        if _valid_groups(cached, len(_PEM.findall(bundle))):
            return cached
    except (OSError, ValueError):
        pass
    groups = hash_groups(bundle)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(groups))
        tmp.replace(path)
    except OSError:
        pass  # a cache it cannot write costs time, not correctness
    return groups


def cached_hash_links(bundle: bytes, cache_dir: Path | None) -> list[str]:
    """hash_links through the cache of cached_hash_groups."""
    return sorted(cached_hash_groups(bundle, cache_dir))


def hashed_files(bundle: bytes, cache_dir: Path | None = None) -> dict[str, bytes]:
    """`<hash>.0` → its content: the PEM blocks of the bundle's certificates with that subject hash."""
    blocks = [m.group(0) + b"\n" for m in _PEM.finditer(bundle)]
    return {name: b"".join(blocks[i] for i in positions)
            for name, positions in cached_hash_groups(bundle, cache_dir).items()}


def bwrap_args(main_fd: int, bundle: bytes, data_fd: Callable[[bytes], int],
               cache_dir: Path | None = None) -> list[str]:
    """bwrap arguments laying out the trust store (netns runtime): the bundle read-only from `main_fd` at
    MAIN_FILE, every other path a symlink to it (bwrap creates the parents), each `<hash>.0` file copied from
    an fd that `data_fd(content)` opens for bwrap (mode 0444, on the root bwrap remounts read-only), and the
    host's HOST_KEYSTORES read-only where they exist."""
    args = ["--perms", "0755", "--dir", HASHED_DIR, "--perms", "0444", "--ro-bind-data", str(main_fd), MAIN_FILE]
    for path in HOST_KEYSTORES:
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--ro-bind", path, path]
    for path in OTHER_FILES:
        args += ["--symlink", MAIN_FILE, path]
    for name, content in hashed_files(bundle, cache_dir).items():
        args += ["--perms", "0444", "--file", str(data_fd(content)), f"{HASHED_DIR}/{name}"]
    return args


def host_tree(bundle: bytes, out: Path, cache_dir: Path | None = None) -> Path:
    """The hashed directory as a host directory (container runtimes bind it at HASHED_DIR): ca-certificates.crt
    and the `<hash>.0` files (0444). Returns the file, which the runtime binds at OTHER_FILES."""
    out.mkdir(mode=0o755, parents=True, exist_ok=True)
    main = out / "ca-certificates.crt"
    main.write_bytes(bundle)
    main.chmod(0o444)
    for name, content in hashed_files(bundle, cache_dir).items():
        (out / name).write_bytes(content)
        (out / name).chmod(0o444)
    return main
