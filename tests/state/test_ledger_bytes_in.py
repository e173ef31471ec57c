"""Bytes received from upstream, counted without a Redis round trip of their own (gateway/shared/ledger.py).

On a shared store the ledger keeps a sandbox's bytes in until its next write (`reserve_request`, a
settle) or the next sweep (every second, gateway/service/reconcile.py), so a request costs two round trips
instead of three. Real Redis; control: the in-process store is written at the next tick as before.
"""

from __future__ import annotations

import asyncio

import pytest

from egressgate.gateway.shared.ledger import ByteLedger
from egressgate.state.base import StateUnavailable
from egressgate.state.memory import MemoryState
from tests.state.helpers import record, redis_store
from tests.support.redis import RedisServer


async def _ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_bytes_in_ride_with_the_next_write(redis_server: RedisServer):
    store = await redis_store(redis_server)
    try:
        await store.admit(record())
        ledger = ByteLedger(store)
        for _ in range(5):
            ledger.add_in("sbx", 100)
        await _ticks()
        await ledger.flush_writes()
        assert (await store.snapshot("sbx")).bytes_in == 0  # not written on their own
        grant = await ledger.reserve_request("sbx", 10, None, "a.example", None)
        assert grant.refused is None
        snap = await store.snapshot("sbx")
        assert (snap.bytes_in, snap.bytes_out, snap.seen_hosts) == (500, 10, frozenset({"a.example"}))
        ledger.add_in("sbx", 7)
        ledger.sweep()  # what no write took along is written by the sweep
        await ledger.flush_writes()
        assert (await store.snapshot("sbx")).bytes_in == 507
        ledger.add_in("sbx", 3)
        await ledger.flush()  # and at stop
        assert (await store.snapshot("sbx")).bytes_in == 510
        assert ledger.settle_failures == 0
    finally:
        await store.close()


async def test_a_failed_step_does_not_count_its_bytes_in_twice(tmp_path):
    """The step that carried them failed (Redis stopped): they may or may not have been counted, so they
    are not sent again (like a failed add_in), and the failure is counted; the request is refused."""
    with RedisServer(tmp_path / "redis") as server:
        store = await redis_store(server)
        try:
            await store.admit(record())
            ledger = ByteLedger(store)
            ledger.add_in("sbx", 40)
            server.stop()
            with pytest.raises(StateUnavailable):
                await ledger.reserve_request("sbx", 10, None, "a.example", None)
            assert ledger.settle_failures == 1
            server.start()
            await ledger.flush()
            assert ledger.settle_failures == 1  # nothing left to write again
            snap = None
            for _ in range(200):  # the store reconnects by itself after its backoff
                try:
                    snap = await store.snapshot("sbx")
                    break
                except StateUnavailable:
                    await asyncio.sleep(0.05)
            assert snap is not None, "the store did not reconnect"
            assert snap.bytes_in == 0 and snap.bytes_out == 0 and not snap.seen_hosts  # nothing ran
        finally:
            await store.close()


async def test_control_the_in_process_store_is_written_at_the_next_tick():
    store = MemoryState()
    await store.admit(record())
    ledger = ByteLedger(store)
    ledger.add_in("sbx", 100)
    await _ticks()
    await ledger.flush_writes()
    assert (await store.snapshot("sbx")).bytes_in == 100
