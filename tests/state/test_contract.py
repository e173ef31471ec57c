"""The StateStore contract (egressgate/state/base.py), the same assertions on every backend."""

from __future__ import annotations

import asyncio
import textwrap

from egressgate.policy.loader import parse_policy
from egressgate.state.base import MAX_AMOUNT, StateStore, token_matches
from egressgate.state.redis import RedisState
from tests.state.helpers import record


async def test_registry_round_trip(store: StateStore):
    assert await store.get("sbx") is None and await store.list_sandboxes() == []
    await store.admit(record(addresses=("198.18.0.2",), team="a"))
    got = await store.get("sbx")
    assert got is not None and got.policy_name == "p" and got.admitted_at == 1.5
    assert got.labels == {"team": "a"} and got.addresses == ("198.18.0.2",) and got.phantoms == {"gh": "ab" * 32}
    assert token_matches(got, "tok") and not token_matches(got, "tok2") and not got.revoked
    by_addr = await store.by_address("198.18.0.2")
    assert by_addr is not None and by_addr.id == "sbx"
    assert await store.by_address("198.18.0.3") is None
    await store.admit(record("sbx2"))
    assert sorted(r.id for r in await store.list_sandboxes()) == ["sbx", "sbx2"]
    assert isinstance(store.worker_id, str) and len(store.worker_id) == 32 and store.errors == 0
    await store.ping()


async def test_readmission_replaces_the_record_and_keeps_the_counters(store: StateStore):
    await store.admit(record(team="a"))
    assert await store.reserve_out("sbx", 10, 10, None) == 10
    await store.admit(record(token="new", team="b"))
    got = await store.get("sbx")
    assert got is not None and got.labels == {"team": "b"} and token_matches(got, "new")
    snap = await store.snapshot("sbx")
    assert dict(snap.labels) == {"team": "b"} and snap.bytes_out == 10


async def test_revoke_marks_the_record_and_runs_callbacks(store: StateStore):
    seen: list[str] = []
    store.on_revoke(seen.append)
    await store.admit(record(addresses=("198.18.0.2",)))
    assert await store.revoke("nope") is False
    assert await store.revoke("sbx") is True
    for _ in range(100):  # Redis delivers by pub/sub: within 1 s
        if seen:
            break
        await asyncio.sleep(0.01)
    assert seen == ["sbx"]
    got = await store.get("sbx")
    assert got is not None and got.revoked
    by_addr = await store.by_address("198.18.0.2")  # still points at the revoked record: refused as revoked
    assert by_addr is not None and by_addr.revoked


async def test_reserve_takes_what_fits_and_never_more(store: StateStore):
    await store.admit(record())
    assert await store.reserve_out("sbx", 60, 60, 100) == 60
    assert await store.reserve_out("sbx", 60, 10, 100) == 40  # partial: at least the minimum fits
    assert await store.reserve_out("sbx", 5, 1, 100) == 0  # nothing left
    assert (await store.snapshot("sbx")).bytes_out == 100
    await store.settle_out("sbx", spent=30, unused=30)  # of the first lease: 30 sent, 30 back
    assert (await store.snapshot("sbx")).bytes_out == 70
    assert await store.reserve_out("sbx", 50, 40, 100) == 0  # 30 left, the minimum is 40
    assert await store.reserve_out("sbx", 50, 20, 100) == 30
    assert await store.reserve_out("sbx", 7, 7, None) == 7  # no limit: all of it
    assert await store.reserve_out("sbx", 0, 0, None) == 0


async def test_settle_never_gives_back_more_than_the_lease(store: StateStore):
    await store.admit(record())
    assert await store.reserve_out("sbx", 50, 50, 100) == 50
    await store.settle_out("sbx", spent=0, unused=500)  # a confused caller: only the 50 leased go back
    assert (await store.snapshot("sbx")).bytes_out == 0
    await store.settle_out("sbx", spent=0, unused=10)  # no lease left: nothing back
    assert (await store.snapshot("sbx")).bytes_out == 0
    assert await store.reserve_out("sbx", 40, 40, 100) == 40
    await store.settle_out("sbx", spent=40, unused=0)  # all sent: stays spent, lease gone
    await store.settle_out("sbx", spent=0, unused=40)
    assert (await store.snapshot("sbx")).bytes_out == 40


async def test_concurrent_reservations_are_exact(store: StateStore):
    await store.admit(record())
    # on Redis the burst also opens the hot-path connection: a loop stalled past CONNECT_TIMEOUT meanwhile does
    # not fail it (state/stall.py; tests/state/test_redis_stall.py)
    grants = await asyncio.gather(*(store.reserve_out("sbx", 7, 1, 1000) for _ in range(200)))
    assert len(grants) == 200 and sum(grants) == 1000 and all(g >= 0 for g in grants)
    assert (await store.snapshot("sbx")).bytes_out == 1000


async def test_bytes_in_and_dns_counters(store: StateStore):
    await store.admit(record())
    await store.add_in("sbx", 11)
    await store.add_in("sbx", 4)
    assert await store.add_dns_query("sbx", 10) == (1, 10)
    assert await store.add_dns_query("sbx", 5) == (2, 15)
    snap = await store.snapshot("sbx")
    assert (snap.bytes_in, snap.dns_queries, snap.dns_name_bytes) == (15, 2, 15)


async def test_record_request_counts_history_and_usage(store: StateStore):
    await store.admit(record())
    assert await store.record_request("sbx", "a.example", "r1", 10) is True
    assert await store.record_request("sbx", "b.example", None, 0) is True
    assert await store.record_request("sbx", "a.example", "r1", 5) is True
    snap = await store.snapshot("sbx")
    assert snap.seen_hosts == frozenset({"a.example", "b.example"})
    assert snap.rule_usage["r1"].requests == 2 and snap.rule_usage["r1"].bytes == 15


async def test_record_request_enforces_the_rule_budget(store: StateStore):
    await store.admit(record())
    assert await store.record_request("sbx", "a.example", "r1", 1, requests_max=2) is True
    assert await store.record_request("sbx", "a.example", "r1", 1, requests_max=2) is True
    assert await store.record_request("sbx", "new.example", "r1", 1, requests_max=2) is False
    snap = await store.snapshot("sbx")
    assert snap.rule_usage["r1"].requests == 2 and "new.example" not in snap.seen_hosts  # nothing recorded
    assert await store.record_request("sbx", "a.example", "r2", 60, bytes_max=100) is True
    assert await store.record_request("sbx", "a.example", "r2", 50, bytes_max=100) is False  # would go over
    assert await store.record_request("sbx", "a.example", "r2", 40, bytes_max=100) is True  # exactly at it
    assert await store.record_request("sbx", "a.example", "r2", 0, bytes_max=100) is False  # used up
    assert (await store.snapshot("sbx")).rule_usage["r2"].bytes == 100


async def test_concurrent_rule_budget_is_exact(store: StateStore):
    await store.admit(record())
    results = await asyncio.gather(*(store.record_request("sbx", "a.example", "r1", 3, requests_max=17)
                                     for _ in range(100)))
    assert results.count(True) == 17
    assert (await store.snapshot("sbx")).rule_usage["r1"].requests == 17


HISTORY_POLICY = parse_policy(textwrap.dedent("""
    sandbox: {name: hist}
    network:
      https:
        deny:
          - {id: d1, host: "*", methods: [POST], when: {after_request_to: [secrets.example.com, "*.vault.example"]}}
          - {id: d2, host: "*", methods: [PUT], when: {unless_request_to: ["*.internal"]}}
        allow:
          - {id: any-get, host: "*.example", methods: [GET]}
          - {id: limited, host: limited.example, budget: {requests: 5}}
          - {id: cheap, host: cheap.example, budget: {bytes: 500}}
"""), "hist.yaml")
HOSTS = ["secrets.example.com", "secrets.example.com.evil", "x.secrets.example.com", "vault.example", "a.vault.example",
         "b.c.vault.example", "vault.example.org", "avault.example", "1.2.3.4", "db.internal", "x.y.internal",
         "internal", "internal.example", "other.example", "::1"]


async def test_snapshot_with_the_policys_needs_decides_like_the_full_one(store: StateStore):
    """Asking only for what the policy reads (its history patterns, its budgeted rules) gives the same
    relevant state as reading everything, on every backend."""
    policy = HISTORY_POLICY
    assert policy.history_patterns and policy.budgeted_rules == {"limited", "cheap"}  # positive control
    await store.admit(record())
    for i, host in enumerate(HOSTS):
        await store.record_request("sbx", host, ["any-get", "limited", "cheap"][i % 3], 10 * i)
    if isinstance(store, RedisState):  # Redis reads only the matching hosts: fewer than the full history
        some = await store.snapshot("sbx", history=policy.history_patterns)
        assert len(some.seen_hosts) == 5
    full = await store.snapshot("sbx")
    assert full.seen_hosts == frozenset(HOSTS) and set(full.rule_usage) == {"any-get", "limited", "cheap"}
    hinted = await store.snapshot("sbx", history=policy.history_patterns, rules=policy.budgeted_rules)
    assert policy.relevant_state(hinted) == policy.relevant_state(full)
    assert policy.relevant_state(full).seen_hosts == {"secrets.example.com", "a.vault.example", "b.c.vault.example",
                                                     "db.internal", "x.y.internal"}
    nothing = await store.snapshot("sbx", history=False, rules=())
    assert nothing.bytes_out == full.bytes_out and dict(nothing.labels) == dict(full.labels)


async def test_reconcile_with_every_worker_alive_forfeits_nothing(store: StateStore):
    await store.admit(record())
    assert await store.reserve_out("sbx", 10, 10, None) == 10
    assert await store.reconcile(0.0) == []
    await store.settle_out("sbx", spent=10, unused=0)


async def test_amounts_beyond_exact_counting_are_refused_alike_and_corrupt_nothing(store: StateStore):
    """A sandbox chooses the size of what it sends (a declared Content-Length of 10^19): Redis counts in
    Lua doubles (exact to 2^53), and `%d` of 1e19 is -2^63, so HINCRBY would drive bytes_out to about
    -9.2e18 (a budget set later would never run out). Every backend refuses such an amount the same way
    (nothing reserved, nothing recorded) and the counters stay exact."""
    await store.admit(record())
    assert await store.reserve_out("sbx", 100, 100, None) == 100  # positive control: counted exactly
    for huge in (MAX_AMOUNT + 1, 10**19, 2**64):
        assert await store.reserve_out("sbx", huge, huge, None) == 0
        assert await store.reserve_out("sbx", huge, 1, 1000) == 0  # not even a part of it
        assert await store.record_request("sbx", "a.example", "r1", huge) is False
    assert await store.reserve_out("sbx", MAX_AMOUNT - 100, 1, None) == MAX_AMOUNT - 100  # the largest fits
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == MAX_AMOUNT and "r1" not in snap.rule_usage


async def test_a_negative_limit_is_a_limit_on_every_backend(store: StateStore):
    """The Redis scripts encode "no limit" as -1: a negative limit that reached them (a computed limit gone
    below zero, a budget edited by hand) meant *unlimited* there while the memory backend refused. Both
    refuse now: a limit below zero leaves no room."""
    await store.admit(record())
    assert await store.reserve_out("sbx", 10, 1, 100) == 10  # positive control
    for limit in (-1, -5):
        assert await store.reserve_out("sbx", 10, 1, limit) == 0
        assert await store.record_request("sbx", "a.example", "r1", 1, requests_max=limit) is False
        assert await store.record_request("sbx", "a.example", "r2", 1, bytes_max=limit) is False
    assert await store.record_request("sbx", "a.example", "r3", 1, requests_max=1) is True  # positive control
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == 10 and set(snap.rule_usage) == {"r3"}
