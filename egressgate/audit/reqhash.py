"""The canonical request hash (`egressgate.request.hash`), specified in docs/audit.md ("Request hash").

Why this shape: an auditor holding a captured request (e.g. from the sandbox side) must be able to
recompute the hash without egressgate, so every field is length-prefixed (no delimiter or injection
ambiguity), canonicalized by the same rules the gateway decides on (policy/canon.py), and limited to what
the sandbox itself sent: credentials the gateway injects and the sandbox's Proxy-Authorization are never
part of it, and the only header included is Content-Type (it fixes how the body is interpreted).

    canonical = "egressgate-request-v1\\n" || F(method) || F(scheme) || F(host) || F(port) || F(path)
                || F(query) || F(content_type) || F(body_sha256_hex)
    F(x)      = ASCII decimal byte length of x || ":" || x || "\\n"     (x as UTF-8 octets)
    request.hash = "sha256:" || lower-hex(SHA-256(canonical))
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

DOMAIN = b"egressgate-request-v1\n"
DEFAULT_PORTS = {"http": 80, "https": 443}
EMPTY_BODY_SHA256 = hashlib.sha256(b"").hexdigest()


class RequestHashError(ValueError):
    """The request cannot be canonicalized (bad URL, userinfo, bad port...)."""


def _octets(value: str | bytes) -> bytes:
    # surrogateescape: a str decoded from raw bytes that way (as HTTP stacks do) round-trips to those bytes
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


def _field(value: str | bytes) -> bytes:
    data = _octets(value)
    return str(len(data)).encode("ascii") + b":" + data + b"\n"


def body_sha256(body: bytes) -> str:
    """Lower-case hex SHA-256 of the body octets as sent (after de-chunking, before any decoding)."""
    return hashlib.sha256(body).hexdigest()


class BodyHasher:
    """Incremental body digest for streamed bodies (feed every chunk, then `.hexdigest()`)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self._h.update(chunk)
        self.size += len(chunk)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def content_type_value(headers: Iterable[tuple[str, str]]) -> str:
    """Content-Type as the hash sees it: every Content-Type field value (name compared case-insensitively)
    with SP/HTAB trimmed, joined with "," in order; "" when absent. No other header is ever included."""
    values = [v.strip(" \t") for k, v in headers if k.strip().lower() == "content-type"]
    return ",".join(values)


def canonical_request(
    method: str,
    scheme: str,
    host: str,
    port: int,
    path: str,
    query: str | bytes | None,
    content_type: str,
    body_hex: str,
) -> bytes:
    """The exact octets hashed, from already-canonical fields (see the module docstring)."""
    parts = (method, scheme, host, str(int(port)), path, query or "", content_type, body_hex)
    return DOMAIN + b"".join(_field(p) for p in parts)


def request_hash(
    method: str,
    scheme: str,
    host: str,
    port: int,
    path: str,
    query: str | bytes | None = None,
    content_type: str = "",
    body_hex: str = EMPTY_BODY_SHA256,
) -> str:
    """`sha256:<hex>` from canonical fields: what the gateway calls with the values it decided on."""
    data = canonical_request(method, scheme, host, port, path, query, content_type, body_hex)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def parse_url(url: str) -> tuple[str, str, str]:
    """absolute URL -> (scheme, authority, request-target without fragment). Kept deliberately simple and
    documented: scheme up to "://", authority up to the first "/", "?" or "#", the rest up to "#"."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS:
        raise RequestHashError(f"URL must be absolute http:// or https://, got {url!r}")
    end = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if i >= 0:
            end = min(end, i)
    authority, target = rest[:end], rest[end:].split("#", 1)[0]
    if not authority:
        raise RequestHashError("URL has no host")
    if not target.startswith("/"):
        target = "/" + target
    return scheme, authority, target


def canonical_fields(
    method: str, url: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b""
) -> tuple[str, str, str, int, str, str, str, str]:
    """Raw request -> the eight canonical fields, using policy.canon (the gateway's one parser)."""
    from egressgate.policy import canon

    scheme, authority, target = parse_url(url)
    try:
        host, port = canon.split_host_port(authority, DEFAULT_PORTS[scheme])
        path, query = canon.split_path_query(target)
        meth = canon.canon_method(method)
    except ValueError as exc:  # canon.CanonError is a ValueError
        raise RequestHashError(f"cannot canonicalize request: {exc}") from exc
    return meth, scheme, host, int(port), path, query, content_type_value(headers), body_sha256(body)


def request_hash_raw(method: str, url: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b"") -> str:
    """`sha256:<hex>` of a request as captured: what `egressgate audit hash` prints."""
    return request_hash(*canonical_fields(method, url, headers, body))


class StreamingRequestHash:
    """The request hash of a request whose body is streamed: fields fixed at the headers, body fed
    chunk by chunk (e.g. from mitmproxy's stream callable), hashes read once the body has ended."""

    def __init__(
        self, method: str, scheme: str, host: str, port: int, path: str, query: str | bytes | None, content_type: str
    ) -> None:
        self._fields = (method, scheme, host, port, path, query, content_type)
        self._body = BodyHasher()

    def update(self, chunk: bytes) -> None:
        self._body.update(chunk)

    @property
    def body_size(self) -> int:
        return self._body.size

    def body_hash(self) -> str:
        return "sha256:" + self._body.hexdigest()

    def request_hash(self) -> str:
        return request_hash(*self._fields, self._body.hexdigest())
