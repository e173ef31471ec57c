"""Two real gateways on one Redis (`state: {backend: redis}`): an approval asked for through one replica
and granted through the other's admin API is honoured by both, expires on time on both, and its expiry
is recorded exactly once across the two audit trails (both sweep)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.approvals import harness
from tests.approvals.harness import admin, approve, http_get, records
from tests.support.gwworld import Gateway, World
from tests.support.redis import RedisServer
from tests.support.replicas import gateway_pair, through


@pytest.fixture(scope="module")
def pair(world: World, redis_server: RedisServer,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Gateway]]:
    with gateway_pair(harness.start, world, redis_server, lambda n: tmp_path_factory.mktemp(f"a12-{n}")) as ab:
        yield ab


def test_granted_on_one_replica_honoured_by_the_other_and_expires_on_time(pair: tuple[Gateway, Gateway]):
    a, b = pair
    sbx = a.admit("ap-gated")
    via_a, via_b = through(sbx, a), through(sbx, b)
    mark = a.world.hits.mark()
    asked_b = http_get(b, via_b, "other.test", "/r").json()
    asked_a = http_get(a, via_a, "other.test", "/r").json()
    assert asked_b["reason"] == "approval_required" and asked_a["approval_id"] == asked_b["approval_id"]
    approval_id = asked_b["approval_id"]
    assert admin(a, "GET", f"/v1/approvals/{approval_id}").json()["state"] == "pending"  # listed on A too
    other = b.admit("ap-gated")  # control: another sandbox, same policy, same target
    other_id = http_get(b, other, "other.test", "/r").json()["approval_id"]
    granted = approve(a, approval_id, for_seconds=2, by="alice").json()  # granted through A
    assert granted["state"] == "approved"
    assert http_get(b, via_b, "other.test", "/r").status == 200  # honoured by B
    assert http_get(a, via_a, "other.test", "/r").status == 200
    assert http_get(b, other, "other.test", "/r").json()["approval_id"] == other_id  # not by B's other sandbox
    assert len(a.world.hits.since(mark)) == 2
    while time.time() < granted["expires_at"] + 0.05:
        time.sleep(0.05)
    for gw, via in ((b, via_b), (a, via_a)):  # expired on time on both replicas
        late = http_get(gw, via, "other.test", "/r").json()
        assert late["reason"] == "approval_required" and late["approval_id"] != approval_id
    assert len(a.world.hits.since(mark)) == 2
    assert admin(b, "GET", f"/v1/approvals/{approval_id}").json()["state"] == "expired"
    time.sleep(1.5)  # both sweepers ran at least twice since the expiry
    expired = [r for gw in (a, b) for r in records(gw, **{"egressgate.operation": "approval",
                                                            "egressgate.approval.id": approval_id,
                                                            "egressgate.approval.action": "expired"})]
    assert len(expired) == 1
