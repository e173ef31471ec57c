"""An approval widens a sandbox's allowlist, so it is recorded before it takes effect: with the audit file
on a genuinely full disk (a tiny tmpfs) approve answers 503 and the approval stays pending (the request
stays refused); freeing space lets the same approval through (positive control)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.approvals import harness
from tests.approvals.harness import admin, approve, http_get
from tests.support.gwworld import World
from tests.support.launcher import stop_gateway
from tests.support.tmpfs import fill, tiny_tmpfs
from tests.support.waiting import wait_for


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with tiny_tmpfs(tmp_path / "a12-auditfs", "128k") as mnt:
        yield mnt


def test_approve_is_refused_while_its_record_cannot_be_written(world: World, tiny_fs: Path, tmp_path: Path):
    gw = harness.start(world, tmp_path / "gw", {"audit": {"path": str(tiny_fs / "audit.jsonl")}})
    try:
        sbx = gw.admit("ap-gated")
        body = http_get(gw, sbx, "other.test", "/x").json()
        approval_id = body["approval_id"]
        audit = tiny_fs / "audit.jsonl"
        assert wait_for(lambda: audit.read_text().count(approval_id) >= 2, timeout=5)  # decision + requested
        filler = fill(tiny_fs)
        mark = world.hits.mark()
        res = approve(gw, approval_id, by="alice")
        assert res.status_code == 503 and res.json()["error"] == "audit_unavailable", res.text
        assert admin(gw, "GET", f"/v1/approvals/{approval_id}").json()["state"] == "pending"
        filler.unlink()
        assert http_get(gw, sbx, "other.test", "/x").json()["reason"] == "approval_required"
        assert world.hits.since(mark) == []
        granted = approve(gw, approval_id, by="alice")
        assert granted.status_code == 200 and granted.json()["state"] == "approved"
        assert http_get(gw, sbx, "other.test", "/x").status == 200
        assert [h["path"] for h in world.hits.since(mark)] == ["/x"]
        assert wait_for(lambda: '"approved"' in audit.read_text(), timeout=5)
    finally:
        stop_gateway(gw)
