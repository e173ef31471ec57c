"""sanitize.strip_hop_by_hop: its one-pass fast path must strip exactly what the rule (spelled with
mitmproxy's Headers accessors below) strips: proxy credentials, hop-by-hop headers, headers named in
Connection, an Upgrade that is not a websocket upgrade; Connection keeps only close / a websocket upgrade.
te: on HTTP/2, te fields that together say exactly `trailers` become one `te: trailers` (gRPC needs it);
everything else about te is stripped. `te_for_upstream` applies the rule for the version the upstream
speaks (mitmproxy may translate): HTTP/1 upstreams get no te, HTTP/2 upstreams only `te: trailers`."""

from __future__ import annotations

import pytest
from mitmproxy import http
from mitmproxy.proxy.layers.http._events import RequestHeaders

from egressgate.gateway.layers.hop_by_hop import only_trailers, strip_hop_by_hop, te_for_upstream

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


def _request(headers: list[tuple[bytes, bytes]], version: bytes = b"HTTP/1.1") -> http.Request:
    return http.Request("api.test", 80, b"GET", b"http", b"api.test", b"/", version,
                        http.Headers(headers), b"", None, 0.0, 0.0)


def expected_te(headers: list[tuple[bytes, bytes]], version: bytes) -> list[tuple[bytes, bytes]]:
    """The te rule, spelled out: one `te: trailers` on HTTP/2 when the te values, as one list, are
    only the token `trailers` and Connection does not name te; nothing otherwise."""
    named = [t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")]
    tokens = [t.strip(b" \t").lower() for k, v in headers if k.lower() == b"te" for t in v.split(b",")]
    tokens = [t for t in tokens if t]
    keep = version == b"HTTP/2.0" and b"te" not in named and tokens and set(tokens) == {b"trailers"}
    return [(b"te", b"trailers")] if keep else []


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


TE_CASES = [
    [(b"te", b"trailers")],
    [(b"te", b"TRAILERS")],
    [(b"te", b" trailers\t")],
    [(b"te", b"trailers"), (b"TE", b"Trailers")],
    [(b"te", b"trailers, ,")],
    [(b"te", b"trailers, gzip")],
    [(b"te", b"trailers"), (b"te", b"deflate")],
    [(b"te", b"gzip")],
    [(b"te", b"trailers;q=1")],
    [(b"te", b"")],
    [(b"te", b"trailers"), (b"connection", b"te")],
]


@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/2.0"])
@pytest.mark.parametrize("headers", CASES + [[(b"host", b"a"), *c, (b"x-after", b"1")] for c in TE_CASES])
def test_strips_what_the_rule_strips(headers: list[tuple[bytes, bytes]], version: bytes) -> None:
    fast, slow = _request(headers, version), _request(headers, version)
    strip_hop_by_hop(fast)
    reference(slow)
    assert [(k.lower(), v) for k, v in fast.headers.fields if k.lower() != b"te"] == \
        [(k.lower(), v) for k, v in slow.headers.fields]
    assert [(k, v) for k, v in fast.headers.fields if k.lower() == b"te"] == expected_te(headers, version)


def test_te_trailers_stays_where_it_was() -> None:
    request = _request([(b"host", b"a"), (b"te", b"Trailers"), (b"x-a", b"1"), (b"te", b"trailers")], b"HTTP/2.0")
    strip_hop_by_hop(request)
    assert request.headers.fields == ((b"host", b"a"), (b"te", b"trailers"), (b"x-a", b"1"))


def test_only_trailers() -> None:
    assert only_trailers([b"trailers"]) and only_trailers([b"TRAILERS ", b", trailers"])
    for values in ([], [b""], [b"trailers, gzip"], [b"trailers;q=1"], [b"trailers", b"chunked"]):
        assert not only_trailers(values), values


def _headers_event(headers: list[tuple[bytes, bytes]], version: bytes) -> RequestHeaders:
    return RequestHeaders(1, _request(headers, version), end_stream=True)


@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/2.0"])
@pytest.mark.parametrize("headers", TE_CASES)
def test_upstream_hop_decides_te(headers: list[tuple[bytes, bytes]], version: bytes) -> None:
    """Whatever the client's version (mitmproxy translates), an HTTP/1 upstream gets no te and an HTTP/2
    upstream at most one `te: trailers`; the flow's own request is never changed."""
    event = _headers_event([(b"host", b"a"), *headers], version)
    original = event.request.headers.fields
    to_h1 = te_for_upstream(event, http2=False)
    to_h2 = te_for_upstream(event, http2=True)
    assert event.request.headers.fields == original
    assert [f for f in to_h1.request.headers.fields if f[0].lower() == b"te"] == []
    te_h2 = [f for f in to_h2.request.headers.fields if f[0].lower() == b"te"]
    assert te_h2 in ([], [(b"te", b"trailers")])
    assert (te_h2 != []) == only_trailers([v for k, v in headers if k.lower() == b"te"])
    for sent in (to_h1, to_h2):
        assert [f for f in sent.request.headers.fields if f[0].lower() != b"te"] == [(b"host", b"a")] + \
            [f for f in headers if f[0].lower() not in (b"te",)]
        assert sent.stream_id == 1 and sent.end_stream


def test_upstream_hop_leaves_a_clean_request_alone() -> None:
    event = _headers_event([(b"host", b"a"), (b"te", b"trailers")], b"HTTP/2.0")
    assert te_for_upstream(event, http2=True) is event
    plain = _headers_event([(b"host", b"a")], b"HTTP/1.1")
    assert te_for_upstream(plain, http2=False) is plain


def test_nothing_hop_by_hop_is_left() -> None:
    request = _request(CASES[2] + [(b"Proxy-Authorization", b"Basic dG9rZW4=")])
    strip_hop_by_hop(request)
    names = {k.lower() for k, _ in request.headers.fields}
    assert names == {b"host"}
