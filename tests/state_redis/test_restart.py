"""A gateway restart (`run --workers 2` on a real Redis) keeps admitted sandboxes and spent budgets; Redis
stopped denies requests `state_unavailable` (audited) and Redis back restores service without a gateway
restart."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.state_redis.workers_support import get_fresh, start_workers, worker_records
from tests.support.gwworld import Sandbox, World
from tests.support.redis import RedisServer
from tests.support.replay_check import stop_and_replay
from tests.support.waiting import wait_for

BODY = 1500  # gw-budget allows 4000 outbound bytes (heads + bodies): two such uploads fit, a third does not


@pytest.fixture
def redis(tmp_path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis", appendfsync="always") as server:
        yield server


def upload(sbx: Sandbox, n: int = BODY):
    with sbx.client() as c:
        return c.post(sbx.url("api.test", "/upload"), content=b"x" * n)


def moved(sbx: Sandbox, gw) -> Sandbox:
    """The same sandbox credentials on another gateway process (its proxy port)."""
    url = sbx.proxy_url.replace(f":{sbx.gw.proxy[1]}", f":{gw.proxy[1]}")
    return Sandbox(id=sbx.id, token=sbx.token, proxy_url=url, env=sbx.env, gw=gw)


def test_restart_keeps_tokens_and_spent_budgets(world: World, redis: RedisServer, tmp_path):
    prefix = redis.prefix()
    first = start_workers(world, tmp_path / "gw1", redis, prefix)
    try:
        sbx = first.admit("gw-budget")
        assert upload(sbx).status_code == 200
        assert upload(sbx).status_code == 200
        stale = first.admit("gw-basic")
    finally:
        assert stop_and_replay(first) == 0
    second = start_workers(world, tmp_path / "gw2", redis, prefix)  # new processes, new var dir, same Redis
    try:
        old = moved(sbx, second)
        mark = world.hits.mark()
        assert get_fresh(old).status_code == 200  # the old token still works
        r = upload(old)
        assert r.status_code == 429 and r.json()["reason"] == "budget_exceeded", r.text  # spent stays spent
        assert [h for h in world.hits.since(mark) if h.get("path") == "/upload"] == []
        fresh = second.admit("gw-budget")  # positive control: a new budget takes the same upload
        assert upload(fresh).status_code == 200
        assert get_fresh(moved(stale, second)).status_code == 200
        wrong = Sandbox(id=old.id, token=old.token + "x", proxy_url=old.proxy_url.replace(old.token, old.token + "x"),
                        env={}, gw=second)
        assert get_fresh(wrong, scheme="http").status_code == 407  # control: the token is really checked
    finally:
        stop_and_replay(second)


def test_redis_outage_denies_then_recovers_without_restart(world: World, redis: RedisServer, tmp_path):
    gw = start_workers(world, tmp_path / "gw", redis)
    try:
        sbx = gw.admit("gw-basic")
        assert get_fresh(sbx).status_code == 200
        redis.stop()
        denied = [get_fresh(sbx, scheme="http") for _ in range(6)]  # new connections: both workers meet it
        for r in denied:
            assert r.status_code != 200
            assert json.loads(r.text)["reason"] == "state_unavailable", r.text
        # every refusal is audited, under the request id its deny body names (by whichever worker refused it)
        ids = {r.json()["request_id"] for r in denied}
        assert wait_for(lambda: ids <= {rec.get("egressgate.request.id") for recs in worker_records(gw.var).values()
                                        for rec in recs if rec.get("egressgate.reason") == "state_unavailable"},
                        timeout=10)
        redis.start()  # same port, same data: each worker reconnects by itself (its own back-off)
        seen: list[tuple[int, str]] = []

        def recovered() -> bool:
            replies = [get_fresh(sbx, scheme="http") for _ in range(10)]
            seen.extend((r.status_code, r.json().get("reason") if r.status_code != 200 else "") for r in replies)
            return all(r.status_code == 200 for r in replies)

        assert wait_for(recovered, timeout=30, interval=0.2), seen[-20:]
        assert {reason for status, reason in seen if status != 200} <= {"state_unavailable"}, seen
    finally:
        stop_and_replay(gw)
