"""ByteLedger: the sandbox's outbound byte budget, held by the state store and shared by every gateway process.

The store is the authority (PLAN-12: `reserve_out` / `settle_out`). A reservation is counted as spent the
moment it is granted and recorded as this worker's outstanding lease, so no set of processes can send more
than the budget, even one that dies mid-stream: its lease stays spent and `reconcile` (reconcile.py)
removes it, once. Two ways of paying:

* exact (`reserve`): a request whose size is known (head + Content-Length) reserves exactly that before
  anything is connected: it fits whole or it is refused (429, with the remaining figure).
* leased (`Meter`, meter.py): bytes whose total is unknown (a chunked or HTTP/2 body, websocket frames, raw TCP, a
  passthrough tunnel) are paid from a per-sandbox pool that this process fills from the store by leases of
  LEASE_MIN bytes, doubling up to LEASE_MAX while the sandbox keeps streaming, but never more than
  1/LEASE_SHARE of the budget (a granted lease counts as spent for every decision and every process, so a
  pool must not sit on much of a small budget; the store never grants more than remains anyway).
  `take` (the per-chunk path) is a few comparisons and additions: no await, no task.
  Only when the pool runs dry does the flow pause for `top_up` (the layers yield a blocking hook, the
  splice stops reading), and it is cut only when the store says not even that chunk fits.

Nothing reserved is lost: a flow's credit goes back to the pool when it ends, and a pool whose sandbox has
no open flow here is settled with the store (spent + unused), so `bytes_out` is exact when the sandbox is
idle. A pool left holding bytes without use (a flow that never reached its end hook, a quiet websocket)
is settled by `sweep` (run every second by reconcile.py) after one to two seconds of no use.

Writes after the fact (settle, add_in) are summed per sandbox and written once per event-loop tick (one
task for all of them), never one per chunk (issue 11); the in-process store (MemoryState) is written at
once instead, synchronously (a dict update needs no task: issue 25). On a shared store (Redis: a round
trip each) bytes in are not written on their own: they ride along with the sandbox's next write
(`reserve_request`, a settle) and the sweep writes what is left within a second (issue 25: two round
trips per request); they are a figure, no budget reads them. A settle that fails is not retried: after a timeout
the store may have applied it, and giving unused bytes back twice would let the sandbox exceed its
budget. A lost settle only overstates what was spent (fail closed); it is logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from egressgate.gateway.shared.meter import LEASE_MIN as LEASE_MIN  # re-exported (tests)
from egressgate.gateway.shared.meter import RETRY_DELAYS, SPENT_SETTLE, Meter, Pool
from egressgate.gateway.shared.meter import BudgetTopUpHook as BudgetTopUpHook  # re-exported: layers, tunnels
from egressgate.gateway.shared.meter import TopUp as TopUp  # re-exported
from egressgate.gateway.shared.meter import answer_top_up as answer_top_up  # re-exported: budgets.py
from egressgate.policy.facts import SandboxState
from egressgate.state.base import RequestGrant, StateStore
from egressgate.state.memory import MemoryState

logger = logging.getLogger(__name__)


class ByteLedger:
    """Outbound bytes paid from the store (module docstring); inbound bytes counted."""

    def __init__(self, state: StateStore) -> None:
        self.state = state
        # one process owns a memory store: no other process can hold a lease of it, nothing to wait for
        self.retry_delays: tuple[float, ...] = () if isinstance(state, MemoryState) else RETRY_DELAYS
        # a shared store pays a round trip per write: bytes in wait for the sandbox's next write (module doc)
        self.defer_in = not isinstance(state, MemoryState)
        # the in-process store (exactly MemoryState: a subclass may override its writes) is written at once,
        # synchronously, by the same sums: no per-tick callback and task (a loop iteration per request)
        self._direct = state if type(state) is MemoryState else None
        self._pools: dict[str, Pool] = {}
        self._dirty: set[str] = set()
        self._scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self.settle_failures = 0  # settles/add_ins the store refused (bytes_out overstated, never under)
        self.periodic: asyncio.Task | None = None  # reconcile.py's loop, stopped by flush()

    def _pool(self, sandbox_id: str) -> Pool:
        pool = self._pools.get(sandbox_id)
        if pool is None:
            pool = self._pools[sandbox_id] = Pool()
        return pool

    # ------------------------------------------------------------------ exact
    async def reserve(self, sandbox_id: str, amount: int, limit: int | None) -> bool:
        """Reserve exactly `amount` bytes (this process's pool first, then the store): True when they
        fit, False (nothing reserved) when they do not. Raises StateUnavailable."""
        pool = self._pool(sandbox_id)
        local = min(pool.avail, amount)
        pool.avail -= local
        rest = amount - local
        if rest <= 0:
            return True
        try:
            granted = await self.state.reserve_out(sandbox_id, rest, rest, limit)
        except BaseException:
            self.give_back(sandbox_id, local)
            raise
        if granted >= rest:
            self.give_back(sandbox_id, granted - rest)  # never more than asked; defensive
            return True
        self.give_back(sandbox_id, local + granted)  # granted is 0 (all or nothing); defensive
        return False

    async def reserve_request(
        self,
        sandbox_id: str,
        amount: int,
        limit: int | None,
        host: str,
        rule_id: str | None,
        *,
        requests_max: int | None = None,
        bytes_max: int | None = None,
    ) -> RequestGrant:
        """`reserve` and the store's `record_request` in one store step (StateStore.reserve_request): the
        request's `amount` bytes (this process's pool first, the rest from the store) and its entry in the
        history and its rule's usage, all or nothing. The bytes in summed since the last write go with it.
        Raises StateUnavailable (nothing reserved here; the bytes in it carried are not counted again)."""
        pool = self._pool(sandbox_id)
        local = min(pool.avail, amount)
        pool.avail -= local
        in_, pool.in_ = pool.in_, 0
        try:
            grant = await self.state.reserve_request(
                sandbox_id,
                host,
                rule_id,
                amount,
                amount - local,
                limit,
                requests_max=requests_max,
                bytes_max=bytes_max,
                add_in=in_,
            )
        except BaseException as exc:
            self.give_back(sandbox_id, local)
            if in_:  # not retried, like a failed add_in: it may have been counted
                self.settle_failures += 1
                logger.error("counting %d bytes in for %s failed: %s", in_, sandbox_id, exc)
            raise
        if grant.refused is not None:
            self.give_back(sandbox_id, local)
        return grant

    async def give_back_now(self, sandbox_id: str, pool: Pool) -> None:
        """Return what this pool holds to the store at once (not at the next tick): a flow here waits
        for budget that another process may need to finish first."""
        amount, pool.avail = pool.avail, 0
        if amount:
            try:
                await self.state.settle_out(sandbox_id, 0, amount)
            except Exception as exc:  # not retried (module docstring): stays overstated
                self.settle_failures += 1
                logger.error("giving %d unused bytes of %s back failed: %s", amount, sandbox_id, exc)

    def commit(self, sandbox_id: str, amount: int) -> None:
        """Reserved bytes were used (sent, or may have been): they stay spent."""
        if amount > 0:
            pool = self._pool(sandbox_id)
            pool.spent += amount
            if pool.spent >= SPENT_SETTLE:
                self._mark(sandbox_id)

    def give_back(self, sandbox_id: str, amount: int) -> None:
        """Reserved bytes that were not used: to a flow of this sandbox here, else back to the store."""
        if amount <= 0:
            return
        pool = self._pool(sandbox_id)
        if pool.users:
            pool.avail += amount
        else:
            pool.unused += amount
            self._mark(sandbox_id)

    def spent_view(self, snap: SandboxState) -> SandboxState:
        """The store's snapshot as decisions, records and the control API read it: bytes this process
        holds in leases but has not sent are not spent (the store counts a lease as spent the moment it
        is granted, so that no process can overbook; a decision must not deny what the budget still
        allows because a stream here holds a lease). Unchanged when nothing is held here."""
        pool = self._pools.get(snap.sandbox_id)
        if pool is None or not pool.avail:
            return snap
        return replace(snap, bytes_out=max(0, snap.bytes_out - pool.avail))

    def held(self, sandbox_id: str) -> int:
        """Bytes this process holds in the sandbox's pool, given to no flow (leased, not spent)."""
        pool = self._pools.get(sandbox_id)
        return pool.avail if pool is not None else 0

    async def remaining(self, sandbox_id: str, limit: int | None) -> int:
        """What this sandbox could still send from here (for the 429 message; a store read)."""
        if limit is None:
            return 0
        snap = await self.state.snapshot(sandbox_id, history=False, rules=())  # bytes_out only, no history
        pool = self._pools.get(sandbox_id)
        return max(0, limit - snap.bytes_out + (pool.avail if pool is not None else 0))

    # ------------------------------------------------------------------ leased
    def open(self, sandbox_id: str, limit: int | None) -> Meter:
        """A meter for one flow's bytes of unknown total (close it when the flow ends)."""
        pool = self._pool(sandbox_id)
        pool.users += 1
        return Meter(self, sandbox_id, pool, limit)

    def _idle(self, sandbox_id: str, pool: Pool) -> None:
        """No flow of the sandbox is open here: give the pool back, settle what was spent."""
        pool.unused += pool.avail
        pool.avail = 0
        if pool.unused or pool.spent:
            self._mark(sandbox_id, spent=True)

    # ------------------------------------------------------------------ in
    def add_in(self, sandbox_id: str, amount: int) -> None:
        if amount:
            if self._direct is not None:
                self._write_now(self._direct, sandbox_id, 0, 0, amount)
                return
            self._pool(sandbox_id).in_ += amount
            if not self.defer_in:
                self._mark(sandbox_id)

    # ------------------------------------------------------------------ store writes
    def _mark(self, sandbox_id: str, spent: bool = False) -> None:
        if spent:
            self._pool(sandbox_id).settle_spent = True
        self._dirty.add(sandbox_id)
        if self._direct is not None:
            self._drain()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Hand the summed deltas to the store: one tracked task per tick for every sandbox (the in-process
        store: written here and now)."""
        self._scheduled = False
        batch: list[tuple[str, int, int, int]] = []
        for sandbox_id in self._dirty:
            pool = self._pools.get(sandbox_id)
            if pool is None:
                continue
            spent = pool.spent if (pool.unused or pool.settle_spent or pool.spent >= SPENT_SETTLE) else 0
            pool.settle_spent = False
            unused = pool.unused
            in_ = pool.in_ if (spent or unused or pool.flush_in or not self.defer_in) else 0
            pool.flush_in = False
            pool.spent -= spent
            pool.unused = 0
            pool.in_ -= in_
            if spent or unused or in_:
                batch.append((sandbox_id, spent, unused, in_))
        self._dirty.clear()
        if batch and self._direct is not None:
            for item in batch:
                self._write_now(self._direct, *item)
        elif batch:
            task = asyncio.get_running_loop().create_task(self._write(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _write_now(self, state: MemoryState, sandbox_id: str, spent: int, unused: int, in_: int) -> None:
        try:
            if spent or unused:
                state.settle_out_now(sandbox_id, spent, unused)
            if in_:
                state.add_in_now(sandbox_id, in_)
        except Exception as exc:  # as _settle / _add_in: never retried, counted and logged
            self.settle_failures += 1
            logger.error(
                "writing %d spent / %d unused / %d in bytes of %s failed: %s", spent, unused, in_, sandbox_id, exc
            )

    async def _write(self, batch: list[tuple[str, int, int, int]]) -> None:
        await asyncio.gather(*(self._write_one(*item) for item in batch))

    async def _write_one(self, sandbox_id: str, spent: int, unused: int, in_: int) -> None:
        if (spent or unused) and in_:
            # both at once: issued in the same tick, they leave in one write to the store (one round trip)
            await asyncio.gather(self._settle(sandbox_id, spent, unused), self._add_in(sandbox_id, in_))
        elif in_:  # the common case in process (memory: bytes in after each response): no task of its own
            await self._add_in(sandbox_id, in_)
        else:
            await self._settle(sandbox_id, spent, unused)

    async def _settle(self, sandbox_id: str, spent: int, unused: int) -> None:
        if spent or unused:
            try:
                await self.state.settle_out(sandbox_id, spent, unused)
            except Exception as exc:  # not retried: it may have been applied (module docstring)
                self.settle_failures += 1
                logger.error(
                    "settling %d spent / %d unused bytes of %s failed (%s); its bytes_out stays "
                    "overstated until the lease is reconciled",
                    spent,
                    unused,
                    sandbox_id,
                    exc,
                )

    async def _add_in(self, sandbox_id: str, in_: int) -> None:
        if in_:
            try:
                await self.state.add_in(sandbox_id, in_)
            except Exception as exc:
                self.settle_failures += 1
                logger.error("counting %d bytes in for %s failed: %s", in_, sandbox_id, exc)

    def sweep(self) -> None:
        """Settle pools unused since the last sweep (bytes held by a flow that went quiet or never
        closed go back; a later chunk tops up again) and forget empty ones. Called every second."""
        for sandbox_id, pool in list(self._pools.items()):
            if pool.in_:  # bytes in waiting for a write (defer_in): written now, busy or not
                pool.flush_in = True
                self._mark(sandbox_id)
            if pool.used != pool.seen:
                pool.seen = pool.used
                continue
            if pool.fetching is not None:
                continue
            if pool.avail or pool.spent or pool.unused or pool.in_:
                pool.unused += pool.avail
                pool.avail = 0
                self._mark(sandbox_id, spent=True)
            elif not pool.users:
                del self._pools[sandbox_id]

    async def flush(self) -> None:
        """At stop: give every pool back, settle everything and wait for the writes."""
        if self.periodic is not None:
            self.periodic.cancel()
            self.periodic = None
        for sandbox_id, pool in self._pools.items():
            pool.unused += pool.avail
            pool.avail = 0
            if pool.spent or pool.unused or pool.in_:
                pool.flush_in = True
                self._mark(sandbox_id, spent=True)
        await self.flush_writes()

    async def flush_writes(self) -> None:
        """Write what is due now and wait for every write in flight."""
        if self._dirty:
            self._drain()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
