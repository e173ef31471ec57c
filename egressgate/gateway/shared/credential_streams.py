"""Stream callables and response framing for credentialed flows: phantom guard on request bodies,
scrub/decode on responses, reframing or refusing a response whose body we rewrite.

mitmproxy's `flow.request.stream` / `flow.response.stream` callables are synchronous, called per chunk
and then once with b"". compose.py chains these with the budget counters in the one stated order, so
one chain both counts and inspects. Two rules of that contract matter here:

- An empty *non-final* return must be `[]`, never b"": mitmproxy frames every returned bytes object, and
  an empty chunk on an HTTP/1 chunked message is the terminator (the upstream would see a complete body).
- Bytes held back (a phantom or a secret may continue in the next chunk) are released only when the
  next chunk proves them harmless, or at the final call.

Kept free of addon state so each piece is testable on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable

from mitmproxy import http

from egressgate.broker.decompress import DecodeError, scrubbing_stream
from egressgate.broker.inject import PHANTOM_MAX_LEN, PhantomBodyScanner, PhantomHit
from egressgate.broker.redact import Scrubber
from egressgate.gateway.shared.deny import REQUEST_ID_HEADER

StreamFn = Callable[[bytes], object]


def as_chunks(out: object) -> list[bytes]:
    """Normalise a stream callable's result (bytes or an iterable of bytes) to non-empty chunks."""
    if isinstance(out, bytes | bytearray | memoryview):
        return [bytes(out)] if out else []
    return [bytes(c) for c in out if c]  # type: ignore[union-attr]


_PHANTOM_START = re.compile(rb"[eE%\\&]")  # the bytes a phantom, raw or escaped, can start with


def phantom_guard(inner: StreamFn | None, on_hit: Callable[[list[PhantomHit]], None]) -> StreamFn:
    """Request-body callable: find a phantom in the sandbox's bytes *before* they reach `inner` (the
    budget counter) or the upstream. Of the last PHANTOM_MAX_LEN-1 bytes (the longest escaped phantom),
    those from the first byte a phantom can start with onwards are held back, so a phantom, raw or
    escaped, split across chunks is caught before any part of it is sent; on a hit nothing more is
    forwarded and `on_hit` runs (it aborts the connection and audits).

    Why the first possible start byte: a phantom is `egph_...` (either case) and every escape of a
    character starts with `%`, `\\` or `&` (broker/escapes.py), so an occurrence that runs past the
    end of the bytes seen so far starts at one of those bytes within the last PHANTOM_MAX_LEN-1 bytes;
    everything before the first of them can go out now. Holding the whole window instead kept up to
    636 bytes of an ordinary body from the budget counter, so a stream cut for its budget left them
    unspent (and an interactive upload waited for them)."""
    scanner = PhantomBodyScanner()
    hold = PHANTOM_MAX_LEN - 1
    tail = b""
    cut = False

    def guard(chunk: bytes) -> object:
        nonlocal tail, cut
        if cut:
            return []
        final = chunk == b""
        if final:
            emit, tail = tail, b""
        else:
            hits = scanner.feed(chunk)
            if hits:
                cut = True
                on_hit(hits)
                return []
            data = tail + chunk
            found = _PHANTOM_START.search(data, max(0, len(data) - hold))
            start = found.start() if found is not None else len(data)
            emit, tail = data[:start], data[start:]
        out: list[bytes] = []
        if emit:
            out += as_chunks(inner(emit)) if inner is not None else [emit]
        if final and inner is not None:
            out += as_chunks(inner(b""))
        return out

    return guard


def scrub_chain(
    inner: StreamFn | None,
    codings: str | Iterable[str] | None,
    scrubber: Scrubber,
    max_output: int | None,
    on_error: Callable[[Exception], None],
) -> StreamFn:
    """Response-body callable: `inner` (the byte counter, sees what the upstream sent) → decode `codings`
    (a Content-Encoding value, or the names in the order applied: the upstream compressed despite
    `Accept-Encoding: identity`) → scrub with a sliding window. A
    decode error (corrupt data, decompression bomb) stops the stream and calls `on_error`, which
    kills the connection: the sandbox never receives bytes that were not inspected."""
    run = scrubbing_stream(codings, scrubber, max_output=max_output)
    dead = False

    def chain(chunk: bytes) -> object:
        nonlocal dead
        if dead:
            return []
        final = chunk == b""
        data = b"".join(as_chunks(inner(chunk))) if inner is not None else chunk
        try:
            out = run(data) if data else b""
            if final:
                out += run(b"")
        except DecodeError as exc:
            dead = True
            on_error(exc)
            return []
        return [out] if out else []

    return chain


def replace_body(body: bytes) -> StreamFn:
    """Swallow the upstream's body and emit `body` instead at the end (a refused response whose headers
    were already replaced: the upstream bytes could not be inspected, so none of them go out)."""
    done = False

    def swallow(chunk: bytes) -> object:
        nonlocal done
        if chunk == b"" and not done:
            done = True
            return [body]
        return []

    return swallow


def reframe(flow: http.HTTPFlow) -> None:
    """The scrubbed, decoded body has another length and no coding left: drop Content-Length and
    Content-Encoding (every coding was decoded, or was `identity`); an HTTP/1.1 client gets exactly
    `Transfer-Encoding: chunked` (never the upstream's `gzip, chunked`: the body is no longer gzip) so
    its connection stays reusable; HTTP/2 frames itself and HTTP/1.0 reads until close, so neither
    gets a Transfer-Encoding."""
    resp = flow.response
    assert resp is not None
    for name in ("content-encoding", "content-length", "transfer-encoding"):
        if name in resp.headers:
            del resp.headers[name]
    req = flow.request
    if not (req.is_http2 or req.is_http3) and req.http_version == "HTTP/1.1":
        resp.headers["transfer-encoding"] = "chunked"


def refusal_body(request_id: str, reason: str, message: str) -> bytes:
    """The 502 body of a refused upstream response: like a deny body, a stable reason and one sentence."""
    return json.dumps({"error": "upstream_response_refused", "reason": reason, "request_id": request_id,
                       "message": message}, separators=(",", ":")).encode()


def refuse(flow: http.HTTPFlow, request_id: str, reason: str, message: str, bodiless: bool = False) -> bytes:
    """Turn the upstream's response (headers not yet sent) into a 502 whose body we write: none of the
    upstream's bytes go out, since they could not be inspected; returns that body (compose.py streams it
    in place of the upstream's). `bodiless`: the exchange has no body (HEAD, 204, 304): the 502 then has
    none either, or the client would wait for it."""
    resp = flow.response
    assert resp is not None
    body = refusal_body(request_id, reason, message)
    resp.status_code = 502
    resp.reason = "Bad Gateway"
    resp.headers = http.Headers(content_type="application/json", cache_control="no-store",
                                content_length="0" if bodiless else str(len(body)))
    resp.headers[REQUEST_ID_HEADER] = request_id
    return b"" if bodiless else body


def fields(pairs: list[tuple[str, str]]) -> http.Headers:
    """mitmproxy decodes header bytes as utf-8 with surrogateescape; encode back losslessly."""
    enc = ("utf-8", "surrogateescape")
    return http.Headers([(k.encode(*enc), v.encode(*enc)) for k, v in pairs])
