"""Fail closed on the audit trail: with the audit file on a genuinely full disk (a tiny tmpfs), every
decision is denied with `audit_unavailable` and nothing reaches the upstream; freeing space restores
service (positive control)."""

from __future__ import annotations

from tests.support.gwworld import start_gateway
from tests.support.launcher import stop_gateway
from tests.support.tmpfs import fill
from tests.support.waiting import wait_for


def test_full_audit_disk_denies_then_recovers(gateway, tiny_fs, tmp_path):
    world = gateway.world
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"path": str(tiny_fs / "audit.jsonl")}})
    try:
        sbx = gw.admit("gw-basic")
        with sbx.client() as c:
            first = c.get(sbx.url("api.test", "/echo"))
            assert first.status_code == 200
        # its outcome record is written behind the response (it may wait a moment for a batch to join):
        # let it land before the disk fills, so what fails below is the next decision, not that outcome
        rid = first.headers["x-egressgate-request-id"]
        audit = tiny_fs / "audit.jsonl"
        assert wait_for(lambda: audit.read_text().count(rid) >= 2, timeout=5)  # decision + outcome
        filler = fill(tiny_fs)
        mark = world.hits.mark()
        with sbx.client() as c:
            r = c.get(sbx.url("api.test", "/v1/after-full"))
        assert r.status_code == 403 and r.json()["reason"] == "audit_unavailable", r.text
        assert r.headers["x-egressgate-decision"] == "deny"
        assert world.hits.since(mark) == []
        filler.unlink()
        with sbx.client() as c:
            r = c.get(sbx.url("api.test", "/v1/after-free"))
        assert r.status_code == 200
        assert [h["path"] for h in world.hits.since(mark)] == ["/v1/after-free"]
    finally:
        stop_gateway(gw)
