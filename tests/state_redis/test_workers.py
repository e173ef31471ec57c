"""`egressgate run --workers 2` on a real Redis: one proxy port served by two worker processes that share
every sandbox; a worker killed with -9 is replaced while the other keeps serving, and its audit chain goes
on; a revocation handled by one worker closes a stream held by the other within a second."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.state_redis.workers_support import (
    get_fresh,
    holder,
    slots_with,
    start_workers,
)
from tests.support.gwworld import Gateway, World
from tests.support.launcher import EGRESSGATE
from tests.support.procs import alive, children
from tests.support.redis import RedisServer
from tests.support.replay_check import stop_and_replay
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def gw(world: World, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_workers(world, tmp_path_factory.mktemp("w12-gw"), redis_server)
    try:
        yield gateway
    finally:
        workers = children(gateway.proc.pid)
        stop_and_replay(gateway)
        for pid in workers:
            assert not alive(pid), f"worker {pid} outlived the supervisor"


def test_two_workers_serve_one_port(gw: Gateway):
    """A sandbox admitted through the admin port (whichever worker took it) is served on the one proxy
    port by both worker processes: its allowed requests are recorded in both workers' audit files, each
    file held open by a different worker pid."""
    pids = children(gw.proc.pid)
    assert len(pids) == 2
    sbx = gw.admit("gw-basic")
    mark = gw.world.hits.mark()

    def both_served() -> bool:
        for _ in range(10):
            assert get_fresh(sbx).status_code == 200
        return slots_with(gw.var, **{"egressgate.sandbox.id": sbx.id, "egressgate.decision": "allow"}) == {0, 1}

    assert wait_for(both_served, timeout=60, interval=0)
    assert len(gw.world.hits.since(mark)) >= 10  # every one reached the upstream
    files = {slot: holder(gw.var / f"audit.w{slot}.jsonl", pids) for slot in (0, 1)}
    assert set(files.values()) == pids, files  # each file written by its own worker, and both pids served


def test_a_killed_worker_is_replaced_while_the_other_serves(gw: Gateway):
    sup = gw.proc.pid
    pids = children(sup)
    victim = holder(gw.var / "audit.w0.jsonl", pids)
    assert victim is not None
    survivor = (pids - {victim}).pop()
    sbx = gw.admit("gw-basic")
    subprocess.run(["kill", "-9", str(victim)], check=True)
    # at once: every new connection is served (by the survivor; the kernel never queues one for the dead)
    statuses = [get_fresh(sbx).status_code for _ in range(20)]
    assert statuses == [200] * 20, statuses
    assert wait_for(lambda: len(children(sup) - {survivor}) == 1, timeout=30)
    replacement = (children(sup) - {survivor}).pop()
    assert replacement != victim and alive(survivor)
    assert wait_for(lambda: holder(gw.var / "audit.w0.jsonl", {replacement}) == replacement, timeout=30)
    # the replacement serves too (both slots again) and continues slot 0's chain from the killed worker's
    # last record: the file it left unsealed is sealed by a recovery checkpoint, no new chain is started
    sbx2 = gw.admit("gw-basic")

    def both_again() -> bool:
        for _ in range(10):
            assert get_fresh(sbx2).status_code == 200
        return slots_with(gw.var, **{"egressgate.sandbox.id": sbx2.id}) == {0, 1}

    assert wait_for(both_again, timeout=60, interval=0)
    files = sorted(str(p) for p in gw.var.glob("audit.w*.jsonl"))
    res = subprocess.run([EGRESSGATE, "audit", "verify", "--per-worker", "--allow-unsealed", "--public-key",
                          str(gw.var / "audit-signing.key.pub"), *files], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "new chain" not in res.stderr and "recovery checkpoint" in res.stderr, res.stderr
    assert slots_with(gw.var, **{"egressgate.incident": "crash_recovered"}) == {0}


def _hold_stream(gw: Gateway, sbx, key: str, outcome: dict) -> None:
    try:
        with sbx.client() as c, c.stream("GET", sbx.url("sse.test", "/sse"), params={"key": key}) as r:
            for line in r.iter_lines():
                if line == "data: first":
                    outcome["first"] = time.monotonic()
                elif line:
                    outcome.setdefault("lines", []).append(line)
        outcome["end"] = "eof"
    except httpx.HTTPError as exc:
        outcome["end"] = type(exc).__name__
    outcome["t"] = time.monotonic()


def test_revocation_by_one_worker_closes_streams_held_by_the_other(gw: Gateway):
    """Streams held open through both workers; DELETE on the admin port (one worker takes it): every
    stream is closed within a second, including one held by the other worker (checked from the audit
    files: the revocation's record and the stream's request record are in different workers' files)."""
    crossed = False
    for _ in range(6):
        sbx = gw.admit("gw-basic")
        keys = [uuid.uuid4().hex for _ in range(4)]
        outcomes: list[dict] = [{} for _ in keys]
        threads = [threading.Thread(target=_hold_stream, args=(gw, sbx, k, o), daemon=True)
                   for k, o in zip(keys, outcomes, strict=True)]
        for t in threads:
            t.start()
        try:
            assert wait_for(lambda o=outcomes: all("first" in x for x in o), timeout=10), outcomes
            revoked_at = time.monotonic()
            r = gw.revoke(sbx.id)
            assert r.status_code == 200 and r.json()["revoked"] is True
            for t in threads:
                t.join(5)
            assert not any(t.is_alive() for t in threads)
            for o in outcomes:
                assert o["t"] - revoked_at < 1.0, o  # not the upstream's 10 s hold
                assert "data: last" not in o.get("lines", [])
        finally:
            for k in keys:
                gw.world.release_sse(k)
        denied = get_fresh(sbx, scheme="http")
        assert denied.status_code == 407 and denied.json()["reason"] == "sandbox_revoked", denied.text
        time.sleep(0.5)  # records of the aborted streams are written on close
        streams = slots_with(gw.var, **{"egressgate.sandbox.id": sbx.id, "url.path": "/sse"})
        revokers = slots_with(gw.var, **{"egressgate.sandbox.id": sbx.id, "egressgate.operation": "revocation"})
        if revokers and streams - revokers:
            crossed = True
            break
    assert crossed, "no round had a stream on the worker that did not take the DELETE"
