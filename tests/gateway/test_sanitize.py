"""sanitize.strip_hop_by_hop: its one-pass fast path must strip exactly what the rule (spelled with
mitmproxy's Headers accessors below) strips: proxy credentials, hop-by-hop headers, headers named in
Connection, an Upgrade that is not a websocket upgrade; Connection keeps only close / a websocket upgrade."""

from __future__ import annotations

import pytest
from mitmproxy import http

from egressgate.gateway.sanitize import strip_hop_by_hop

ALWAYS = ("proxy-authorization", "proxy-connection", "proxy-authenticate", "keep-alive", "te", "trailer")


def reference(request: http.Request) -> None:
    headers = request.headers
    named: list[str] = []
    for value in headers.get_all("connection"):
        named.extend(tok.strip().lower() for tok in value.split(",") if tok.strip())
    for name in ALWAYS:
        if name in headers:
            del headers[name]
    websocket = headers.get("upgrade", "").strip().lower() == "websocket" and "upgrade" in named
    if not websocket and "upgrade" in headers:
        del headers["upgrade"]
    for name in named:
        if name in ("close", "upgrade") or name in ("host", "content-length", "transfer-encoding"):
            continue
        if name in headers:
            del headers[name]
    if "connection" in headers:
        kept = [tok for tok in named if tok == "close" or (tok == "upgrade" and websocket)]
        if kept:
            headers["connection"] = ", ".join(dict.fromkeys(kept))
        else:
            del headers["connection"]


def _request(headers: list[tuple[bytes, bytes]]) -> http.Request:
    return http.Request("api.test", 80, b"GET", b"http", b"api.test", b"/", b"HTTP/1.1",
                        http.Headers(headers), b"", None, 0.0, 0.0)


CASES = [
    [(b"Host", b"api.test"), (b"Accept", b"*/*")],
    [(b"Host", b"api.test"), (b"Proxy-Authorization", b"Basic abc"), (b"Proxy-Connection", b"keep-alive")],
    [(b"Host", b"a"), (b"Connection", b"keep-alive, X-Secret"), (b"X-Secret", b"1"), (b"x-secret", b"2"),
     (b"Keep-Alive", b"timeout=5"), (b"TE", b"trailers"), (b"Trailer", b"X")],
    [(b"Host", b"a"), (b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"), (b"Sec-WebSocket-Key", b"k")],
    [(b"Host", b"a"), (b"Connection", b"upgrade"), (b"Upgrade", b"h2c"), (b"HTTP2-Settings", b"AAA")],
    [(b"Host", b"a"), (b"Upgrade", b"websocket")],  # no Connection: upgrade -> not a websocket upgrade
    [(b"Host", b"a"), (b"Connection", b"close, Host, Content-Length, Transfer-Encoding"),
     (b"Content-Length", b"3")],
    [(b"Connection", b"close"), (b"Host", b"a"), (b"connection", b"upgrade, close"), (b"Upgrade", b"WebSocket")],
    [(b"Host", b"a"), (b"Connection", b" , ,"), (b"X-A", b"1")],
    [(b"Host", b"a"), (b"Connection", b"x-a"), (b"Connection", b"x-b"), (b"X-A", b"1"), (b"X-B", b"2"), (b"X-C", b"3")],
    [(b"Host", b"a"), (b"Upgrade", b"websocket"), (b"Upgrade", b"h2c"), (b"Connection", b"upgrade")],
]


@pytest.mark.parametrize("headers", CASES)
def test_strips_what_the_rule_strips(headers: list[tuple[bytes, bytes]]) -> None:
    fast, slow = _request(headers), _request(headers)
    strip_hop_by_hop(fast)
    reference(slow)
    assert [(k.lower(), v) for k, v in fast.headers.fields] == [(k.lower(), v) for k, v in slow.headers.fields]


def test_nothing_hop_by_hop_is_left() -> None:
    request = _request(CASES[2] + [(b"Proxy-Authorization", b"Basic dG9rZW4=")])
    strip_hop_by_hop(request)
    names = {k.lower() for k, _ in request.headers.fields}
    assert names == {b"host"}
