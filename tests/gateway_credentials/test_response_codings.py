"""response_codings.py on its own: the framings mitmproxy already rejects before any hook (so the
end-to-end tests cannot reach them) are refused here too, and the order of codings is the order the
client would undo them in."""

from __future__ import annotations

import gzip

import brotli
import pytest
from mitmproxy import http

from egressgate.broker.decompress import decoder
from egressgate.gateway.shared.response_codings import Uninspectable, body_codings, folded_headers


def response(*headers: tuple[str, str], version: str = "HTTP/1.1") -> http.Response:
    resp = http.Response.make(200)
    resp.headers = http.Headers([(k.encode(), v.encode()) for k, v in headers])
    resp.http_version = version
    return resp


@pytest.mark.parametrize(("headers", "expected"), [
    ((), []),
    ((("Transfer-Encoding", "chunked"),), []),
    ((("Transfer-Encoding", "GZip ,  Chunked"),), ["gzip"]),
    ((("Transfer-Encoding", "identity"),), []),
    ((("Content-Encoding", "br"), ("Transfer-Encoding", "gzip, chunked")), ["br", "gzip"]),
    ((("Content-Encoding", "gzip"), ("Content-Encoding", "identity, zstd"), ("Transfer-Encoding", "deflate")),
     ["gzip", "zstd", "deflate"]),
])
def test_codings_in_the_order_applied(headers, expected) -> None:
    assert body_codings(response(*headers)) == expected


@pytest.mark.parametrize(("headers", "version", "reason"), [
    ((("Transfer-Encoding", "gzip"),), "HTTP/2.0", "invalid_framing"),
    ((("Transfer-Encoding", "chunked"),), "HTTP/2.0", "invalid_framing"),
    ((("Transfer-Encoding", "chunked, gzip"),), "HTTP/1.1", "invalid_framing"),
    ((("Transfer-Encoding", "chunked"), ("Transfer-Encoding", "chunked")), "HTTP/1.1", "invalid_framing"),
    ((("Transfer-Encoding", "compress, chunked"),), "HTTP/1.1", "unsupported_coding"),
    ((("Transfer-Encoding", "gzip;level=9, chunked"),), "HTTP/1.1", "unsupported_coding"),
    ((("Content-Encoding", "gzip, gzip, gzip"), ("Transfer-Encoding", "gzip, gzip")), "HTTP/1.1",
     "unsupported_coding"),
])
def test_unreadable_framing_is_refused(headers, version, reason) -> None:
    with pytest.raises(Uninspectable) as exc:
        body_codings(response(*headers, version=version))
    assert exc.value.reason == reason and exc.value.message


def test_order_matches_what_the_upstream_applied() -> None:
    plain = b"the echo"
    body = gzip.compress(brotli.compress(plain))  # Content-Encoding br, then Transfer-Encoding gzip
    names = body_codings(response(("Content-Encoding", "br"), ("Transfer-Encoding", "gzip, chunked")))
    d = decoder(names)
    assert d(body) + d(b"") == plain


def test_folded_header_detected() -> None:
    assert not folded_headers(response(("X-A", "b c")))
    resp = response(("X-A", "b"))
    resp.headers.fields = ((b"X-A", b"half\r\n other"),)
    assert folded_headers(resp)
