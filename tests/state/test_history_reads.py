"""A sandbox's host history must not be read whole on every request (Redis: one sandbox can stall all).

The history (`hosts:<id>`) grows by one entry per distinct host a sandbox reaches, without bound; a
policy that allows `*.example.com` lets a sandbox grow it at will. Under Redis every decision that reads
the snapshot with the default `history=True` runs SMEMBERS of the whole set inside Redis's one thread:
measured on loopback, 20,000 hosts cost ~47 ms of Redis time per request, and another sandbox's 20
snapshots queued behind ten of them took ~440 ms instead of ~1 ms (a cross-tenant stall; at the 2 s
state timeout every sandbox is denied `state_unavailable`). The store can read only what the policy
asks about (`history=policy.history_patterns, rules=policy.budgeted_rules`, state/base.py); a policy
without history conditions then reads none.

Deterministic check: Redis's own MONITOR (SMEMBERS of the sandbox's `hosts:<id>` key runs inside the
SNAPSHOT script) over requests of a sandbox whose policy has no `when` history condition. Only that key
is counted: the gateway's reconcile round (every 5 s) runs SMEMBERS of the `workers` set, which made a
count of every SMEMBERS fail whenever a round fell inside the requests (a loaded machine).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.gwworld import World, open_world, start_gateway
from tests.support.launcher import stop_gateway
from tests.support.redis import RedisServer
from tests.support.redis_monitor import Monitor


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_world(tmp_path_factory.mktemp("v12-world")) as w:
        yield w


def test_requests_under_a_policy_without_history_conditions_never_read_the_history(world: World, tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        state = {"state": {"backend": "redis", "url": server.url, "key_prefix": server.prefix()}}
        gw = start_gateway(world, tmp_path / "gw", state)
        try:
            sbx = gw.admit("gw-basic")
            monitor = Monitor(server.port)
            try:
                with sbx.client() as c:
                    assert c.get(sbx.url("api.test", "/echo")).status_code == 200  # the history has a host now
                    start = monitor.mark()
                    for _ in range(5):
                        assert c.get(sbx.url("api.test", "/echo")).status_code == 200
                        assert c.get(sbx.url("other.test", "/x")).status_code in (200, 404)
                    end = monitor.mark()
                commands = monitor.between(start, end)
                # control: a read of the whole history (the control API's usage figures) is seen
                res = httpx.get(
                    f"http://{gw.admin}/v1/sandboxes/{sbx.id}",
                    timeout=10,
                    trust_env=False,
                    headers={"Authorization": f"Bearer {gw.token}"},
                )
                assert res.status_code == 200 and res.json()["usage"]["hosts_contacted"] == 2
                control = monitor.between(end, monitor.mark())
            finally:
                monitor.close()
            history = f"hosts:{sbx.id}"
            assert [w for _, w in control if w[0].upper() == "SMEMBERS" and w[1].endswith(history)] != []
            # positive control: the requests did go through Redis, and the watch sees inside the scripts
            assert any(words[0].upper() == "EVALSHA" for _, words in commands)
            assert any(
                client == "lua" and words[1:2] == [f"{state['state']['key_prefix']}ctr:{sbx.id}"]
                for client, words in commands
            )
            reads = [words for _, words in commands if words[0].upper() == "SMEMBERS" and words[1].endswith(history)]
            assert reads == [], f"{len(reads)} whole-history reads for 10 requests"
        finally:
            stop_gateway(gw)
