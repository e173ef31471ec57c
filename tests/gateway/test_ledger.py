"""budgets.ByteLedger: exact, synchronous counters; the store write-through is coalesced per loop tick.

A task per counted chunk (the old write-through) cost ~16 µs per chunk; the ledger now hands the store
one summed delta per sandbox per tick. The totals must not change, and nothing may be lost at flush."""

from __future__ import annotations

import asyncio
import time

from egressgate.gateway.budgets import ByteLedger
from egressgate.state.base import SandboxRecord
from egressgate.state.memory import MemoryState


class CountingState(MemoryState):
    """The real in-memory store, counting the write-through calls it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def add_bytes(self, sandbox_id: str, out: int = 0, in_: int = 0) -> tuple[int, int]:
        self.calls += 1
        return await super().add_bytes(sandbox_id, out=out, in_=in_)


async def _ledger() -> tuple[CountingState, ByteLedger]:
    state = CountingState()
    for sid in ("sbx-a", "sbx-b"):
        await state.admit(SandboxRecord(id=sid, token_hash="x", policy_name="p", admitted_at=time.time()))
    ledger = ByteLedger(state)
    await ledger.load("sbx-a")
    await ledger.load("sbx-b")
    return state, ledger


async def test_many_chunks_in_one_tick_are_one_store_write_per_sandbox() -> None:
    state, ledger = await _ledger()
    for _ in range(1000):
        assert ledger.try_out("sbx-a", 10, None)
        ledger.add_in("sbx-a", 3)
        ledger.add_in("sbx-b", 1)
    ledger.refund_out("sbx-a", 10)
    assert ledger.bytes_out("sbx-a") == 9990  # the in-process counters are exact at once
    await ledger.flush()
    assert state.calls == 2  # one per sandbox, not 3001
    snap_a, snap_b = await state.snapshot("sbx-a"), await state.snapshot("sbx-b")
    assert (snap_a.bytes_out, snap_a.bytes_in, snap_b.bytes_in) == (9990, 3000, 1000)


async def test_writes_across_ticks_all_reach_the_store_and_the_limit_is_exact() -> None:
    state, ledger = await _ledger()
    total = 0
    for _ in range(5):
        while ledger.try_out("sbx-a", 7, 100):
            total += 7
        await asyncio.sleep(0)  # let the scheduled write-through run
    assert total == 98 and not ledger.try_out("sbx-a", 3, 100)
    await ledger.flush()
    assert (await state.snapshot("sbx-a")).bytes_out == 98
    assert 1 <= state.calls <= 5
