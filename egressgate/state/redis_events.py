"""The Redis backend's per-process record cache and the pub/sub subscription that keeps it honest.

Why a cache: every request re-reads its sandbox's record (identity.recheck), and a record does not
change except by admission (re-admitting an id) and revocation, both of which publish an event. So a
record may be served from memory exactly while this process is subscribed: the subscription delivers
every event in order on one TCP stream, and the only way to miss one is to lose that stream. When it
drops, the cache is emptied and bypassed (every read goes to Redis, where the record says revoked)
until the subscription is back; then the sandboxes this process had cached are checked once, and the
on_revoke callbacks run for any revoked in between (a connection held open across the outage is still
closed). A fetch racing an invalidation is not cached (`epoch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from egressgate.state.base import SandboxRecord
from egressgate.state.stall import LoopClock, overdue

logger = logging.getLogger(__name__)

PING_EVERY = 1.0  # seconds between pings on the subscription (a silent peer is noticed by DEAD_AFTER)
DEAD_AFTER = 5.0
BACKOFF_MIN, BACKOFF_MAX = 0.05, 1.0


class RecordCache:
    def __init__(self) -> None:
        self.live = False  # subscribed: events reach invalidate() and entries may be used
        self.epoch = 0  # bumped by every invalidation; a fetch that saw another epoch is not cached
        self.records: dict[str, SandboxRecord] = {}
        self.addresses: dict[str, str] = {}

    def record(self, sandbox_id: str) -> SandboxRecord | None:
        return self.records.get(sandbox_id) if self.live else None

    def by_address(self, address: str) -> SandboxRecord | None:
        if not self.live:
            return None
        sandbox_id = self.addresses.get(address)
        return self.records.get(sandbox_id) if sandbox_id is not None else None

    def put(self, record: SandboxRecord, epoch: int, address: str | None = None) -> None:
        if self.live and epoch == self.epoch:
            self.records[record.id] = record
            if address is not None:
                self.addresses[address] = record.id

    def invalidate(self, sandbox_id: str, addresses: tuple[str, ...] | list[str] = ()) -> None:
        self.epoch += 1
        self.records.pop(sandbox_id, None)
        for address in addresses:
            self.addresses.pop(address, None)

    def drop_all(self) -> set[str]:
        """Forget everything (the subscription is gone); return the ids that were cached."""
        self.live = False
        self.epoch += 1
        ids = set(self.records)
        self.records.clear()
        self.addresses.clear()
        return ids


class Subscriber:
    """Runs until cancelled: subscribe, deliver events, resubscribe with backoff after any failure."""

    def __init__(self, redis: Redis, channel: str, cache: RecordCache,
                 on_event: Callable[[str], None], on_resync: Callable[[set[str]], Awaitable[None]],
                 on_lost: Callable[[], Awaitable[None]]) -> None:
        self.redis = redis
        self.channel = channel
        self.cache = cache
        self.on_event = on_event
        self.on_resync = on_resync  # (ids cached before the drop) -> runs callbacks for revoked ones
        self.on_lost = on_lost  # the connection is gone: the pool's idle ones are likely stale too
        self.missed: set[str] = set()
        self.subscribed = asyncio.Event()  # set while live (tests and start-up wait on it)

    async def run(self) -> None:
        backoff = BACKOFF_MIN
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: drop the cache, resubscribe
                logger.warning("state: Redis subscription lost (%s); records are read from Redis until it is back", exc)
            finally:
                self.subscribed.clear()
                self.missed |= self.cache.drop_all()
                with contextlib.suppress(Exception):  # the connection is already broken
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await self.on_lost()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _listen(self, pubsub) -> None:
        # silence is measured in time this loop could run (state/stall.py): a loop stalled past DEAD_AFTER
        # while the pongs wait in the socket is not a dead subscription
        clock = LoopClock(PING_EVERY)
        rx_live, rx_wall = clock.now(), clock.wall
        last_ping = rx_wall
        while True:
            msg = await pubsub.get_message(timeout=PING_EVERY)
            live, now = clock.now(), clock.wall
            if msg is not None:
                rx_live, rx_wall = live, now
                kind = msg["type"]
                if kind == "subscribe":
                    await self.on_resync(self.missed)  # raises on a Redis error: resubscribe
                    self.missed = set()
                    self.cache.live = True
                    self.subscribed.set()
                elif kind == "message":
                    self.on_event(msg["data"])
            if now - last_ping >= PING_EVERY:
                await pubsub.ping()
                last_ping = now
            if overdue(clock, rx_live, rx_wall, DEAD_AFTER):
                raise ConnectionError(f"no answer on the subscription for {DEAD_AFTER:.0f} s")


class Revocations:
    """Who is told that a sandbox was revoked: the on_revoke callbacks (they close its connections). A
    revocation made here runs them at once (RedisState.revoke); one made by another process runs them
    when its published event arrives (`on_event`); one made while this process could not hear the
    subscription runs them when it is back (`resync`). Every event also invalidates the record cache."""

    def __init__(self, redis: Redis, cache: RecordCache, channel: str, worker_id: str,
                 record_key: Callable[[str], str]) -> None:
        self.redis = redis
        self.cache = cache
        self.channel = channel
        self.worker_id = worker_id
        self.record_key = record_key  # sandbox id -> its record's key
        self.callbacks: list[Callable[[str], None]] = []

    def run(self, sandbox_id: str) -> None:
        for callback in list(self.callbacks):
            try:
                callback(sandbox_id)
            except Exception:  # one failing subscriber must not keep the others from closing connections
                logger.exception("on_revoke callback failed for %s", sandbox_id)

    def on_event(self, data: str) -> None:
        try:
            event = json.loads(data)
            sandbox_id = str(event["id"])
        except (ValueError, KeyError, TypeError):
            logger.warning("state: ignoring a malformed event on %s", self.channel)
            self.cache.drop_all()  # cannot tell what it invalidates: forget everything
            self.cache.live = True
            return
        cached = self.cache.records.get(sandbox_id) is not None
        self.cache.invalidate(sandbox_id, tuple(event.get("addresses") or ()))
        if event.get("op") == "revoke" and event.get("w") != self.worker_id and (event.get("found", 1) or cached):
            self.run(sandbox_id)

    async def resync(self, ids: set[str]) -> None:
        """Back on the subscription: run callbacks for sandboxes revoked while we could not hear it."""
        if not ids:
            return
        ordered = sorted(ids)
        async with self.redis.pipeline(transaction=False) as pipe:
            for sandbox_id in ordered:
                pipe.hget(self.record_key(sandbox_id), "revoked")
            flags = await pipe.execute()
        for sandbox_id, flag in zip(ordered, flags, strict=True):
            if flag != "0":  # revoked, or gone (Redis restarted without its data): close its connections
                self.run(sandbox_id)
