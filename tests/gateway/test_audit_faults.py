"""Faults of the audit trail, done for real to a running `egressgate run` under traffic: the gateway
process SIGKILLed and started again, the audit file unlinked, the audit file renamed (`mv`), and the write
of an outcome record failing on a genuinely full tmpfs. After each, `egressgate audit verify` over the
whole history passes and no record is missing; a positive control shows verify still catches a record
removed from the same files."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from egressgate.audit.find import iter_records
from egressgate.audit.reqhash import canonical_fields, request_hash
from tests.support import cli
from tests.support.gwworld import start_gateway
from tests.support.launcher import EGRESSGATE, stop_gateway
from tests.support.replicas import hold_sse
from tests.support.tmpfs import fill

REQUEST_ID = "x-egressgate-request-id"


def history(live: Path) -> list[Path]:
    rotated = sorted(p for p in live.parent.iterdir()
                     if p.name.startswith("audit.") and p.suffix == ".jsonl" and p != live)
    return [*rotated, live]


def verify(files: list[Path], key: Path) -> subprocess.CompletedProcess:
    return cli.run([EGRESSGATE, "audit", "verify", "--public-key", str(key), *map(str, files)], timeout=60)


def records(files: list[Path], op: str) -> dict[str, dict]:
    return {str(f.record.attributes["egressgate.request.id"]): f.record.attributes
            for f in iter_records(files) if f.record.attributes.get("egressgate.operation") == op}


def healthz(gw) -> dict:
    return httpx.get(f"http://{gw.admin}/healthz", trust_env=False, timeout=5).json()


def wait(cond, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def get_ids(sbx, n: int, tag: str) -> list[str]:
    out = []
    with sbx.client() as c:
        for i in range(n):
            r = c.get(sbx.url("api.test", f"/v1/{tag}/{i}"))
            assert r.status_code == 200, r.text
            out.append(r.headers[REQUEST_ID])
    return out


def remove_a_record(files: list[Path], target: Path, tmp: Path) -> list[Path]:
    """Positive control: copies of the files with one http_request line removed from `target`."""
    out = tmp / f"tampered-{uuid.uuid4().hex[:6]}"
    out.mkdir()
    copies = [Path(shutil.copy(f, out / f.name)) for f in files]
    victim = out / target.name
    lines = victim.read_bytes().splitlines(keepends=True)
    idx = next(i for i, ln in enumerate(lines) if b'"stringValue":"http_request"' in ln)
    del lines[idx]
    victim.write_bytes(b"".join(lines))
    return copies


def test_kill9_then_restart_verifies_across_the_crash(world, tmp_path):
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"checkpoint_every": 4}})
    try:
        before = get_ids(gw.admit("gw-basic"), 6, "before")
    finally:
        gw.proc.kill()  # SIGKILL: no final checkpoint
        gw.proc.wait(10)
    live, key = gw.var / "audit.jsonl", gw.var / "audit-signing.key.pub"
    crashed = verify([live], key)
    assert crashed.returncode == 1 and "no final checkpoint" in crashed.stdout, crashed.stdout  # control
    gw2 = start_gateway(world, tmp_path / "gw", {"audit": {"checkpoint_every": 4}})
    try:
        after = get_ids(gw2.admit("gw-basic"), 3, "after")
        health = healthz(gw2)
    finally:
        assert stop_gateway(gw2) == 0
    files = history(live)
    assert len(files) == 2
    res = verify(files, key)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "recovery checkpoint" in res.stderr and "FAIL" not in res.stdout
    assert set(before + after) <= set(records(files, "http_request"))
    assert health["status"] == "alert" and health["audit_status"]["incidents"][0]["incident"] == "crash_recovered"
    # positive control: the same history with one record removed from the crashed file fails
    res = verify(remove_a_record(files, files[0], tmp_path), key)
    assert res.returncode == 1 and "records removed" in res.stdout, res.stdout


def test_kill9_verify_names_every_decision_left_without_outcome(world, tmp_path):
    """Issue 23, item 4: SIGKILL while a response streams (its decision is durable, its outcome can only
    come when it ends) right after completed requests: after the restart, `audit verify` names exactly the
    allowed decisions of the crashed run that have no outcome — computed here independently from the
    records — as a recovered gap, the streaming request among them and no request whose outcome exists."""
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"checkpoint_every": 4}})
    key = f"gap-{uuid.uuid4().hex[:8]}"
    try:
        sbx = gw.admit("gw-basic")
        done = get_ids(sbx, 5, "gap")
        held = hold_sse(sbx, key)
        assert held.wait_first(30), held.outcome
    finally:
        gw.proc.kill()
        gw.proc.wait(10)
        world.release_sse(key)
    gw2 = start_gateway(world, tmp_path / "gw", {"audit": {"checkpoint_every": 4}})
    assert stop_gateway(gw2) == 0
    live, pub = gw.var / "audit.jsonl", gw.var / "audit-signing.key.pub"
    files = history(live)
    res = verify(files, pub)
    assert res.returncode == 0, res.stdout + res.stderr
    crashed = [f.record.attributes for f in iter_records([files[0]])]
    outcomes = set(records(files, "outcome"))
    expected = [str(a["egressgate.request.id"]) for a in crashed if a.get("egressgate.operation") == "http_request"
                and a.get("egressgate.decision") == "allow" and a["egressgate.request.id"] not in outcomes]
    streaming = next(str(a["egressgate.request.id"]) for a in crashed if a.get("url.path") == "/sse")
    assert streaming in expected and not set(done) & set(expected)
    (gap,) = [line for line in res.stderr.splitlines() if "recovered gap" in line]
    assert f": {len(expected)} allowed decision(s)" in gap and gap.endswith(", ".join(expected)), gap


def test_audit_file_deleted_under_traffic(world, tmp_path):
    gw = start_gateway(world, tmp_path / "gw")
    live, key = gw.var / "audit.jsonl", gw.var / "audit-signing.key.pub"
    try:
        sbx = gw.admit("gw-basic")
        sent = get_ids(sbx, 3, "a")
        os.unlink(live)
        sent += get_ids(sbx, 3, "b")
        wait(live.exists)  # a new file, chained from the last record
        sent += get_ids(sbx, 2, "c")
        h = healthz(gw)
    finally:
        assert stop_gateway(gw) == 0
    assert h["status"] == "alert" and h["audit_status"]["incidents"][0]["incident"] == "file_deleted", h
    files = history(live)
    res = verify(files, key)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "file_deleted" in res.stderr
    assert set(sent) <= set(records(files, "http_request"))  # nothing lost, the deleted part included
    res = verify(remove_a_record(files, files[0], tmp_path), key)
    assert res.returncode == 1, res.stdout


def test_outside_rotation_mv_under_traffic(world, tmp_path):
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"checkpoint_every": 5}})
    live, key = gw.var / "audit.jsonl", gw.var / "audit-signing.key.pub"
    moved = gw.var / "audit.by-operator.jsonl"
    sent: list[str] = []
    try:
        sbx = gw.admit("gw-basic")
        sent += get_ids(sbx, 4, "a")
        worker = threading.Thread(target=lambda: sent.extend(get_ids(sbx, 20, "during")))
        worker.start()
        time.sleep(0.1)
        os.rename(live, moved)  # `mv audit.jsonl ...` while requests flow
        worker.join(60)
        wait(live.exists)
        sent += get_ids(sbx, 3, "c")
    finally:
        assert stop_gateway(gw) == 0
    files = [moved, live]
    res = verify(files, key)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "file_moved" in res.stderr
    first = next(iter_records([live])).record.attributes
    assert first["egressgate.operation"] == "chain_start" and first["egressgate.chain.prev_file"] == moved.name
    assert len(sent) == 27 and set(sent) <= set(records(files, "http_request"))
    res = verify(remove_a_record(files, moved, tmp_path), key)
    assert res.returncode == 1, res.stdout


BODY_TYPE = [("Content-Type", "application/octet-stream")]


def exhaust(gw, sbx) -> None:
    """After `fill`, the audit file's last tmpfs page still has room for a record or two. Use it up with
    real audited requests until even the sink's own probe checkpoint (1.4 KB, smaller than an outcome or a
    padded revocation record) no longer fits: from then on those writes fail for certain."""
    for _ in range(50):
        with sbx.client() as c:  # a new tunnel each time: its CONNECT is audited too
            try:
                r = c.get(sbx.url("api.test", "/v1/exhaust"))
                failed = r.status_code == 403 and r.json()["reason"] == "audit_unavailable"
            except httpx.ProxyError as exc:  # the CONNECT itself was refused
                failed = "403" in str(exc)
            if failed:
                time.sleep(1.6)  # the sink probes the disk every second with a checkpoint
                if httpx.get(f"http://{gw.admin}/healthz", trust_env=False, timeout=5).status_code == 503:
                    return
    raise AssertionError("the audit disk did not fill up")


def post_then_fill(gw, mnt: Path, tmp_path: Path) -> tuple[str, str, bytes, Path]:
    """A streamed POST whose decision record is written; then the audit disk fills up; then the body ends,
    the response comes back and the outcome write fails. Returns (request id, url, body, filler)."""
    live = mnt / "audit.jsonl"
    release = threading.Event()
    first_part, rest = b"a" * 1000, b"b" * 3000

    def body():
        yield first_part
        release.wait(20)
        yield rest

    result: dict = {}
    sbx, exhauster = gw.admit("gw-basic"), gw.admit("gw-basic")
    url = sbx.url("api.test", "/upload")

    def post():
        with sbx.client() as c:
            result["r"] = c.post(url, content=body(), headers=dict(BODY_TYPE))

    t = threading.Thread(target=post)
    t.start()
    wait(lambda: b'"/upload"' in live.read_bytes())  # the decision is durable before anything goes upstream
    filler = fill(mnt)
    exhaust(gw, exhauster)
    release.set()
    t.join(30)
    r = result["r"]
    assert r.status_code == 200, r.text
    rid = r.headers[REQUEST_ID]
    log = tmp_path / "gw" / "gateway.stderr"
    wait(lambda: f"audit record of request {rid}" in log.read_text())  # the log names it
    assert "queued for retry" in log.read_text()
    return rid, url, first_part + rest, filler


def test_outcome_write_failure_is_retried_not_lost(world, tiny_fs, tmp_path):
    """The outcome record (written after the response) is the only place a streamed body's request hash
    lives. Its write fails on a full disk: it must be retried, logged with the request id, and written."""
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"path": str(tiny_fs / "audit.jsonl")}})
    live = tiny_fs / "audit.jsonl"
    try:
        rid, url, body, filler = post_then_fill(gw, tiny_fs, tmp_path)
        during = httpx.get(f"http://{gw.admin}/healthz", trust_env=False, timeout=5)
        filler.unlink()
        wait(lambda: rid in records([live], "outcome"))  # retried once the disk has room again
        wait(lambda: healthz(gw)["status"] == "ok")
    finally:
        assert stop_gateway(gw) == 0
    outcome = records([live], "outcome")[rid]
    assert outcome["egressgate.request.hash"] == request_hash(*canonical_fields("POST", url, BODY_TYPE, body))
    assert outcome["http.response.status_code"] in (200, "200")
    res = verify([live], gw.var / "audit-signing.key.pub")
    assert res.returncode == 0, res.stdout + res.stderr
    assert during.status_code == 503 and during.json()["audit_status"]["pending_records"] >= 1  # /healthz said so


def test_queued_outcome_survives_kill9(world, tiny_fs, tmp_path):
    """The queue has a copy on disk (the retry spool, in var_dir, not on the full audit volume): a gateway
    SIGKILLed while an outcome waits writes it after the restart."""
    extra = {"audit": {"path": str(tiny_fs / "audit.jsonl")}}
    gw = start_gateway(world, tmp_path / "gw", extra)
    live = tiny_fs / "audit.jsonl"
    try:
        rid, url, body, filler = post_then_fill(gw, tiny_fs, tmp_path)
    finally:
        gw.proc.kill()
        gw.proc.wait(10)
    assert rid not in records([live], "outcome")
    assert rid in (gw.var / "audit-retry.jsonl").read_text()
    filler.unlink()
    gw2 = start_gateway(world, tmp_path / "gw", extra)
    try:
        wait(lambda: rid in records(history(live), "outcome"))
    finally:
        assert stop_gateway(gw2) == 0
    files = history(live)
    outcome = records(files, "outcome")[rid]
    assert outcome["egressgate.request.hash"] == request_hash(*canonical_fields("POST", url, BODY_TYPE, body))
    res = verify(files, gw.var / "audit-signing.key.pub")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (gw.var / "audit-retry.jsonl").read_bytes() == b""  # emptied once written


def test_revocation_on_a_full_disk_is_recorded_later(world, tiny_fs, tmp_path):
    """Sibling of the outcome: a revocation takes effect even when its record cannot be written (fail
    closed), so its record is queued and retried, not dropped."""
    gw = start_gateway(world, tmp_path / "gw", {"audit": {"path": str(tiny_fs / "audit.jsonl")}})
    live = tiny_fs / "audit.jsonl"
    try:
        sbx = gw.admit("gw-basic", labels={"pad": "x" * 800})  # its revocation record is > 1.4 KB
        exhauster = gw.admit("gw-basic")
        filler = fill(tiny_fs)
        exhaust(gw, exhauster)
        r = gw.revoke(sbx.id)
        assert r.status_code == 200 and r.json()["revoked"], r.text
        with sbx.client() as c, pytest.raises(httpx.ProxyError, match="407"):  # revoked, not yet audited
            c.get(sbx.url("api.test", "/echo"))
        filler.unlink()
        wait(lambda: any(a.get("egressgate.sandbox.id") == sbx.id for a in records([live], "revocation").values()))
    finally:
        assert stop_gateway(gw) == 0
