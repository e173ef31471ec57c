"""request_hash.has_no_body: when the request hash is complete at the headers (table, real mitmproxy
requests). Its fast path reads raw bytes; the verdicts are those of mitmproxy's decoded accessors."""

from __future__ import annotations

import pytest
from mitmproxy import http

from egressgate.gateway.shared.request_hash import has_no_body


def _request(version: str, headers: list[tuple[bytes, bytes]]) -> http.Request:
    return http.Request("api.test", 80, b"POST", b"http", b"api.test", b"/", version.encode(),
                        http.Headers(headers), b"", None, 0.0, 0.0)


def _reference(request: http.Request) -> bool:
    """The rule spelled with mitmproxy's decoding accessors (what has_no_body must agree with)."""
    if request.http_version.startswith("HTTP/2") or request.http_version.startswith("HTTP/3"):
        return False
    if "transfer-encoding" in request.headers:
        return False
    return request.headers.get("content-length", "0").strip() == "0"


@pytest.mark.parametrize(("version", "headers", "expected"), [
    ("HTTP/1.1", [], True),
    ("HTTP/1.1", [(b"Content-Length", b"0")], True),
    ("HTTP/1.1", [(b"content-length", b" 0 ")], True),
    ("HTTP/1.1", [(b"Content-Length", b"5")], False),
    ("HTTP/1.1", [(b"Transfer-Encoding", b"chunked")], False),
    ("HTTP/1.1", [(b"TRANSFER-ENCODING", b"identity"), (b"Content-Length", b"0")], False),
    ("HTTP/1.1", [(b"Content-Length", b"0"), (b"Content-Length", b"0")], False),  # "0, 0": not plainly 0
    ("HTTP/1.0", [(b"X-A", b"1")], True),
    ("HTTP/2.0", [], False),
    ("HTTP/3", [(b"content-length", b"0")], False),
])
def test_has_no_body(version: str, headers: list[tuple[bytes, bytes]], expected: bool) -> None:
    request = _request(version, headers)
    assert has_no_body(request) is expected
    assert _reference(request) is expected
