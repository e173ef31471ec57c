"""A sandbox's host history must not be read whole on every request (Redis: one sandbox can stall all).

The history (`hosts:<id>`) grows by one entry per distinct host a sandbox reaches, without bound; a
policy that allows `*.example.com` lets a sandbox grow it at will. Under Redis every decision that reads
the snapshot with the default `history=True` runs SMEMBERS of the whole set inside Redis's one thread:
measured on loopback, 20,000 hosts cost ~47 ms of Redis time per request, and another sandbox's 20
snapshots queued behind ten of them took ~440 ms instead of ~1 ms (a cross-tenant stall; at the 2 s
state timeout every sandbox is denied `state_unavailable`). The store can read only what the policy
asks about (`history=policy.history_patterns, rules=policy.budgeted_rules`, state/base.py); a policy
without history conditions then reads none.

Deterministic check: Redis's own command statistics (SMEMBERS runs inside the SNAPSHOT script) over
requests of a sandbox whose policy has no `when` history condition.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gwworld import World, open_world, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("v12-world")) as w:
        yield w


def _calls(server: RedisServer, command: str) -> int:
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_requests_under_a_policy_without_history_conditions_never_read_the_history(world: World, tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        state = {"state": {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}}
        gw = start_gateway(world, tmp_path / "gw", state)
        try:
            sbx = gw.admit("gw-basic")
            with sbx.client() as c:
                assert c.get(sbx.url("api.test", "/echo")).status_code == 200  # the history has a host now
                before = _calls(server, "smembers")
                for _ in range(5):
                    assert c.get(sbx.url("api.test", "/echo")).status_code == 200
                    assert c.get(sbx.url("other.test", "/x")).status_code in (200, 404)
            after = _calls(server, "smembers")
            assert _calls(server, "evalsha") > 0  # positive control: the requests did go through Redis
            assert after == before, f"{after - before} whole-history reads for 10 requests"
        finally:
            stop_gateway(gw)
