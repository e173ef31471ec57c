"""Redis timeouts that tell a stalled event loop from a slow Redis: the rule, in one place.

Why: a timeout measured in wall time also counts the time this process's event loop could not run (a
CPU hog on a busy host, a long synchronous step, GC, the process descheduled). When such a stall covers
a deadline, the connect or the reply it guarded has often completed in the kernel meanwhile, but when the
loop catches up asyncio fires the timer before the operation's own steps have run: a connect needs
several loop turns after its socket became writable, a command batched for the end of a tick is written
only after the stall, and a Redis starved by the same load answers a moment later. Failing then denies
legitimate traffic (`state_unavailable`) for a reason that is not Redis's, and starts the store's
back-off. (Measured with a forced 1.3 s stall: every request sharing the connect was denied "cannot
connect to Redis: ".)

The rule (`overdue`):
- A timeout counts only time during which the loop was able to run. A LoopClock is observed at least
  every `step` (= timeout / STEPS) while something waits; a gap between two observations longer than
  `step * (1 + LATE)` means the loop could not run, and only `step * (1 + LATE)` of it is counted.
- After such a stall, an operation is given at least one more `step` of running loop before it can be
  failed (what it waited for may have completed during the stall and not been processed yet).
- Bound: a Redis that does not answer (a blackholed connect, a SIGSTOP'd server) is failed after
  `timeout` seconds of running loop, i.e. within `timeout + step` with a live loop, and never later than
  CAP * timeout of wall time (+ one step, + however late the loop itself runs that check): a stall
  longer than that still fails the operation. Fail closed stays: an expired deadline is a failure.

Observed lateness only lengthens a wait (up to the cap), never shortens it: a check that fires on time
with the budget spent fails the operation as a plain timeout would.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import TimeoutError as RedisTimeoutError

STEPS = 8  # a timeout is observed this many times: step = timeout / STEPS
LATE = 0.5  # an observation later than step * (1 + LATE) after the previous one: the loop could not run
CAP = 4.0  # whatever the stalls, a deadline expires at CAP * timeout of wall time


class LoopClock:
    """Seconds during which this event loop was able to run, from observations (`now()`) that its owner
    makes at least every `step` while it waits (a longer gap is a stall: only `step * (1 + LATE)` of it
    counts). `stalls` counts the stalls seen (tests and logs read it)."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.allow = step * (1 + LATE)
        self.wall = time.monotonic()  # monotonic time of the last observation
        self.live = 0.0  # running-loop seconds up to the last observation
        self.stalls = 0
        self._stall_end = float("-inf")  # `live` when the last stall was seen

    def now(self) -> float:
        """Observe: the running-loop seconds so far."""
        wall = time.monotonic()
        gap, self.wall = wall - self.wall, wall
        if gap > self.allow:
            self.stalls += 1
            gap = self.allow
            self._stall_end = self.live + gap
        self.live += gap
        return self.live

    def resume(self) -> None:
        """Nothing observed this clock for a while because nothing waited: do not take that gap for a stall."""
        self.wall = time.monotonic()

    def settled(self) -> bool:
        """At least one `step` of running loop since the last stall seen (as of the last observation)."""
        return self.live - self._stall_end >= self.step


def overdue(clock: LoopClock, live_start: float, wall_start: float, timeout: float) -> bool:
    """THE rule (module docstring): has an operation that started at (`live_start`, `wall_start`) on
    `clock` run out of `timeout`? Call it right after `clock.now()`."""
    if clock.wall - wall_start >= CAP * timeout:
        return True
    return clock.live - live_start >= timeout and clock.settled()


class Deadline:
    """Calls `on_expire` once, when `timeout` is overdue by the rule; observes `clock` (its own, of step
    timeout / STEPS, unless one is shared) every step meanwhile. `clock.stalls` tells whether the loop
    stalled."""

    def __init__(
        self, timeout: float, on_expire: Callable[[], object] | None = None, *, clock: LoopClock | None = None
    ) -> None:
        self.timeout = timeout
        self.clock = clock or LoopClock(timeout / STEPS)
        self._live0, self._wall0 = self.clock.now(), self.clock.wall
        self._on_expire = on_expire
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(self.clock.step, self._tick)

    def _tick(self) -> None:
        self.clock.now()
        if overdue(self.clock, self._live0, self._wall0, self.timeout):
            self._handle = None
            if self._on_expire is not None:
                self._on_expire()
            return
        self._handle = self._loop.call_later(self.clock.step, self._tick)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


@contextlib.asynccontextmanager
async def timeout(seconds: float, what: str, clock: LoopClock | None = None) -> AsyncIterator[None]:
    """`asyncio.timeout(seconds)` with the deadline kept by the rule (on `clock` when given); on expiry the
    block is cancelled and TimeoutError(f"{what} within {seconds} s") raised (a cause one can read, not "")."""
    loop = asyncio.get_running_loop()
    scope = asyncio.timeout(None)
    try:
        async with scope:
            deadline = Deadline(seconds, lambda: scope.reschedule(loop.time()), clock=clock)
            try:
                yield
            finally:
                deadline.cancel()
    except TimeoutError:
        if scope.expired():
            raise TimeoutError(f"{what} within {seconds:g} s") from None
        raise


class BlockingPool(BlockingConnectionPool):
    """redis-py's blocking pool, with the rule applied to making a connection.

    redis-py bounds a connect (and the setup commands it sends on a new connection) with
    `asyncio.timeout` (redis/asyncio/connection.py: `_connect`, `read_response`), a wall-time timer this
    pool cannot replace: the same race. So a new connection whose making timed out while this loop was
    seen to stall (a clock observed every step, as in `Deadline`) is made once more; a second failure
    fails the operation (fail closed). Nothing of the caller's command has been sent before the pool
    hands the connection out, so this cannot run a command twice. What is not covered: a reply that a
    pool command (admission, approvals, heartbeat, the subscription; not the per-request operations,
    which use state/resp.py) awaits across a stall longer than its socket timeout is still a timeout,
    because that command may have run and is never resent."""

    stalled_connects = 0  # connections made again after a stall (tests read it)

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        kw = self.connection_kwargs
        watch = Deadline(max(kw.get("socket_connect_timeout") or 0.0, kw.get("socket_timeout") or 0.0) or 1.0)
        try:
            await super().ensure_connection(connection)
        except RedisTimeoutError:
            if not watch.clock.stalls:
                raise
            self.stalled_connects += 1
            await connection.disconnect()
            await super().ensure_connection(connection)
        finally:
            watch.cancel()
