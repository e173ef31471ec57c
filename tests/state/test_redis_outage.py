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
