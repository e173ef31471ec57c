"""Code shared by the tests/state files: a sample record and a started RedisState."""

from __future__ import annotations

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
