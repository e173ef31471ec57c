"""Nothing flows back: an upstream that reflects the injected credential in every common encoding,
in headers and bodies, buffered or streamed in tiny chunks, compressed or not."""

from __future__ import annotations

import base64
import json
from urllib.parse import quote

import pytest

from tests.support.bao import KV_SECRET
from tests.support.credworld import Gateway, last


def leaked_forms(secret: str) -> list[str]:
    """Independent of egressgate's scrubber: what a leak would look like to the sandbox."""
    return [
        secret, quote(secret, safe=""), json.dumps(secret)[1:-1], secret.encode().hex(),
        base64.b64encode(secret.encode()).decode().rstrip("="),
        base64.urlsafe_b64encode(secret.encode()).decode().rstrip("="),
        base64.b64encode(f"x-access-token:{secret}".encode()).decode().rstrip("="),
        secret[: len(secret) // 2 + 4],  # a fragment cut at a chunk boundary
    ]


@pytest.mark.parametrize("mode", ["plain", "b64", "b64url", "url", "json", "jsonslash", "hex", "embedded",
                                  "chunks", "gzip", "gzip-chunks", "deflate-chunks"])
def test_body_reflection_scrubbed(cgw: Gateway, mode: str) -> None:
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", f"/reflect/{mode}"), headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    assert last(cgw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]  # it was there to reflect
    body = r.content.decode("latin-1")
    assert "[REDACTED]" in body, body[:300]
    for form in leaked_forms(KV_SECRET):
        assert form not in body, (mode, form)
    if "gzip" in mode or "deflate" in mode:
        assert "content-encoding" not in r.headers  # forwarded decoded, after inspection


def test_embedded_base64_also_for_basic_and_jwt(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("basic.test", "/reflect/basic"))
    assert r.status_code == 200 and "[REDACTED]" in r.text
    assert base64.b64encode(f"x-access-token:{KV_SECRET}".encode()).decode() not in r.text
    jwt_sbx = cgw.admit("cred-jwt")
    with cgw.client(jwt_sbx) as c:
        for mode in ("plain", "chunks", "gzip-chunks", "json"):
            r = c.get(cgw.url("jwt.test", f"/reflect/{mode}"))
            assert r.status_code == 200 and "[REDACTED]" in r.text, mode
            assert "eyJ" not in r.text, mode  # no JWT segment survives


def test_split_at_every_small_step(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        for step in (1, 2, 3, 5, 11, 64):
            r = c.get(cgw.url("api.test", f"/reflect/chunks?step={step}"))
            assert r.status_code == 200
            for form in leaked_forms(KV_SECRET):
                assert form not in r.text, (step, form)
            assert r.text.startswith("x" * 1000) and r.text.endswith("y" * 1000)  # the rest is intact


def test_header_reflection_scrubbed(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", "/reflect/headers"))
    assert r.status_code == 200
    for name in ("x-echo", "location", "set-cookie", "www-authenticate"):
        assert "[REDACTED]" in r.headers[name], name
    with cgw.client(sbx) as c:
        reason = c.get(cgw.url("api.test", "/reflect/reason"))
    assert reason.status_code == 200 and reason.reason_phrase == "OK [REDACTED]"
    raw = repr(list(r.headers.raw))
    for form in leaked_forms(KV_SECRET):
        assert form not in raw


def test_undecodable_encoding_refused(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", "/reflect/compress"))
    assert r.status_code == 502
    assert r.json()["error"] == "upstream_response_refused"
    assert KV_SECRET not in r.text


def test_head_and_keepalive_after_scrubbed_responses(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        for mode in ("chunks", "plain", "gzip-chunks", "plain"):  # one connection, reframed responses
            assert c.get(cgw.url("api.test", f"/reflect/{mode}")).status_code == 200
        assert c.head(cgw.url("api.test", "/echo")).status_code == 200
