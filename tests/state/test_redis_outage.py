"""Redis goes away: every operation fails closed (StateUnavailable, counted), and the same store works
again once Redis is back, without being recreated (the gateway is not restarted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.state.base import StateUnavailable
from egressgate.state.redis import RedisState
from tests.state.helpers import TOKEN, record, redis_store
from tests.support.redis import RedisServer

HANG_GUARD = 60.0  # seconds: a hang guard only, never a speed check


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", appendfsync="always")
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _every_operation_fails(store: RedisState) -> None:
    ops = [
        store.get("sbx-other"), store.by_address("198.18.0.9"), store.list_sandboxes(), store.admit(record("x")),
        store.revoke("sbx"), store.snapshot("sbx"), store.reserve_out("sbx", 1, 1, None),
        store.settle_out("sbx", 1, 0), store.add_in("sbx", 1), store.record_request("sbx", "h", "r", 1),
        store.add_dns_query("sbx", 1), store.ping(), store.reconcile(time.time()),
    ]
    for op in ops:
        with pytest.raises(StateUnavailable):
            await op


async def _until_ok(coro_factory, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await coro_factory()
        except StateUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_stopped_redis_fails_closed_and_the_store_recovers(own_redis: RedisServer):
    store = await redis_store(own_redis)
    try:
        await store.admit(record())
        assert await store.reserve_out("sbx", 100, 100, 1000) == 100
        assert await store.get("sbx") is not None and store.errors == 0
        own_redis.stop()
        await _every_operation_fails(store)
        assert store.errors >= 13
        own_redis.start()  # same port, same data dir (appendonly)
        snap = await _until_ok(lambda: store.snapshot("sbx"))
        assert snap.bytes_out == 100  # what was spent before the outage is still spent
        assert await store.reserve_out("sbx", 1000, 1, 1000) == 900  # and the budget still holds
        got = await store.get("sbx")
        assert got is not None and got.token_hash == record().token_hash
        await store.wait_subscribed(timeout=5)  # revocation events flow again
    finally:
        await store.close()


async def test_kill9_redis_fails_closed_then_recovers(own_redis: RedisServer):
    store = await redis_store(own_redis)
    try:
        await store.admit(record())
        await store.record_request("sbx", "a.example", "r1", 5)
        own_redis.kill()
        with pytest.raises(StateUnavailable):
            await store.record_request("sbx", "a.example", "r1", 5, requests_max=10)
        with pytest.raises(StateUnavailable):
            await store.snapshot("sbx")
        own_redis.start()
        snap = await _until_ok(lambda: store.snapshot("sbx"))
        assert snap.rule_usage["r1"].requests == 1  # appendfsync always: nothing acknowledged was lost
    finally:
        await store.close()


async def test_cached_record_is_not_served_while_redis_is_down(own_redis: RedisServer):
    """The per-process record cache is only used while the subscription is live: with Redis gone, a
    request's identity re-check fails closed instead of trusting a record that may have been revoked."""
    store = await redis_store(own_redis)
    try:
        await store.admit(record())
        assert await store.get("sbx") is not None  # cached now
        own_redis.stop()
        deadline = time.monotonic() + 5
        while store._cache.live and time.monotonic() < deadline:  # the subscription notices the drop
            await asyncio.sleep(0.01)
        with pytest.raises(StateUnavailable):
            await store.get("sbx")
    finally:
        own_redis.start()
        await store.close()


async def test_start_with_redis_down_denies_until_it_is_up(tmp_path: Path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    server.stop()  # a port that was ours; nothing listens now
    store = RedisState(server.url, server.prefix())
    await store.start()
    try:
        with pytest.raises(StateUnavailable):
            await store.ping()
        server.start()
        await _until_ok(store.ping)
        await store.admit(record())
        got = await store.get("sbx")
        assert got is not None and not got.revoked and TOKEN not in got.token_hash
    finally:
        await store.close()
        server.stop()


async def test_scripts_flushed_are_reloaded_and_nothing_runs_twice(redis_server: RedisServer):
    """A Redis restart (or SCRIPT FLUSH) forgets the scripts: NOSCRIPT means the command did not run, so
    it is sent again once after loading them; a batch of concurrent reservations stays exact."""
    store = await redis_store(redis_server)
    try:
        await store.admit(record())
        await store.redis.script_flush()
        grants = await asyncio.gather(*(store.reserve_out("sbx", 10, 10, 205) for _ in range(30)))
        assert sorted(set(grants)) == [0, 10] and sum(grants) == 200
        await store.redis.script_flush()
        assert await store.reserve_out("sbx", 5, 5, 205) == 5  # alone (not batched) too
        assert (await store.snapshot("sbx")).bytes_out == 205 and store.errors == 0
    finally:
        await store.close()


async def test_one_failing_command_in_a_batch_fails_only_its_caller(redis_server: RedisServer):
    store = await redis_store(redis_server)
    try:
        await store.admit(record())
        await store.admit(record("sbx-bad"))
        await store.redis.set(store.key("ctr", "sbx-bad"), "not a hash")  # WRONGTYPE for its counters
        results = await asyncio.gather(
            *(store.reserve_out("sbx", 1, 1, None) for _ in range(10)),
            store.reserve_out("sbx-bad", 1, 1, None), return_exceptions=True)
        assert results[:10] == [1] * 10
        assert isinstance(results[10], StateUnavailable) and store.errors == 1
    finally:
        await store.close()


async def test_after_a_restart_no_operation_fails_on_a_stale_pooled_connection(own_redis: RedisServer):
    """The pool held several connections when Redis restarted; once Redis is back, a burst of operations
    all succeed (none is handed a dead connection from before the restart). The burst makes new
    connections; a loop stalled past CONNECT_TIMEOUT meanwhile (a loaded host) no longer fails them
    (state/stall.py, tests/state/test_redis_stall.py), so every operation of the one burst must pass."""
    store = await redis_store(own_redis)
    try:
        await store.admit(record())
        await asyncio.gather(*(store.redis.blpop([store.key("nothing")], 0.1) for _ in range(12)))
        assert len(store.redis.connection_pool._available_connections) >= 12  # positive control
        await asyncio.to_thread(own_redis.stop)  # the loop runs meanwhile, as it would in a gateway
        deadline = time.monotonic() + HANG_GUARD
        while store._cache.live:  # the subscription notices the drop
            assert time.monotonic() < deadline, "the subscription never noticed that Redis stopped"
            await asyncio.sleep(0.01)
        await asyncio.to_thread(own_redis.start)
        await store.wait_subscribed(timeout=HANG_GUARD)
        errors = store.errors
        results = await asyncio.gather(*(store.reserve_out("sbx", 1, 1, None) for _ in range(12)),
                                       *(store.redis.blpop([store.key("nothing")], 0.1) for _ in range(12)),
                                       return_exceptions=True)
        assert [str(r) for r in results if isinstance(r, Exception)] == [] and store.errors == errors
    finally:
        await store.close()
