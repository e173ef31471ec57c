"""Code shared by the tests/state files: a sample record, a started RedisState, two replicas on one prefix."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from egressgate.state.base import SandboxRecord, hash_token
from egressgate.state.redis import RedisState
from tests.support.redis import RedisServer

TOKEN = "tok"


def record(sid: str = "sbx", *, token: str = TOKEN, addresses: tuple[str, ...] = (), **labels: str) -> SandboxRecord:
    return SandboxRecord(id=sid, token_hash=hash_token(token), policy_name="p", admitted_at=1.5,
                         labels=dict(labels), addresses=addresses, phantoms={"gh": "ab" * 32})


async def redis_store(server: RedisServer, prefix: str | None = None, **kwargs) -> RedisState:
    """A started RedisState on `server` (a fresh prefix unless given), subscribed to its events."""
    made = RedisState(server.url, prefix or server.prefix(), **kwargs)
    await made.start()
    await made.wait_subscribed()
    return made


@contextlib.asynccontextmanager
async def replica_pair(server: RedisServer) -> AsyncIterator[tuple[RedisState, RedisState]]:
    """Two started RedisStates on `server` under ONE fresh prefix (two gateway replicas sharing a store),
    both closed afterwards."""
    prefix = server.prefix()
    a = await redis_store(server, prefix)
    try:
        b = await redis_store(server, prefix)
        try:
            yield a, b
        finally:
            await b.close()
    finally:
        await a.close()


async def wait_until(predicate: Callable[[], object], timeout: float) -> float:
    """Poll `predicate` (without blocking the loop the stores run on) until true or `timeout`; the seconds waited."""
    start = time.monotonic()
    while not predicate() and time.monotonic() - start < timeout:
        await asyncio.sleep(0.005)
    return time.monotonic() - start
