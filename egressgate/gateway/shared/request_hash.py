"""Attach the canonical request hash (docs/audit.md, "Request hash") to a request's audit records.

The hash covers what the *sandbox* sent, with the canonical values the gateway decided on: method,
scheme, host, port, path, the query as sent, Content-Type and the body's SHA-256. It is fed by the
outermost stream callable, so it sees each chunk before credential guards or budget cuts touch it, and it
is computed before the credentials addon adds anything: injected credentials and Proxy-Authorization can
never be part of it. A request that has no body carries the hash on its decision record already; one
with a body gets it on its outcome record (the body is known only once it has been forwarded). Trailers
are never part of it: a request that carries them is refused (trailers.py) and never forwarded.
"""

from __future__ import annotations

from mitmproxy import http

from egressgate.audit.reqhash import EMPTY_BODY_SHA256, StreamingRequestHash, content_type_value, request_hash
from egressgate.gateway.shared.context import FlowState

EMPTY_BODY_HASH = "sha256:" + EMPTY_BODY_SHA256


def has_no_body(request: http.Request) -> bool:
    """Known at the headers: HTTP/1 without Content-Length/Transfer-Encoding (or Content-Length: 0).
    An HTTP/2 request may always still send DATA frames, so it never counts as body-less here.
    Hot path (every request): the raw bytes fields in one pass, not mitmproxy's decoding accessors
    (`http_version` decodes per access, each header lookup re-encodes its name)."""
    version = request.data.http_version
    if version.startswith(b"HTTP/2") or version.startswith(b"HTTP/3"):
        return False
    lengths = []
    for name, value in request.data.headers.fields:
        lname = name.lower()
        if lname == b"transfer-encoding":
            return False
        if lname == b"content-length":
            lengths.append(value)
    return not lengths or b", ".join(lengths).strip() == b"0"  # several: compared joined, as Headers.get does


def _fields(request: http.Request, fs: FlowState) -> tuple | None:
    """The canonical fields, or None when the request was refused before they were all known."""
    if not (fs.method and fs.scheme and fs.host and fs.port) or fs.path is None:
        return None
    content_type = content_type_value(request.headers.items(multi=True))
    return fs.method, fs.scheme, fs.host, fs.port, fs.path, fs.query, content_type


def bodyless_hash(request: http.Request, fs: FlowState) -> str | None:
    """The request hash when it is already complete at the headers, else None. The fields it hashed are
    kept (`fs.hash_fields`): `start` hashes the same ones, so the outcome record's hash is this one by
    construction, and `finish` reuses it instead of computing it a second time."""
    fields = _fields(request, fs) if has_no_body(request) else None
    if fields is None:
        return None
    fs.hash_fields = fields
    return request_hash(*fields, EMPTY_BODY_SHA256)


def start(request: http.Request, fs: FlowState) -> None:
    """Begin hashing an allowed request's body (a streamed one is fed by compose.py's outermost wrapper)."""
    fields = fs.hash_fields or _fields(request, fs)
    if fields is not None:
        fs.hasher = StreamingRequestHash(*fields)


def feed_buffered(request: http.Request, fs: FlowState) -> None:
    """A buffered (not streamed) body is complete in the `request` hook."""
    hasher = fs.hasher
    if hasher is not None and not request.stream and request.raw_content:
        hasher.update(request.raw_content)


def finish(fs: FlowState) -> tuple[str | None, str | None]:
    """(request hash, body hash) for the outcome record. A body-less request's hash is the one its
    decision record carries (same fields, empty body): computed once per flow, not twice."""
    hasher = fs.hasher
    if hasher is None:
        return None, None
    if fs.bodyless_hash is not None and hasher.body_size == 0:
        return fs.bodyless_hash, EMPTY_BODY_HASH
    return hasher.request_hash(), hasher.body_hash()
