"""What a request costs in Redis round trips, and what happens when Redis dies between them (issue 25).

A real `egressgate run` on a real redis-server, watched with Redis's own MONITOR (every command any
client sends, in the order Redis ran it; commands a Lua script runs show up as `lua` and are not round
trips). The gateway runs through roundtrip_launcher.py, whose only changes are time-driven: the ledger's
sweep and the reconcile rounds (at most one write a second each, whatever the request rate) are
quieted, so every command seen between two marks was caused by the requests in between. Nothing is
pipelined on that path, so commands are an upper bound of round trips.

An allowed request of known size costs two: the snapshot decide() reads, and `reserve_request` (its
bytes, its rule's budget and its history in one script; the bytes received by the request before it
ride along). Before issue 25 it cost four (snapshot, reserve_out, record_request, HINCRBY of the bytes
in): the same test counted 4.0 per request on that code.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from egressgate.approvals import redis_store as approvals_redis
from egressgate.state import lua
from tests.support.gwworld import Gateway, World, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer
from tests.support.redis_monitor import Monitor
from tests.support.waiting import wait_for

LAUNCHER = Path(__file__).with_name("roundtrip_launcher.py")
REQUESTS = 20
# time-driven commands of a running gateway, not of a request: the subscription's liveness PING (every
# second), the worker's heartbeat SET (every third of its TTL) and the approvals sweeper's expiry script
# (every 0.5 s: approvals/sweeper.py)
BACKGROUND = {"PING", "SET", "APPROVALS_EXPIRE"}


def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


SCRIPTS = {sha(getattr(lua, n)): n for n in dir(lua) if n.isupper() and isinstance(getattr(lua, n), str)}
SCRIPTS[sha(approvals_redis._EXPIRE)] = "APPROVALS_EXPIRE"


def name(words: list[str]) -> str:
    """A command's name; a script's (state/lua.py) for EVALSHA."""
    return SCRIPTS.get(words[1], words[1]) if words[0].upper() == "EVALSHA" and len(words) > 1 else words[0].upper()


def describe(commands: list[tuple[str, list[str]]]) -> Counter:
    return Counter(name(words) for _, words in commands)


@pytest.fixture(scope="module")
def gw(world: World, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("rt-gw")
    pause = tmp / "pause"
    pause.mkdir()
    state = {"backend": "redis", "url": redis_server.url, "key_prefix": redis_server.prefix()}
    gateway = start_gateway(world, tmp, {"state": state}, launcher=[sys.executable, str(LAUNCHER), str(pause)])
    gateway.pause_dir = pause  # type: ignore[attr-defined]
    try:
        yield gateway
    finally:
        stop_gateway(gateway)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_allowed_request_costs_at_most_two_round_trips(gw: Gateway, redis_server: RedisServer, scheme: str):
    sbx = gw.admit("gw-basic")
    monitor = Monitor(redis_server.port)
    try:
        mark = gw.world.hits.mark()
        with sbx.client() as client:
            assert client.get(sbx.url("api.test", "/echo", scheme=scheme)).status_code == 200  # warm: cache, tunnel
            start = monitor.mark()
            for i in range(REQUESTS):
                r = client.get(sbx.url("api.test", f"/v1/rt-{i}", scheme=scheme))
                assert r.status_code == 200, r.text
            end = monitor.mark()
        assert len(gw.world.hits.since(mark)) == REQUESTS + 1  # every request reached the upstream
        commands = [
            (client, words)
            for client, words in monitor.between(start, end)
            if client != "lua" and name(words) not in BACKGROUND
        ]
    finally:
        monitor.close()
    seen = describe(commands)
    # positive control: the counter sees the gateway's commands, one snapshot per request
    assert seen["SNAPSHOT"] == REQUESTS, seen
    assert seen["RESERVE_REQUEST"] == REQUESTS, seen
    assert len(commands) <= 2 * REQUESTS, f"{len(commands) / REQUESTS:.2f} round trips per request: {seen}"


def test_redis_dying_between_the_two_round_trips_denies_and_records(world: World, tmp_path: Path):
    """The snapshot was read (decide() allowed the request); Redis stops before `reserve_request`: the
    request is refused `state_unavailable` before a byte goes upstream, and its refusal is its decision
    record. Positive control: the same paused request completes when Redis stays up."""
    pause = tmp_path / "pause"
    pause.mkdir()
    with RedisServer(tmp_path / "redis") as server:
        state = {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}
        gw = start_gateway(
            world, tmp_path / "gw", {"state": state}, launcher=[sys.executable, str(LAUNCHER), str(pause)]
        )
        try:
            sbx = gw.admit("gw-basic", {"pause": "1"})
            for attempt, stop_redis in enumerate([False, True]):
                (pause / f"go-{sbx.id}").unlink(missing_ok=True)
                (pause / f"paused-{sbx.id}").unlink(missing_ok=True)
                mark = world.hits.mark()
                with sbx.client() as client, ThreadPoolExecutor(1) as pool:
                    url = sbx.url("api.test", f"/v1/die-{attempt}", scheme="http")
                    future = pool.submit(client.get, url)
                    assert wait_for(lambda: (pause / f"paused-{sbx.id}").exists(), timeout=30)
                    if stop_redis:
                        server.stop()
                    (pause / f"go-{sbx.id}").write_text("")
                    r = future.result(timeout=60)
                if not stop_redis:  # positive control: the pause alone refuses nothing
                    assert r.status_code == 200, r.text
                    assert len(world.hits.since(mark)) == 1
                    continue
                assert r.status_code == 403 and r.json()["reason"] == "state_unavailable", r.text
                time.sleep(0.3)
                assert world.hits.since(mark) == []  # nothing went upstream
                rid = r.json()["request_id"]

                def records(rid: str = rid) -> list[dict]:
                    return [a for a in gw.audit_records() if a.get("egressgate.request.id") == rid]

                assert wait_for(lambda: records() != [], timeout=10)
                [record] = records()  # its decision record, and no allow or outcome beside it
                assert record["egressgate.decision"] == "deny"
                assert record["egressgate.reason"] == "state_unavailable"
                assert record["egressgate.rule"] == "plain"
        finally:
            stop_gateway(gw)
