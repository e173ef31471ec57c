"""Request hashes in the gateway's audit records equal what an auditor recomputes from the request the
sandbox sent (docs/audit.md), for body-less, buffered and streamed (chunked) requests."""

from __future__ import annotations

from egressgate.audit.reqhash import body_sha256, request_hash_raw
from tests.support.waiting import wait_for


def records_for(gateway, request_id: str) -> list[dict]:
    return [r for r in gateway.audit_records() if r.get("egressgate.request.id") == request_id]


def outcome(gateway, request_id: str) -> dict:
    assert wait_for(lambda: any(r.get("egressgate.operation") == "outcome" for r in records_for(gateway, request_id)))
    return next(r for r in records_for(gateway, request_id) if r.get("egressgate.operation") == "outcome")


def test_bodyless_request_hash_is_on_the_decision_record(gateway):
    sbx = gateway.admit("gw-basic")
    url = sbx.url("api.test", "/v1/./x/../items?b=2&a=%2f")
    with sbx.client() as c:
        r = c.get(url)
    assert r.status_code == 200, r.text
    rid = r.headers["x-egressgate-request-id"]
    decision = next(x for x in records_for(gateway, rid) if x.get("egressgate.operation") == "http_request")
    expected = request_hash_raw("GET", url)
    assert decision["egressgate.request.hash"] == expected
    assert outcome(gateway, rid)["egressgate.request.hash"] == expected
    # the proxy credential is not part of it: the same request hashed with it still matches
    assert request_hash_raw("GET", url, [("Proxy-Authorization", "Basic eA==")]) == expected


def test_buffered_and_streamed_bodies(gateway):
    sbx = gateway.admit("gw-basic")
    url = sbx.url("api.test", "/upload")
    small = b'{"invoice": 42}'
    with sbx.client() as c:
        r = c.post(url, content=small, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        rec = outcome(gateway, r.headers["x-egressgate-request-id"])
        assert rec["egressgate.request.hash"] == request_hash_raw(
            "POST", url, [("Content-Type", "application/json")], small)
        assert rec["egressgate.body.hash"] == "sha256:" + body_sha256(small)

        parts = [b"a" * 70_000, b"b" * 1000, b"c"]  # chunked, no Content-Length: streamed by the gateway
        r = c.post(url, content=iter(parts), headers={"Content-Type": "text/plain"})
        assert r.status_code == 200, r.text
        rec = outcome(gateway, r.headers["x-egressgate-request-id"])
        body = b"".join(parts)
        assert rec["egressgate.request.hash"] == request_hash_raw("POST", url, [("Content-Type", "text/plain")], body)
        assert rec["egressgate.body.hash"] == "sha256:" + body_sha256(body)
        # a different body gives a different hash (the check above cannot pass by accident)
        assert rec["egressgate.request.hash"] != request_hash_raw("POST", url, [("Content-Type", "text/plain")], b"")
