"""ByteLedger: the sandbox's outbound byte budget, held by the state store and shared by every gateway process.

The store is the authority (PLAN-12: `reserve_out` / `settle_out`). A reservation is counted as spent the
moment it is granted and recorded as this worker's outstanding lease, so no set of processes can send more
than the budget, even one that dies mid-stream: its lease stays spent and `reconcile` (reconcile.py)
removes it, once. Two ways of paying:

* exact (`reserve`): a request whose size is known (head + Content-Length) reserves exactly that before
  anything is connected: it fits whole or it is refused (429, with the remaining figure).
* leased (`Meter`): bytes whose total is unknown (a chunked or HTTP/2 body, websocket frames, raw TCP, a
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
from dataclasses import dataclass, replace
from typing import Any

from mitmproxy.proxy.commands import StartHook

from egressgate.policy.facts import SandboxState
from egressgate.state.base import RequestGrant, StateStore, StateUnavailable
from egressgate.state.memory import MemoryState

logger = logging.getLogger(__name__)

LEASE_MIN = 4 * 1024  # first lease of a sandbox's pool: a short flow holds little it will not send
LEASE_MAX = 256 * 1024  # leases double up to this while the pool keeps running dry
# ... and never more than this share of the budget: a lease is counted as spent the moment it is granted
# (every decision and every other process sees it so), so a pool may not sit on much of a small budget
LEASE_SHARE = 16
SPENT_SETTLE = 1024 * 1024  # settle spent bytes once this many accumulate (keeps the lease record small)
# A shared store (several processes) that has no room may still have budget in other processes' leases,
# which come back when their flows end or go idle (sweep: within 2 s). A top-up it refuses is retried after
# these pauses (the stream stays paused, nothing is sent) before the stream is cut: ~2.6 s in all.
RETRY_DELAYS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0)


class _Pool:
    """This process's share of one sandbox's budget."""

    __slots__ = ("avail", "fetching", "flush_in", "in_", "lease", "seen", "settle_spent", "spent", "unused", "used",
                 "users")

    def __init__(self) -> None:
        self.avail = 0  # reserved from the store, given to no flow yet
        self.spent = 0  # sent, not yet settled as spent
        self.unused = 0  # to give back to the store
        self.in_ = 0  # bytes in, not yet written
        self.users = 0  # open meters
        self.fetching: asyncio.Future | None = None  # a top-up in flight (one per pool at a time)
        self.lease = LEASE_MIN
        self.used = 0  # activity counter (bumped per take; sweep compares it with `seen`)
        self.seen = 0
        self.settle_spent = False  # the next write settles `spent` too (idle, swept, or past SPENT_SETTLE)
        self.flush_in = False  # the next write counts `in_` even when nothing else is written (sweep, flush)


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
        self._pools: dict[str, _Pool] = {}
        self._dirty: set[str] = set()
        self._scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self.settle_failures = 0  # settles/add_ins the store refused (bytes_out overstated, never under)
        self.periodic: asyncio.Task | None = None  # reconcile.py's loop, stopped by flush()

    def _pool(self, sandbox_id: str) -> _Pool:
        pool = self._pools.get(sandbox_id)
        if pool is None:
            pool = self._pools[sandbox_id] = _Pool()
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

    async def reserve_request(self, sandbox_id: str, amount: int, limit: int | None, host: str,
                              rule_id: str | None, *, requests_max: int | None = None,
                              bytes_max: int | None = None) -> RequestGrant:
        """`reserve` and the store's `record_request` in one store step (StateStore.reserve_request): the
        request's `amount` bytes (this process's pool first, the rest from the store) and its entry in the
        history and its rule's usage, all or nothing. The bytes in summed since the last write go with it.
        Raises StateUnavailable (nothing reserved here; the bytes in it carried are not counted again)."""
        pool = self._pool(sandbox_id)
        local = min(pool.avail, amount)
        pool.avail -= local
        in_, pool.in_ = pool.in_, 0
        try:
            grant = await self.state.reserve_request(sandbox_id, host, rule_id, amount, amount - local, limit,
                                                     requests_max=requests_max, bytes_max=bytes_max, add_in=in_)
        except BaseException as exc:
            self.give_back(sandbox_id, local)
            if in_:  # not retried, like a failed add_in: it may have been counted
                self.settle_failures += 1
                logger.error("counting %d bytes in for %s failed: %s", in_, sandbox_id, exc)
            raise
        if grant.refused is not None:
            self.give_back(sandbox_id, local)
        return grant

    async def give_back_now(self, sandbox_id: str, pool: _Pool) -> None:
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

    def _idle(self, sandbox_id: str, pool: _Pool) -> None:
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
            logger.error("writing %d spent / %d unused / %d in bytes of %s failed: %s", spent, unused, in_,
                         sandbox_id, exc)

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
                logger.error("settling %d spent / %d unused bytes of %s failed (%s); its bytes_out stays "
                             "overstated until the lease is reconciled", spent, unused, sandbox_id, exc)

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


class Meter:
    """One flow's outbound bytes of unknown total, paid from its sandbox's pool (module docstring).

    `credit` is what this flow has taken from the pool but not sent yet (HTTP bodies: the layer covers
    each chunk as it arrives, the stream callable spends it, possibly later: the phantom guard holds
    bytes back)."""

    __slots__ = ("closed", "credit", "failed", "ledger", "limit", "pool", "sandbox_id")

    def __init__(self, ledger: ByteLedger, sandbox_id: str, pool: _Pool, limit: int | None) -> None:
        self.ledger, self.sandbox_id, self.pool, self.limit = ledger, sandbox_id, pool, limit
        self.credit = 0
        self.closed = False
        self.failed: str | None = None  # "state_unavailable": a top-up failed for the store, not the budget

    def cover(self, n: int) -> bool:
        """Set `n` more bytes aside for this flow (pool -> credit); False when the pool cannot (top up).
        The HTTP layer covers every body chunk as it arrives; the stream callable spends the credit as
        the bytes go out, which may be later (the phantom guard holds a tail back)."""
        pool = self.pool
        if pool.avail < n or self.closed:
            return False
        pool.avail -= n
        self.credit += n
        return True

    def take(self, n: int) -> bool:
        """`n` bytes go out now: paid from the credit, else the pool; False when neither holds them."""
        credit = self.credit
        if credit >= n:
            self.credit = credit - n
        else:
            pool = self.pool
            if pool.avail < n - credit or self.closed:
                return False
            pool.avail -= n - credit
            self.credit = 0
        pool = self.pool
        pool.spent += n
        pool.used += 1
        return True

    async def top_up(self, n: int) -> bool:
        """Pause point: make the pool hold `n` bytes for this flow, from the store. True when it does
        (cover or take them before the next await); False when the store says the budget cannot hold
        them. Raises StateUnavailable. One reservation per pool at a time; concurrent flows wait for it
        and then look again.

        A refusal of a shared store is not final at once: leases other processes hold (and the bytes
        this pool holds, given back first so that they can finish) come back when their flows end, so
        the refused top-up is retried after RETRY_DELAYS. Only when the store still refuses is the
        budget spent for this chunk."""
        pool = self.pool
        retries = iter(self.ledger.retry_delays)
        while pool.avail < n:
            if self.closed:
                return False
            if pool.fetching is not None:
                await asyncio.shield(pool.fetching)
                continue
            shortfall = n - pool.avail
            lease = pool.lease if self.limit is None else min(pool.lease, self.limit // LEASE_SHARE)
            fetching = pool.fetching = asyncio.get_running_loop().create_future()
            try:
                granted = await self.ledger.state.reserve_out(self.sandbox_id, max(shortfall, lease),
                                                              shortfall, self.limit)
            finally:
                pool.fetching = None
                fetching.set_result(None)
            if granted <= 0:
                delay = next(retries, None)
                if delay is None or self.closed:
                    return False
                await self.ledger.give_back_now(self.sandbox_id, pool)
                await asyncio.sleep(delay)
                continue
            pool.lease = min(LEASE_MAX, pool.lease * 2)
            pool.avail += granted
            if pool.spent >= SPENT_SETTLE:  # a long stream: keep its lease record small (once per lease)
                self.ledger._mark(self.sandbox_id)
            if not pool.users:  # every flow ended while the lease was on its way
                self.ledger._idle(self.sandbox_id, pool)
                return False
        return not self.closed

    def close(self) -> None:
        """The flow ended: its credit goes back; the last flow of the sandbox here settles the pool."""
        if self.closed:
            return
        self.closed = True
        pool = self.pool
        pool.avail += self.credit
        self.credit = 0
        pool.users -= 1
        if pool.users <= 0:
            pool.users = 0
            self.ledger._idle(self.sandbox_id, pool)


@dataclass(slots=True)
class TopUp:
    """A flow paused until its meter covers `size` more bytes (`ok`: they are in its credit)."""

    flow: Any  # http.HTTPFlow | tcp.TCPFlow: failclosed.py refuses the flow a crashed hook was guarding
    meter: Meter
    size: int
    ok: bool = False
    error: str | None = None

    @property
    def client_conn(self) -> Any:  # failclosed.py aborts this client when the hook crashes
        return self.flow.client_conn


@dataclass
class BudgetTopUpHook(StartHook):
    """Blocking: the layer that yields it (http_layer.py, passthrough.py) pauses — its events queue,
    nothing is dropped — until the Budgets addon has topped up the meter (or found the budget spent)."""

    top: TopUp


async def answer_top_up(top: TopUp) -> None:
    """What the Budgets addon does with a BudgetTopUpHook (fail closed: a store error is no coverage)."""
    try:
        top.ok = await top.meter.top_up(top.size) and top.meter.cover(top.size)  # no await in between
    except StateUnavailable as exc:
        top.ok, top.error = False, "state_unavailable"
        top.meter.failed = top.error
        logger.error("topping up the byte budget of %s failed: %s; cutting the stream", top.meter.sandbox_id, exc)
