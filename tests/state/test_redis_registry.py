"""The Redis registry across processes: revocation reaches every instance within 1 s, an instance that
missed the event still refuses, records are cached per process yet never stale, tokens are stored
hashed."""

from __future__ import annotations

import asyncio

from egressgate.state.base import hash_token, token_matches
from tests.state.helpers import record, redis_store, replica_pair, wait_until
from tests.support.redis import RedisServer


async def test_revocation_on_one_instance_runs_callbacks_on_the_other_within_a_second(redis_server: RedisServer):
    async with replica_pair(redis_server) as (a, b):
        seen_a: list[str] = []
        seen_b: list[str] = []
        a.on_revoke(seen_a.append)
        b.on_revoke(seen_b.append)
        await a.admit(record())
        cached = await b.get("sbx")  # b caches the record (what recheck() reads per request)
        assert cached is not None and not cached.revoked and "sbx" in b._cache.records
        assert await a.revoke("sbx") is True
        assert seen_a == ["sbx"]  # the revoking instance at once
        elapsed = await wait_until(lambda: seen_b, 1.0)
        assert seen_b == ["sbx"] and elapsed < 1.0, elapsed
        got = await b.get("sbx")  # the cache was invalidated with the event
        assert got is not None and got.revoked
        await asyncio.sleep(0.1)
        assert seen_a == ["sbx"]  # its own event does not run a's callbacks twice


async def test_an_instance_that_missed_the_event_still_refuses(redis_server: RedisServer):
    """Revoked while b's subscription was down (simulated: the record is changed in Redis without an
    event, then b's subscription is killed): b drops its cache, resubscribes, re-checks the sandboxes it
    had cached and runs the callbacks (so connections held open are closed), and reads revoked."""
    async with replica_pair(redis_server) as (a, b):
        seen_b: list[str] = []
        b.on_revoke(seen_b.append)
        await a.admit(record())
        assert (await b.get("sbx")) is not None and not (await b.get("sbx")).revoked
        await a.redis.hset(a.key("sbx", "sbx"), "revoked", "1")  # no event published
        assert not (await b.get("sbx")).revoked  # positive control: b serves its cache while subscribed
        killed = await a.redis.client_kill_filter(_type="pubsub")
        assert killed >= 1
        elapsed = await wait_until(lambda: seen_b, 3.0)
        assert seen_b == ["sbx"], elapsed
        got = await b.get("sbx")
        assert got is not None and got.revoked


async def test_readmission_elsewhere_invalidates_the_cache(redis_server: RedisServer):
    async with replica_pair(redis_server) as (a, b):
        await a.admit(record(addresses=("198.18.0.2",), team="a"))
        assert (await b.by_address("198.18.0.2")).labels == {"team": "a"}
        assert dict((await b.snapshot("sbx")).labels) == {"team": "a"}
        await a.admit(record("sbx-new", token="t2", addresses=("198.18.0.2",), team="b"))
        await a.admit(record(token="t3", team="c"))
        await wait_until(lambda: "sbx" not in b._cache.records, 1.0)
        moved = await b.by_address("198.18.0.2")
        assert moved is not None and moved.id == "sbx-new"
        got = await b.get("sbx")
        assert got is not None and token_matches(got, "t3") and got.labels == {"team": "c"}
        assert dict((await b.snapshot("sbx")).labels) == {"team": "c"}


async def test_tokens_are_stored_only_hashed(redis_server: RedisServer):
    secret = "sbx-token-" + "x7" * 16
    store = await redis_store(redis_server)
    try:
        await store.admit(record(token=secret, addresses=("198.18.0.7",)))
        await store.record_request("sbx", "a.example", "r1", 3)
        await store.reserve_out("sbx", 5, 5, None)
        dump = []
        async for key in store.redis.scan_iter(match=store.prefix + "*"):
            dump.append(key)
            kind = await store.redis.type(key)
            if kind == "hash":
                dump.extend(f"{k}={v}" for k, v in (await store.redis.hgetall(key)).items())
            elif kind == "set":
                dump.extend(await store.redis.smembers(key))
            elif kind == "string":
                dump.append(await store.redis.get(key))
        text = "\n".join(dump)
        assert hash_token(secret) in text  # positive control: the dump does hold the record
        assert secret not in text
    finally:
        await store.close()
