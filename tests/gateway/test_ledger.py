"""ledger.ByteLedger over the real in-memory state store (PLAN-12's reserve_out / settle_out contract).

Exact reservations fit whole or not at all; leased streams never take more than the budget, even from
several ledgers (gateway processes) on one store at once; unused leases go back when flows end, so the
store's bytes_out is exact when idle; the per-chunk path makes no store call (leases of LEASE_MIN and
more, writes summed per tick)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from egressgate.gateway.shared.ledger import LEASE_MIN, RETRY_DELAYS, ByteLedger
from egressgate.state.base import SandboxRecord, StateUnavailable
from egressgate.state.memory import MemoryState


class CountingState(MemoryState):
    """The real in-memory store, counting the calls it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {"reserve_out": 0, "settle_out": 0, "add_in": 0}

    async def reserve_out(self, sandbox_id: str, want: int, minimum: int, limit: int | None) -> int:
        self.calls["reserve_out"] += 1
        await asyncio.sleep(0)  # a round trip: other flows run meanwhile
        return await super().reserve_out(sandbox_id, want, minimum, limit)

    async def settle_out(self, sandbox_id: str, spent: int, unused: int) -> None:
        self.calls["settle_out"] += 1
        await super().settle_out(sandbox_id, spent, unused)

    async def add_in(self, sandbox_id: str, amount: int) -> None:
        self.calls["add_in"] += 1
        await super().add_in(sandbox_id, amount)


async def _state(*ids: str, cls: type[MemoryState] = CountingState) -> CountingState:
    state = cls()
    for sid in ids or ("sbx-a",):
        await state.admit(SandboxRecord(id=sid, token_hash="x", policy_name="p", admitted_at=time.time()))
    return state


# CountingState (a subclass: its writes may be overridden) is written by the per-tick task; MemoryState itself
# is written at once, synchronously (ledger._write_now): both must count exactly the same
BOTH_PATHS = pytest.mark.parametrize("cls", [CountingState, MemoryState], ids=["per-tick", "direct"])


async def _out(state: MemoryState, sid: str = "sbx-a") -> int:
    return (await state.snapshot(sid)).bytes_out


@BOTH_PATHS
async def test_exact_reservation_fits_whole_or_not_at_all(cls: type[MemoryState]) -> None:
    state = await _state(cls=cls)
    ledger = ByteLedger(state)
    assert await ledger.reserve("sbx-a", 600, 1000)
    assert not await ledger.reserve("sbx-a", 401, 1000)  # one byte too many: nothing taken
    assert await _out(state) == 600
    assert await ledger.remaining("sbx-a", 1000) == 400
    assert await ledger.reserve("sbx-a", 400, 1000)  # exactly the rest
    assert await _out(state) == 1000
    ledger.give_back("sbx-a", 400)  # refused later (a refund): returned to the store
    ledger.commit("sbx-a", 600)
    await ledger.flush()
    assert await _out(state) == 600


async def test_many_chunks_make_no_store_call_per_chunk() -> None:
    state = await _state("sbx-a", "sbx-b")
    ledger = ByteLedger(state)
    meter = ledger.open("sbx-a", None)
    assert not meter.take(10)  # an empty pool: the flow pauses for a top-up
    assert await meter.top_up(10)
    for _ in range(1000):
        assert meter.take(10) or (await meter.top_up(10) and meter.take(10))
        ledger.add_in("sbx-a", 3)
        ledger.add_in("sbx-b", 1)
    # leases double from LEASE_MIN (4 KiB): 4 + 8 KiB cover 10 000 bytes; never one call per chunk
    assert state.calls["reserve_out"] == 2
    meter.close()
    await ledger.flush()
    # summed per sandbox per tick (a tick passes at each top-up here): a handful of writes, not 3000
    assert state.calls["settle_out"] == 1 and state.calls["add_in"] <= 2 * (state.calls["reserve_out"] + 1)
    snap_a, snap_b = await state.snapshot("sbx-a"), await state.snapshot("sbx-b")
    assert (snap_a.bytes_out, snap_a.bytes_in, snap_b.bytes_in) == (10_000, 3000, 1000)


@BOTH_PATHS
async def test_a_stream_never_passes_the_limit_and_gives_the_rest_back(cls: type[MemoryState]) -> None:
    state = await _state(cls=cls)
    ledger = ByteLedger(state)
    meter = ledger.open("sbx-a", 100)
    sent = 0
    while True:
        if not meter.take(7) and not (await meter.top_up(7) and meter.take(7)):
            break
        sent += 7
    assert sent == 98
    assert await _out(state) <= 100  # leases held: counted as spent, never more than the limit
    meter.close()
    await ledger.flush()
    assert await _out(state) == 98  # exact once idle


@BOTH_PATHS
async def test_two_ledgers_on_one_store_hold_one_budget_exactly(cls: type[MemoryState]) -> None:
    """Two gateway processes (ledgers) on one store, 64 concurrent streams split between them, random
    chunk sizes: what they send together never passes the limit, and the store is exact when idle."""
    limit = 300_000
    state = await _state(cls=cls)
    ledgers = [ByteLedger(state), ByteLedger(state)]
    sent = [0] * 64
    rng = random.Random(12)

    async def stream(i: int) -> None:
        meter = ledgers[i % 2].open("sbx-a", limit)
        try:
            while True:
                n = rng.randint(1, 9000)
                if not meter.take(n) and not (await meter.top_up(n) and meter.take(n)):
                    return
                sent[i] += n
                await asyncio.sleep(0)
        finally:
            meter.close()

    await asyncio.gather(*(stream(i) for i in range(64)))
    for ledger in ledgers:
        await ledger.flush()
    assert sum(sent) <= limit
    assert limit - sum(sent) < 9000 * 64  # nobody stopped while plenty remained
    assert await _out(state) == sum(sent)


@BOTH_PATHS
async def test_concurrent_exact_reservations_never_overbook(cls: type[MemoryState]) -> None:
    state = await _state(cls=cls)
    ledgers = [ByteLedger(state), ByteLedger(state)]
    results = await asyncio.gather(*(ledgers[i % 2].reserve("sbx-a", 1000, 10_500) for i in range(64)))
    assert results.count(True) == 10
    assert await _out(state) == 10_000


async def test_one_top_up_in_flight_per_pool() -> None:
    state = await _state()
    ledger = ByteLedger(state)
    meters = [ledger.open("sbx-a", None) for _ in range(20)]
    results = await asyncio.gather(*(m.top_up(100) for m in meters))
    assert all(results)
    assert state.calls["reserve_out"] == 1  # the others waited for that lease and shared it
    assert all(m.take(100) for m in meters)
    for m in meters:
        m.close()
    await ledger.flush()
    assert await _out(state) == 2000


@BOTH_PATHS
async def test_an_idle_pool_goes_back_by_sweep(cls: type[MemoryState]) -> None:
    state = await _state(cls=cls)
    ledger = ByteLedger(state)
    meter = ledger.open("sbx-a", None)  # a flow that never closes (a quiet websocket, a missed end hook)
    assert await meter.top_up(10) and meter.take(10)
    assert await _out(state) == LEASE_MIN
    ledger.sweep()  # active since the last sweep: kept
    await ledger.flush_writes()
    assert await _out(state) == LEASE_MIN
    ledger.sweep()  # no use since: given back
    await ledger.flush_writes()
    assert await _out(state) == 10
    assert meter.take(10) is False  # the flow tops up again when it speaks
    assert await meter.top_up(10) and meter.take(10)
    meter.close()
    await ledger.flush()
    assert await _out(state) == 20


class FailingSettle(CountingState):
    async def settle_out(self, sandbox_id: str, spent: int, unused: int) -> None:
        self.calls["settle_out"] += 1
        raise StateUnavailable("planted outage")


async def test_a_failed_settle_is_not_retried_and_only_overstates() -> None:
    """Retrying an ambiguous settle could give unused bytes back twice (over budget); a lost one leaves
    bytes_out too high (fail closed)."""
    state = FailingSettle()
    await state.admit(SandboxRecord(id="sbx-a", token_hash="x", policy_name="p", admitted_at=time.time()))
    ledger = ByteLedger(state)
    meter = ledger.open("sbx-a", None)
    assert await meter.top_up(10) and meter.take(10)
    meter.close()
    await ledger.flush()
    await ledger.flush()
    assert state.calls["settle_out"] == 1 and ledger.settle_failures == 1
    assert await _out(state) == LEASE_MIN >= 10


async def test_a_refused_top_up_waits_for_other_processes_leases() -> None:
    """Two ledgers (processes) on one store. B's stream needs bytes that are all in A's lease; A's flow
    ends a moment later and gives them back: B's top-up, refused at first, succeeds on a retry instead of
    cutting a stream while budget remains. And a pool that cannot proceed gives back what it holds, so
    another process's smaller need is served."""
    state = await _state()
    a, b = ByteLedger(state), ByteLedger(state)
    for ledger in (a, b):
        ledger.retry_delays = RETRY_DELAYS  # a shared store (the memory store of one process has none)
    meter_a = a.open("sbx-a", 10_000)
    assert await meter_a.top_up(8000) and meter_a.take(1000)  # A holds 7000 it will not use
    meter_b = b.open("sbx-a", 10_000)
    asyncio.get_running_loop().call_later(0.1, meter_a.close)
    assert await meter_b.top_up(5000) and meter_b.take(5000)  # waited for A's lease to come back
    await a.flush()
    # 4000 left: B's pool takes 3000 of it but then needs 5000; A's next flow needs 3000. B cannot
    # proceed and gives its 3000 back, so A's is served (without the give-back both would fail)
    assert await meter_b.top_up(3000)
    meter_c = a.open("sbx-a", 10_000)
    got = await asyncio.gather(meter_b.top_up(5000), meter_c.top_up(3000))
    assert got == [False, True] and meter_c.take(3000)
    for meter in (meter_b, meter_c):
        meter.close()
    await a.flush()
    await b.flush()
    assert await _out(state) == 9000  # exact: 1000 + 5000 + 3000


async def test_without_a_shared_store_a_refusal_is_final_at_once() -> None:
    state = await _state()
    ledger = ByteLedger(state)
    assert ledger.retry_delays == ()  # one process owns a memory store: nothing to wait for
    meter = ledger.open("sbx-a", 100)
    started = time.monotonic()
    assert not await meter.top_up(101)
    assert time.monotonic() - started < 0.5


async def test_the_in_process_store_is_written_at_once() -> None:
    """The ledger writes MemoryState itself synchronously: bytes in, settles and give-backs are in the store
    when the call returns, with no task and no loop iteration (issue 25: the per-tick task was one loop
    iteration per request). Positive control: a subclass, whose writes may be overridden, still gets
    them from the per-tick task (not yet there when the call returns)."""
    for cls, direct in ((MemoryState, True), (CountingState, False)):
        state = await _state(cls=cls)
        ledger = ByteLedger(state)
        tasks = len(asyncio.all_tasks())
        ledger.add_in("sbx-a", 5)
        assert await ledger.reserve("sbx-a", 300, None)  # exact: nothing held, straight from the store
        ledger.give_back("sbx-a", 100)  # no flow of the sandbox here: back to the store
        ledger.commit("sbx-a", 200)
        meter = ledger.open("sbx-a", None)
        assert await meter.top_up(10) and meter.take(10)
        meter.close()  # the last flow: the pool's lease is settled (spent 10, the rest unused)
        snap = state._bytes["sbx-a"]  # read without an await: no tick may pass before this
        assert (snap == [210, 5]) is direct, (cls, snap)
        assert (len(asyncio.all_tasks()) == tasks and not ledger._tasks) is direct
        await ledger.flush()
        assert state._bytes["sbx-a"] == [210, 5]  # either way the same figures once written
        assert ledger.settle_failures == 0
