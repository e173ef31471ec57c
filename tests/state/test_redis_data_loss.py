"""Redis loses its data (FLUSHALL, a restart without persistence, keys evicted): nothing may come back
to life with a fresh budget, and a revocation must still reach every replica.

The danger is the per-process record cache (state/redis_events.py): it is honest about events, but a
FLUSHALL publishes none and keeps the subscription up, so every replica keeps serving the sandbox from
its cache while Redis no longer knows it — its spent budget back at zero, and DELETE /v1/sandboxes/{id}
unable to revoke it (REVOKE finds no record, so it published nothing). Each test runs its own
redis-server (FLUSHALL and a data wipe must not touch the session's shared one).
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from egressgate.state.base import StateUnavailable
from tests.state.helpers import record, redis_store, replica_pair, wait_until
from tests.support.redis import RedisServer


async def _spend_all(store, limit: int = 100) -> None:
    """Positive control: the budget is spent and holds (nothing more is granted)."""
    assert await store.reserve_out("sbx", limit, limit, limit) == limit
    assert await store.reserve_out("sbx", 1, 1, limit) == 0
    assert (await store.snapshot("sbx")).bytes_out == limit


async def test_flushall_neither_resets_a_spent_budget_nor_keeps_a_cached_sandbox_alive(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        async with replica_pair(server) as (a, b):
            await a.admit(record())
            assert (await b.get("sbx")) is not None and "sbx" in b._cache.records  # b serves it from cache
            await _spend_all(b)
            await a.redis.flushall()
            await asyncio.sleep(0.05)
            # the sandbox's budget must not start again from zero on a replica that still caches it
            with pytest.raises((StateUnavailable, KeyError)):
                await b.snapshot("sbx")
            with pytest.raises(StateUnavailable):
                await b.reserve_out("sbx", 100, 1, 100)
            assert (await a.redis.hget(a.key("ctr", "sbx"), "out")) is None  # nothing was granted


async def test_revoking_a_sandbox_redis_forgot_still_closes_it_on_every_replica(tmp_path):
    """After a FLUSHALL the admin API still finds the record in its replica's cache and answers
    `revoked: true`: the other replicas must hear it (and close that sandbox's connections)."""
    with RedisServer(tmp_path / "redis") as server:
        async with replica_pair(server) as (a, b):
            seen_b: list[str] = []
            b.on_revoke(seen_b.append)
            await a.admit(record())
            assert (await b.get("sbx")) is not None
            await a.redis.flushall()
            await a.revoke("sbx")
            elapsed = await wait_until(lambda: seen_b, 1.0)
            assert seen_b == ["sbx"], f"b never closed the sandbox's connections ({elapsed:.2f} s)"


async def test_a_redis_restart_without_its_data_closes_the_sandboxes_it_forgot(tmp_path):
    """Redis restarted with no persistence (its data dir wiped): b's subscription comes back and finds
    its cached sandbox gone. A tunnel held open across the outage must be closed (on_revoke) and must
    not be granted a fresh budget."""
    with RedisServer(tmp_path / "redis") as server:
        async with replica_pair(server) as (a, b):
            seen_b: list[str] = []
            b.on_revoke(seen_b.append)
            await a.admit(record())
            assert (await b.get("sbx")) is not None
            await _spend_all(b)
            server.stop()
            for leftover in ("appendonlydir", "dump.rdb"):
                path = server.dir / leftover
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            server.start()
            await b.wait_subscribed(timeout=10)
            elapsed = await wait_until(lambda: seen_b, 2.0)
            assert seen_b == ["sbx"], f"connections of the forgotten sandbox stayed open ({elapsed:.2f} s)"
            with pytest.raises(StateUnavailable):
                await b.reserve_out("sbx", 100, 1, 100)


async def test_a_value_redis_cannot_be_sent_fails_closed_and_harms_no_other_command(tmp_path):
    """Every store failure is StateUnavailable (callers deny `state_unavailable`), also a value the wire
    encoding refuses (a lone surrogate, as mitmproxy's surrogateescape decoding produces from non-UTF-8
    bytes): before, a UnicodeEncodeError escaped the store and the callers' `except StateUnavailable`."""
    with RedisServer(tmp_path / "redis") as server:
        store = await redis_store(server)
        try:
            await store.admit(record())
            for call in (store.get("sbx\udcff"), store.record_request("sbx", "a\udcff.example", "r", 1),
                         store.by_address("198.18.0.\udcff")):
                with pytest.raises(StateUnavailable):
                    await call
            assert (await store.get("sbx")) is not None  # the connection is intact for everyone else
            assert await store.reserve_out("sbx", 5, 5, None) == 5
        finally:
            await store.close()


async def test_a_revoked_sandbox_does_not_stay_in_redis_forever(tmp_path):
    """Every admitted sandbox used to keep its keys (record, counters, history, usage) and its place in
    `sbxs` forever: Redis grew with every `sandbox run`, and LIST_SANDBOXES (one script, blocking Redis
    for every tenant while it runs) with it. Revoked: its keys expire after REVOKED_RETENTION; a live
    sandbox's do not; the listing drops ids whose record is gone."""
    from egressgate.state.redis import REVOKED_RETENTION

    with RedisServer(tmp_path / "redis") as server:
        store = await redis_store(server)
        try:
            await store.admit(record())
            await store.admit(record("sbx-live"))
            for sid in ("sbx", "sbx-live"):
                assert await store.reserve_out(sid, 5, 5, None) == 5
                assert await store.record_request(sid, "a.example", "r", 1)
            assert await store.revoke("sbx")
            for kind in ("sbx", "ctr", "hosts", "hist", "usage"):
                ttl = await store.redis.pttl(store.key(kind, "sbx"))
                assert 0 < ttl <= REVOKED_RETENTION * 1000, (kind, ttl)
                assert await store.redis.pttl(store.key(kind, "sbx-live")) == -1, kind  # positive control
            assert (await store.get("sbx")).revoked  # still there (refused as revoked) during the retention
            await store.redis.delete(store.key("sbx", "sbx"))  # as the expiry does
            assert [r.id for r in await store.list_sandboxes()] == ["sbx-live"]
            assert not await store.redis.sismember(store.key("sbxs"), "sbx")
        finally:
            await store.close()
