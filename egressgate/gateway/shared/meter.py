"""The leased half of the byte budget (ledger.py): a flow's `Meter` over its sandbox's `Pool`, and the pause
a flow takes when the pool runs dry (`BudgetTopUpHook`, answered by `answer_top_up`).

Split from ledger.py (which keeps the store side: exact reservations, the per-sandbox pools' writes,
sweep and flush) because this is the per-chunk path: `take` and `cover` are a few comparisons and
additions, no await and no task; only `top_up` talks to the store, one reservation per pool at a time.
The lease sizes are here too: how much a pool asks for is this module's decision.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mitmproxy.proxy.commands import StartHook

from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.gateway.shared.ledger import ByteLedger

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


class Pool:
    """This process's share of one sandbox's budget."""

    __slots__ = (
        "avail",
        "fetching",
        "flush_in",
        "in_",
        "lease",
        "seen",
        "settle_spent",
        "spent",
        "unused",
        "used",
        "users",
    )

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


class Meter:
    """One flow's outbound bytes of unknown total, paid from its sandbox's pool (module docstring).

    `credit` is what this flow has taken from the pool but not sent yet (HTTP bodies: the layer covers
    each chunk as it arrives, the stream callable spends it, possibly later: the phantom guard holds
    bytes back)."""

    __slots__ = ("closed", "credit", "failed", "ledger", "limit", "pool", "sandbox_id")

    def __init__(self, ledger: ByteLedger, sandbox_id: str, pool: Pool, limit: int | None) -> None:
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
                granted = await self.ledger.state.reserve_out(
                    self.sandbox_id, max(shortfall, lease), shortfall, self.limit
                )
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
