"""gateway/mcp_headers.HeaderView answers the route's header questions exactly as mitmproxy's `Headers`
would (the oracle here), for hostile spellings too: case, repeated fields, non-UTF-8 bytes."""

from __future__ import annotations

import pytest
from mitmproxy import http

from egressgate.gateway.mcp.headers import WANTED, HeaderView
from egressgate.gateway.mcp.route import body_problem

FIELDS = [
    [(b"Content-Length", b"12"), (b"Content-Type", b"application/json; charset=utf-8")],
    [(b"content-length", b"12"), (b"CONTENT-LENGTH", b"12")],  # repeated: folded "12, 12", not a number
    [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"12")],
    [(b"Content-Encoding", b"identity"), (b"content-encoding", b" GZip "), (b"Content-Length", b"3")],
    [(b"Mcp-Session-Id", b"s\xff1"), (b"UpGrade", b"h2c"), (b"Content-Length", b"5")],
    [(b"Content-Length", b"")],
    [],
]


@pytest.mark.parametrize("fields", FIELDS)
def test_the_view_says_what_mitmproxy_headers_say(fields: list[tuple[bytes, bytes]]) -> None:
    request = http.Request.make("POST", "https://mcp.test/mcp", b"", {})
    request.headers = http.Headers(fields)
    view = HeaderView(request)
    for name in WANTED:
        text = name.decode()
        assert (name in view) == (text in request.headers)
        assert view.get(name) == request.headers.get(text)
        assert view.get_all(name) == request.headers.get_all(text)
    assert view.content_type() == request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def test_body_problems_from_the_view() -> None:
    """Positive control first: a single declared length passes; then each refusal keeps its detail."""
    def problem(*fields: tuple[bytes, bytes]) -> str | None:
        request = http.Request.make("POST", "https://mcp.test/mcp", b"", {})
        request.headers = http.Headers(list(fields))
        found = body_problem(HeaderView(request), 100)
        return found[0] if found else None

    assert problem((b"Content-Length", b"12")) is None
    assert problem((b"content-length", b"12"), (b"Content-Length", b"12")) == "unknown_length"
    assert problem((b"Transfer-Encoding", b"chunked")) == "unknown_length"
    assert problem((b"Content-Length", b"101")) == "oversized"
    assert problem((b"Content-Encoding", b"gzip"), (b"Content-Length", b"12")) == "content_encoding"
    assert problem((b"Content-Encoding", b"identity"), (b"Content-Length", b"12")) is None
