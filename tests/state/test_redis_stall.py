"""A stalled event loop is not a slow Redis (state/stall.py), and a Redis that does not answer is still
refused within the stated bound.

Every stall here is forced, never hoped for: `time.sleep` queued on the loop so that it runs in the
same loop turn as the operation's first step, after the operation started its connect (or queued its
command) and before the loop could process the result. Without the rule each of the `succeeds` tests
fails every time ("cannot connect to Redis: ", "Redis did not answer within 2 s", "Timeout connecting
to server"); the refusals are the other side: a blackholed connect (a listener of the test's own whose
accept queue is full: the kernel drops the SYNs) and a SIGSTOP'd redis-server. Upper bounds are the
product's (CAP x timeout + one step) plus a generous allowance for this loop's own lateness on a loaded
host; lower bounds show nothing is refused before its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.state.base import StateUnavailable
from egressgate.state.redis import CONNECT_TIMEOUT, SOCKET_TIMEOUT, RedisState
from egressgate.state.redis_events import DEAD_AFTER, PING_EVERY
from egressgate.state.stall import CAP, STEPS
from tests.state.helpers import record, redis_store
from tests.support.redis import RedisServer

LATENESS = 2.0  # s: this loop's own scheduling delay on a loaded host, allowed on top of a product bound
STALLS = [CONNECT_TIMEOUT + 0.3, SOCKET_TIMEOUT + 0.3]  # longer than the connect's, longer than a reply's


def _bound(timeout: float) -> float:
    """The latest a Redis that does not answer is refused (state/stall.py), in wall seconds."""
    return CAP * timeout + SOCKET_TIMEOUT / STEPS


def _stall_next_turn(seconds: float) -> None:
    """Block the loop for `seconds` in the next loop turn, after the steps of the tasks already queued."""
    asyncio.get_running_loop().call_soon(time.sleep, seconds)


async def _refused_after(operation, stall: float, match: str) -> float:
    """Start `operation`, stall the loop for `stall` s in the next turn (0: none), expect StateUnavailable
    matching `match`; returns the seconds it took to be refused."""
    pending = asyncio.ensure_future(operation)
    if stall:
        _stall_next_turn(stall)
    started = time.monotonic()
    with pytest.raises(StateUnavailable, match=match):
        await pending
    return time.monotonic() - started


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A loopback port whose connects never complete: a listener that never accepts, its accept queue
    filled, so the kernel drops further SYNs. Shown: a plain connect to it times out."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        with pytest.raises(TimeoutError):  # positive control: it really never connects
            socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT).close()
        yield port
    finally:
        for sock in (*fillers, listener):
            sock.close()


@pytest.mark.parametrize("stall", STALLS)
async def test_a_connect_across_a_stall_succeeds(redis_server: RedisServer, stall: float):
    """The burst's tasks start the hot-path connect, then the loop stalls: the connect completed in the
    kernel meanwhile, and every request sharing it is served (no denial, no back-off)."""
    store = await redis_store(redis_server)
    try:
        await store.admit(record())
        assert store._conn._proto is None  # the burst makes the hot-path connection
        burst = [asyncio.ensure_future(store.reserve_out("sbx", 1, 1, None)) for _ in range(12)]
        burst.append(asyncio.ensure_future(store.snapshot("sbx")))
        _stall_next_turn(stall)
        started = time.monotonic()
        results = await asyncio.gather(*burst, return_exceptions=True)
        assert time.monotonic() - started >= stall  # the stall happened
        assert [r for r in results if isinstance(r, BaseException)] == [] and store.errors == 0
        assert results[:12] == [1] * 12 and results[12].sandbox_id == "sbx"
        assert store._conn.clock.stalls >= 1  # the rule, not luck, kept the connect
        assert await store.reserve_out("sbx", 1, 1, None) == 1  # no back-off either
    finally:
        await store.close()


@pytest.mark.parametrize("stall", [SOCKET_TIMEOUT + 0.3])
async def test_a_reply_across_a_stall_succeeds(redis_server: RedisServer, stall: float):
    """Two operations in one loop turn: the first is written at once, the second queued for the end of
    the turn; the stall runs between them, so the second command leaves only after it. Its reply is
    awaited for longer than SOCKET_TIMEOUT of wall time, yet the connection is not given up."""
    store = await redis_store(redis_server)
    try:
        await store.admit(record())
        assert await store.reserve_out("sbx", 1, 1, None) == 1  # the hot-path connection is open
        first = asyncio.ensure_future(store.reserve_out("sbx", 1, 1, None))
        second = asyncio.ensure_future(store.snapshot("sbx"))
        _stall_next_turn(stall)
        started = time.monotonic()
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert time.monotonic() - started >= stall
        assert results[0] == 1 and not isinstance(results[1], BaseException), results
        assert results[1].bytes_out == 2 and store.errors == 0
        assert store._conn.clock.stalls >= 1
    finally:
        await store.close()


async def test_a_pooled_connect_across_a_stall_succeeds(redis_server: RedisServer):
    """redis-py's pool (admission, here): its connect times out by a wall-time timer it owns, so the
    pool makes the connection once more when it saw this loop stall (nothing was sent yet)."""
    store = await redis_store(redis_server)
    pool = store.redis.connection_pool
    try:
        # Whether the stall meets a connect still in flight depends on what the store's own tasks (heartbeat,
        # subscription) did with the pool in that turn: one may have just put an idle connection back, which
        # admission then reuses (seen once in a stressed full run). So the scenario is repeated until the
        # stall did meet a pending connect; every attempt must be admitted without an error.
        for attempt in range(10):
            await store._drop_idle_connections()  # admission must make a new connection
            admit = asyncio.ensure_future(store.admit(record(f"other{attempt}")))
            _stall_next_turn(CONNECT_TIMEOUT + 0.3)
            await admit
            assert store.errors == 0, attempt
            assert await store.get(f"other{attempt}") is not None
            if pool.stalled_connects >= 1:
                break
        assert pool.stalled_connects >= 1, "in 10 attempts the stall never met a connect in flight"
    finally:
        await store.close()


@pytest.mark.parametrize("stall", [0.0, SOCKET_TIMEOUT + 0.3])
async def test_a_stopped_redis_is_refused_within_the_bound(own_redis: RedisServer, stall: float):
    """SIGSTOP'd redis-server (the connection stays open, nothing answers): refused after SOCKET_TIMEOUT
    of running loop, within the bound also when the loop stalls meanwhile; the positive control is the
    same operation answered once the server runs again."""
    store = await redis_store(own_redis)
    try:
        await store.admit(record())
        assert await store.reserve_out("sbx", 1, 1, None) == 1
        assert own_redis.proc is not None
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            elapsed = await _refused_after(store.reserve_out("sbx", 1, 1, None), stall,
                                           r"Redis did not answer within 2 s")
            assert SOCKET_TIMEOUT <= elapsed < _bound(SOCKET_TIMEOUT) + LATENESS, elapsed
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60  # a hang guard: the back-off ends within a second
        while True:
            try:
                assert await store.reserve_out("sbx", 1, 1, None) == 1
                break
            except StateUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
    finally:
        await store.close()


@pytest.mark.parametrize("stall", [0.0, CONNECT_TIMEOUT + 0.3, CAP * CONNECT_TIMEOUT + 0.5])
async def test_a_connect_that_never_completes_is_refused_within_the_bound(blackhole: int, stall: float):
    """A blackholed connect: refused after CONNECT_TIMEOUT of running loop; a stall meanwhile lengthens
    the wait but never past the wall-time cap (a stall longer than the cap is refused as it ends)."""
    store = RedisState(f"redis://127.0.0.1:{blackhole}/0", "egtest-blackhole:")
    try:
        elapsed = await _refused_after(store.reserve_out("sbx", 1, 1, None), stall,
                                       r"cannot connect to Redis: no connection within 1 s")
        assert max(CONNECT_TIMEOUT, stall) <= elapsed < _bound(CONNECT_TIMEOUT) + LATENESS, elapsed
        assert store._conn.clock.stalls >= (1 if stall else 0)  # the stall was seen
    finally:
        await store.close()


async def test_a_pooled_connect_that_never_completes_is_refused_after_one_retry(blackhole: int):
    """The pool's retry after a stall is made once: a connect that never completes is refused after the
    stall and two connect timeouts."""
    store = RedisState(f"redis://127.0.0.1:{blackhole}/0", "egtest-blackhole:")
    try:
        stall = CONNECT_TIMEOUT + 0.3
        elapsed = await _refused_after(store.admit(record()), stall, r"Timeout connecting to server")
        assert stall + CONNECT_TIMEOUT - 0.01 <= elapsed < stall + 2 * CONNECT_TIMEOUT + LATENESS, elapsed
        assert store.redis.connection_pool.stalled_connects == 1  # once, not again
    finally:
        await store.close()


async def test_the_subscription_outlives_a_stall_longer_than_its_dead_time(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
):
    """The subscription is declared dead after DEAD_AFTER without an answer, counted in running-loop time:
    a stall longer than that (the pongs wait in the socket) keeps it and the record cache; the positive
    control is a SIGSTOP'd Redis, noticed within the bound."""
    caplog.set_level(logging.WARNING, logger="egressgate.state.redis_events")
    store = await redis_store(own_redis)
    try:
        _stall_next_turn(DEAD_AFTER + 0.5)
        await asyncio.sleep(0)  # the stall runs
        await asyncio.sleep(2.5 * PING_EVERY)  # pings and pongs while the loop runs
        # (a heartbeat whose reply the stall timed out may warn: a pool command's reply is not resent)
        assert [r.getMessage() for r in caplog.records if "subscription" in r.getMessage()] == []
        assert store._cache.live
        assert own_redis.proc is not None
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            while store._cache.live:
                assert time.monotonic() - started < CAP * DEAD_AFTER + PING_EVERY + LATENESS
                await asyncio.sleep(0.05)
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        assert any(f"no answer on the subscription for {DEAD_AFTER:.0f} s" in r.getMessage() for r in caplog.records)
    finally:
        await store.close()
