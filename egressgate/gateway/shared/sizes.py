"""Sizes of a request as the decision judges them and Budgets prepays them, computed one way for both
(the decision's `request_bytes` fact and the prepayment must agree to the byte)."""

from __future__ import annotations

from mitmproxy import http


def request_head_size(request: http.Request) -> int:
    """Bytes of the request head as counted against budgets: the HTTP/1.1 serialization of what goes
    upstream (request line, headers after sanitizing — and, when Budgets prepays, after credential
    injection — blank line). Used for HTTP/2 too, so one request
    costs the same whatever the wire version (documented counting rule)."""
    target = request.path or "/"
    size = len(request.method) + 1 + len(target.encode()) + len(b" HTTP/1.1\r\n") + 2
    for name, value in request.headers.fields:
        size += len(name) + 2 + len(value) + 2
    return size


def declared_body_size(request: http.Request) -> int | None:
    """Content-Length when present and the body is not chunked (mitmproxy already rejected CL+TE)."""
    if "transfer-encoding" in request.headers:
        return None
    raw = request.headers.get("content-length")
    if raw is None:
        return 0 if not request.is_http2 and not request.is_http3 else None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None
