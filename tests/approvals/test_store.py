"""The approval store contract, on memory and on a real Redis (two store instances = two replicas).

`now` is passed in everywhere, so expiry is tested to the instant without sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from egressgate.approvals.memory import MemoryApprovals
from egressgate.approvals.model import (
    DENIED_MEMORY_SECONDS,
    KIND_PUBLISH,
    MAX_PENDING_PER_SANDBOX,
    PENDING_TTL_SECONDS,
    RETENTION_SECONDS,
    Approval,
    ApprovalNotFound,
    ApprovalState,
    ApprovalUnavailable,
    NotPending,
    new_approval_id,
)
from egressgate.approvals.redis_store import RedisApprovals
from egressgate.approvals.store import open_approvals
from egressgate.state.base import StateUnavailable
from egressgate.state.redis import RedisState
from tests.support.env import refusing_port

NOW = 1_800_000_000.0


def draft(sandbox: str = "sbx-a", host: str = "new.example.com", port: int = 443, path: str = "/data",
          now: float = NOW) -> Approval:
    return Approval(id=new_approval_id(), sandbox_id=sandbox, policy="p", state=ApprovalState.PENDING,
                    scheme="https", host=host, port=port, method="GET", path=path, requested_at=now)


@pytest.fixture(params=["memory", "redis"])
async def stores(request, redis_server, redis_prefix) -> AsyncIterator[tuple]:
    """Two handles on ONE store: for memory the same object, for Redis two clients (two replicas)."""
    if request.param == "memory":
        store = MemoryApprovals()
        yield store, store
        return
    # built exactly as the gateway builds them (open_approvals over a RedisState: its client, its key
    # prefix, its error counter), not a hand-made client and key function that could drift from them
    states = [RedisState(redis_server.url, redis_prefix) for _ in range(2)]
    try:
        stores = tuple(open_approvals(s) for s in states)
        assert all(isinstance(s, RedisApprovals) for s in stores)
        yield stores
    finally:
        for s in states:
            await s.close()


async def test_retries_get_the_same_pending_id_and_the_queue_is_bounded(stores):
    one, two = stores
    first, created = await one.request(draft(), NOW)
    assert created and first is not None and first.state is ApprovalState.PENDING
    again, created_again = await two.request(draft(path="/other"), NOW + 5)  # same sandbox + target
    assert (again.id, created_again) == (first.id, False)
    other_sbx, created_b = await two.request(draft(sandbox="sbx-b"), NOW)  # control: another sandbox
    assert created_b and other_sbx.id != first.id
    ids = {first.id}
    for i in range(MAX_PENDING_PER_SANDBOX - 1):
        approval, created = await one.request(draft(host=f"h{i}.example.com"), NOW)
        assert created
        ids.add(approval.id)
    assert len(ids) == MAX_PENDING_PER_SANDBOX
    assert await two.request(draft(host="one-too-many.example.com"), NOW) == (None, False)
    # a retry of a target already waiting still gets its id at the bound
    assert (await one.request(draft(), NOW))[0].id == first.id
    pending = await one.list(ApprovalState.PENDING, NOW)
    assert len([a for a in pending if a.sandbox_id == "sbx-a"]) == MAX_PENDING_PER_SANDBOX


async def test_concurrent_retries_on_two_replicas_make_one_approval(stores):
    one, two = stores
    results = await asyncio.gather(*(s.request(draft(), NOW) for s in (one, two) * 10))
    assert len({a.id for a, _ in results}) == 1
    assert sum(created for _, created in results) == 1


async def test_approve_on_one_replica_is_honoured_by_the_other_and_expires_on_time(stores):
    one, two = stores
    approval, _ = await one.request(draft(), NOW)
    assert await two.grants("sbx-a", NOW) == ()
    decided = await one.decide(approval.id, approve=True, by="alice", scope="host+path", for_seconds=30, now=NOW + 1)
    assert (decided.state, decided.decided_by, decided.scope, decided.expires_at) == (
        ApprovalState.APPROVED, "alice", "host+path", NOW + 31)
    (g,) = await two.grants("sbx-a", NOW + 30.9)
    assert (g.id, g.sandbox_id, g.scope, g.path, g.expires_at) == (approval.id, "sbx-a", "host+path", "/data", NOW + 31)
    assert await two.grants("sbx-b", NOW + 2) == ()  # another sandbox never sees it
    assert await two.grants("sbx-a", NOW + 31) == ()  # dead at expires_at, sweeper or not
    shown = await two.get(approval.id)
    assert shown.current(NOW + 31).state is ApprovalState.EXPIRED
    # the sweepers of both replicas race: each expiry is handed out exactly once
    swept = await asyncio.gather(one.expire(NOW + 31), two.expire(NOW + 31), one.expire(NOW + 32))
    assert [a.id for batch in swept for a in batch] == [approval.id]
    assert (await one.get(approval.id)).state is ApprovalState.EXPIRED
    assert await one.list(ApprovalState.APPROVED, NOW + 40) == []
    with pytest.raises(NotPending):
        await two.decide(approval.id, approve=True, by="bob", scope="host", for_seconds=30, now=NOW + 40)


async def test_expire_is_not_early(stores):
    one, two = stores
    approval, _ = await one.request(draft(), NOW)
    await one.decide(approval.id, approve=True, by=None, scope="host", for_seconds=10, now=NOW)
    assert await two.expire(NOW + 9.99) == []
    assert len(await two.grants("sbx-a", NOW + 9.99)) == 1
    assert [a.id for a in await two.expire(NOW + 10)] == [approval.id]


async def test_deny_is_final_and_remembered_for_retries(stores):
    one, two = stores
    approval, _ = await one.request(draft(), NOW)
    denied = await two.decide(approval.id, approve=False, by="bob", scope="host", for_seconds=1, now=NOW + 1)
    assert (denied.state, denied.decided_by, denied.expires_at) == (ApprovalState.DENIED, "bob", None)
    assert await one.grants("sbx-a", NOW + 2) == ()
    again, created = await one.request(draft(), NOW + 2)
    assert (again.id, again.state, created) == (approval.id, ApprovalState.DENIED, False)
    later, created_later = await one.request(draft(), NOW + 1 + DENIED_MEMORY_SECONDS)  # forgotten after a while
    assert created_later and later.id != approval.id
    for action in (True, False):
        with pytest.raises(NotPending):
            await one.decide(approval.id, approve=action, by=None, scope="host", for_seconds=5, now=NOW + 3)
    with pytest.raises(ApprovalNotFound):
        await one.decide("apr-nope", approve=True, by=None, scope="host", for_seconds=5, now=NOW)


async def test_pending_expires_unanswered_and_frees_its_slot(stores):
    one, two = stores
    approval, _ = await one.request(draft(), NOW)
    late = NOW + PENDING_TTL_SECONDS
    with pytest.raises(NotPending):
        await two.decide(approval.id, approve=True, by=None, scope="host", for_seconds=5, now=late)
    assert [a.id for a in await two.expire(late)] == [approval.id]
    fresh, created = await one.request(draft(), late)
    assert created and fresh.id != approval.id


async def test_host_path_needs_a_path(stores):
    one, two = stores
    connect = Approval(id=new_approval_id(), sandbox_id="sbx-a", policy="p", state=ApprovalState.PENDING,
                       scheme=None, host="new.example.com", port=443, method=None, path=None, requested_at=NOW)
    await one.request(connect, NOW)
    with pytest.raises(ValueError):
        await one.decide(connect.id, approve=True, by=None, scope="host+path", for_seconds=5, now=NOW)
    ok = await two.decide(connect.id, approve=True, by=None, scope="host", for_seconds=5, now=NOW)
    assert ok.scheme is None and ok.state is ApprovalState.APPROVED


async def test_redis_outage_is_state_unavailable_and_counted(redis_prefix):
    """The approval store shares the state store's Redis client (open_approvals) and its error counter."""
    with refusing_port() as port:
        state = RedisState(f"redis://127.0.0.1:{port}/0", redis_prefix)
        store = open_approvals(state)
        assert isinstance(store, RedisApprovals) and store.redis is state.redis
        try:
            before = state.errors
            for call in (store.request(draft(), NOW), store.grants("sbx-a", NOW), store.list(None, NOW),
                         store.get("apr-x"), store.expire(NOW)):
                with pytest.raises(ApprovalUnavailable) as exc:
                    await call
                assert isinstance(exc.value, StateUnavailable)
            assert state.errors == before + 5
        finally:
            await state.close()


async def test_ended_approvals_are_dropped_after_the_retention(stores):
    one, two = stores
    denied, _ = await one.request(draft(host="d.example.com"), NOW)
    await one.decide(denied.id, approve=False, by="bob", scope="host", for_seconds=1, now=NOW)
    granted, _ = await one.request(draft(host="g.example.com"), NOW)
    await one.decide(granted.id, approve=True, by="bob", scope="host", for_seconds=10, now=NOW)
    live, _ = await one.request(draft(host="p.example.com"), NOW + RETENTION_SECONDS)  # control: still pending
    assert [a.id for a in await two.expire(NOW + 10)] == [granted.id]
    await two.expire(NOW + RETENTION_SECONDS - 1)
    assert await one.get(denied.id) is not None and await one.get(granted.id) is not None  # not yet
    await two.expire(NOW + RETENTION_SECONDS + 11)
    assert await one.get(denied.id) is None and await one.get(granted.id) is None
    assert [a.id for a in await one.list(None, NOW + RETENTION_SECONDS + 11)] == [live.id]
    fresh, created = await one.request(draft(host="d.example.com"), NOW + RETENTION_SECONDS + 11)
    assert created and fresh.id != denied.id


async def test_a_persistent_write_keeps_its_details_and_its_own_pending_ttl(stores):
    """Issue 22 item 4: the change list travels with the approval (both backends), and a pending write
    expires after the TTL its run asked for, not the default hour."""
    from dataclasses import replace

    from egressgate.approvals.model import KIND_PERSISTENT_WRITE

    one, two = stores
    details = {"workspace": "w", "count": 1, "changes": [{"path": "a", "action": "added", "size": 1}]}
    short = replace(draft(host="workspace:w", port=0, path=None), kind=KIND_PERSISTENT_WRITE, scheme="workspace",
                    method="write", pending_ttl=5.0, details=details)
    default = draft(sandbox="sbx-b")  # positive control: the default TTL
    assert (await one.request(short, NOW))[1] and (await one.request(default, NOW))[1]
    got = await two.get(short.id)
    assert got is not None and got.details == details and got.pending_ttl == 5.0
    assert [a.id for a in await two.expire(NOW + 4)] == []
    assert [a.id for a in await two.expire(NOW + 6)] == [short.id]
    assert (await one.get(default.id)).current(NOW + 6).state is ApprovalState.PENDING
    with pytest.raises(NotPending):
        await one.decide(short.id, approve=True, by="op", scope="host", for_seconds=60, now=NOW + 6)


async def test_a_publish_grant_is_spent_once_even_by_racing_replicas(stores):
    """`publish` approvals pass one publish (gateway/shared/approval_gate.py spend): consume() removes the grant
    atomically; of two replicas racing for it exactly one gets it, and it is then no longer live."""
    one, two = stores
    asked, _ = await one.request(replace(draft(path="/pkg"), method="PUT", kind=KIND_PUBLISH), NOW)
    assert asked is not None and asked.target_key.startswith("publish|")
    network, _ = await one.request(draft(path="/pkg"), NOW)  # the same target as a network approval: another one
    assert network is not None and network.id != asked.id
    await one.decide(asked.id, approve=True, by="ops", scope="host+path", for_seconds=600, now=NOW)
    (grant,) = await two.grants("sbx-a", NOW + 1)
    assert (grant.kind, grant.method, grant.path) == ("publish", "PUT", "/pkg")  # the kind survives the store
    results = await asyncio.gather(one.consume("sbx-a", asked.id, NOW + 2), two.consume("sbx-a", asked.id, NOW + 2))
    used = [r for r in results if r is not None]
    assert len(used) == 1 and used[0].state is ApprovalState.EXPIRED and used[0].expires_at == NOW + 2
    assert await one.grants("sbx-a", NOW + 3) == () and await two.grants("sbx-a", NOW + 3) == ()
    assert (await two.get(asked.id)).current(NOW + 3).state is ApprovalState.EXPIRED
    assert await one.consume("sbx-a", asked.id, NOW + 4) is None  # spent is spent
    # control: an unspent grant is still live for its whole lifetime, and not consumable once dead
    again, _ = await one.request(replace(draft(path="/other"), method="PUT", kind=KIND_PUBLISH), NOW)
    await one.decide(again.id, approve=True, by="ops", scope="host", for_seconds=60, now=NOW)
    assert len(await two.grants("sbx-a", NOW + 59)) == 1
    assert await two.consume("sbx-a", again.id, NOW + 60) is None
