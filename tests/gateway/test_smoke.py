"""Plumbing: allowed requests through HTTPS interception and plain HTTP, the deny contract."""

from __future__ import annotations


def test_allowed_get_through_mitm(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        r = c.get(sbx.url("api.test", "/echo?x=1"))
    assert r.status_code == 200, r.text
    assert r.json()["path"] == "/echo?x=1"
    seen = gateway.world.hits.since(mark)
    assert len(seen) == 1
    assert "proxy-authorization" not in seen[0]["headers"]
