"""request_hash.has_no_body: when the request hash is complete at the headers (table, real mitmproxy
requests). Its fast path reads raw bytes; the verdicts are those of mitmproxy's decoded accessors."""

from __future__ import annotations

import pytest
from mitmproxy import http

from egressgate.audit import reqhash
from egressgate.audit.reqhash import request_hash_raw
from egressgate.gateway.shared import request_hash
from egressgate.gateway.shared.context import FlowState
from egressgate.gateway.shared.request_hash import has_no_body


def _request(version: str, headers: list[tuple[bytes, bytes]]) -> http.Request:
    return http.Request(
        "api.test",
        80,
        b"POST",
        b"http",
        b"api.test",
        b"/",
        version.encode(),
        http.Headers(headers),
        b"",
        None,
        0.0,
        0.0,
    )


def _reference(request: http.Request) -> bool:
    """The rule spelled with mitmproxy's decoding accessors (what has_no_body must agree with)."""
    if request.http_version.startswith("HTTP/2") or request.http_version.startswith("HTTP/3"):
        return False
    if "transfer-encoding" in request.headers:
        return False
    return request.headers.get("content-length", "0").strip() == "0"


@pytest.mark.parametrize(
    ("version", "headers", "expected"),
    [
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
    ],
)
def test_has_no_body(version: str, headers: list[tuple[bytes, bytes]], expected: bool) -> None:
    request = _request(version, headers)
    assert has_no_body(request) is expected
    assert _reference(request) is expected


def _flow_state(**kw) -> FlowState:
    fs = FlowState(request_id="r1", started_ns=0)
    fs.method, fs.scheme, fs.host, fs.port, fs.path, fs.query = "GET", "http", "api.test", 80, "/a", "x=1"
    for k, v in kw.items():
        setattr(fs, k, v)
    return fs


def test_bodyless_hash_is_computed_once_and_is_the_outcome_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outcome record of a body-less request carries its decision record's hash (reused, not
    recomputed), and that hash is the one an auditor recomputes from what the sandbox sent, even when a
    later stage changes a header the hash covers: the fields are those seen at the headers."""
    request = http.Request(
        "api.test",
        80,
        b"GET",
        b"http",
        b"api.test",
        b"/a?x=1",
        b"HTTP/1.1",
        http.Headers([(b"Content-Type", b"text/plain")]),
        b"",
        None,
        0.0,
        0.0,
    )
    fs = _flow_state()
    decision_hash = fs.bodyless_hash = request_hash.bodyless_hash(request, fs)  # as record.py does
    expected = request_hash_raw("GET", "http://api.test/a?x=1", [("Content-Type", "text/plain")])
    assert decision_hash == expected
    request.headers["Content-Type"] = "application/json"  # a later stage rewrites it: not what was sent
    request_hash.start(request, fs)
    calls = []
    real = reqhash.request_hash
    monkeypatch.setattr(reqhash, "request_hash", lambda *a: calls.append(a) or real(*a))
    assert request_hash.finish(fs) == (expected, "sha256:" + reqhash.EMPTY_BODY_SHA256)
    assert calls == []  # the outcome record did not compute it again ...
    assert fs.hasher is not None and fs.hasher.request_hash() == expected  # ... and it is the same value
    assert len(calls) == 1  # (the counter sees a computation: the check above cannot pass by accident)
    # positive control: a request whose hash is not complete at the headers is hashed at the end, with
    # its body (and bytes fed to a hasher are never answered from the cache)
    post = http.Request(
        "api.test",
        80,
        b"POST",
        b"http",
        b"api.test",
        b"/a?x=1",
        b"HTTP/1.1",
        http.Headers([(b"Content-Length", b"2")]),
        b"hi",
        None,
        0.0,
        0.0,
    )
    fs2 = _flow_state(method="POST")
    assert request_hash.bodyless_hash(post, fs2) is None
    request_hash.start(post, fs2)
    request_hash.feed_buffered(post, fs2)
    assert request_hash.finish(fs2) == (
        request_hash_raw("POST", "http://api.test/a?x=1", body=b"hi"),
        "sha256:" + reqhash.body_sha256(b"hi"),
    )
    fs.hasher.update(b"late")
    assert request_hash.finish(fs)[0] != expected
