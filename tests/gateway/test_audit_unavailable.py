"""Fail closed on the audit trail: with the audit file on a genuinely full disk (a tiny tmpfs), every
decision is denied with `audit_unavailable` and nothing reaches the upstream; freeing space restores
service (positive control)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .conftest import start_gateway, stop_gateway

IN_CI = os.environ.get("CI") == "true"


@pytest.fixture
def tiny_fs(tmp_path: Path):
    if os.geteuid() != 0 and not IN_CI:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "auditfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 1024)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_full_audit_disk_denies_then_recovers(gateway, tiny_fs, tmp_path):
    world = gateway.world
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"path": str(tiny_fs / "audit.jsonl")}})
    try:
        sbx = gw.admit("gw-basic")
        with sbx.client() as c:
            assert c.get(sbx.url("api.test", "/echo")).status_code == 200
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
