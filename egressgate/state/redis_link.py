"""One gateway process's link to Redis: the connections, and failing closed on every error.

- The per-request commands share one multiplexed connection (state/resp.py: ~5x less CPU per command than
  redis-py); redis-py (`redis`, a bounded pool that makes callers wait for a free connection, never fails
  with "Too many connections") serves the rest: pipelines, pub/sub, the approval store.
- Fail closed: any Redis error (connection refused, timeout, a script error, a reply that cannot be read)
  raises StateUnavailable and counts in `errors` (/metrics); callers deny `state_unavailable`. No command
  is retried by the client library (a retried write could count twice, or give a lease back twice).
  After a connection failure, operations are refused at once for a short backoff (50 ms doubling to 1 s)
  instead of each waiting on a dead server; then the next one tries again, and the connections are made
  again by themselves when Redis is back (no gateway restart). A NOSCRIPT answer (Redis restarted) is the
  one resend: the script did not run.

What the state store does with it (the registry, the counters, the leases) is state/redis.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from egressgate.state import lua
from egressgate.state.base import StateUnavailable
from egressgate.state.redis_events import BACKOFF_MAX, BACKOFF_MIN
from egressgate.state.resp import RespConnection

SOCKET_TIMEOUT = 2.0  # one operation waits at most this long for Redis, then the request is denied
CONNECT_TIMEOUT = 1.0
MAX_CONNECTIONS = 64  # per process; the subscription holds one of them
_DOWN = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
SCRIPTS = (
    "RESERVE_OUT",
    "SETTLE_OUT",
    "RECORD_REQUEST",
    "RESERVE_REQUEST",
    "SNAPSHOT",
    "BY_ADDRESS",
    "LIST_SANDBOXES",
    "REVOKE",
    "RECONCILE",
    "ADD_COUNTERS",
    "COUNT_CALLS",
    "REFUND_CALLS",
    "MCP_PIN",
    "MCP_READ",
)


class RedisLink:
    def __init__(self, url: str, timeout: float = SOCKET_TIMEOUT) -> None:
        self.errors = 0
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=timeout,
            socket_connect_timeout=CONNECT_TIMEOUT,
            # off: one round trip less per new connection (Redis 7 refuses it anyway), and with it off
            # the pool checks a pooled connection is still open before handing it out
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        self.redis: Redis = Redis.from_pool(pool)  # owns the pool: aclose() closes it
        self._conn = RespConnection(url, timeout=timeout, connect_timeout=CONNECT_TIMEOUT)
        self._scripts = {name: self.redis.register_script(getattr(lua, name)).sha for name in SCRIPTS}
        self._retry_at = 0.0  # monotonic; before it, operations are refused without trying
        self._backoff = 0.0

    def unreadable(self, what: str, exc: Exception) -> StateUnavailable:
        """A reply this process cannot read: counted, and the error to raise."""
        self.errors += 1
        return StateUnavailable(f"state backend error ({what}): unreadable reply ({exc})")

    async def call(self, what: str, op):
        """Run one Redis operation (an awaitable factory); any failure → StateUnavailable."""
        if self._backoff and time.monotonic() < self._retry_at:
            self.errors += 1
            raise StateUnavailable(f"state backend unavailable ({what}): Redis did not answer, retrying shortly")
        try:
            result = await op()
        except _DOWN as exc:
            self._backoff = min(max(self._backoff * 2, BACKOFF_MIN), BACKOFF_MAX)
            self._retry_at = time.monotonic() + self._backoff
            self.errors += 1
            await self.drop_idle_connections()
            raise StateUnavailable(f"state backend unavailable ({what}): {exc}") from exc
        except (RedisError, StateUnavailable) as exc:
            self.errors += 1
            raise StateUnavailable(f"state backend error ({what}): {exc}") from exc
        except UnicodeError as exc:  # a value the wire cannot carry (a lone surrogate): nothing was sent
            self.errors += 1
            raise StateUnavailable(f"state backend error ({what}): a value cannot be encoded for Redis") from exc
        self._backoff = 0.0
        return result

    async def command(self, what: str, *args):
        """One plain command on the multiplexed connection."""
        return await self.call(what, lambda: self._conn.call(*args))

    async def eval(self, name: str, keys: list[str], args: list):
        """One script by its SHA. NOSCRIPT (Redis restarted or SCRIPT FLUSH) means it did not run: load
        it and send it once more, so nothing runs twice."""
        command = ("EVALSHA", self._scripts[name], len(keys), *keys, *args)

        async def op():
            try:
                return await self._conn.call(*command)
            except NoScriptError:
                await self._conn.call("SCRIPT", "LOAD", getattr(lua, name))
                return await self._conn.call(*command)

        return await self.call(name.lower(), op)

    async def drop_idle_connections(self) -> None:
        """After a connection failure the pool's idle connections are likely dead too (Redis restarted):
        close them, so the next operations connect afresh instead of each failing on a stale one."""
        with contextlib.suppress(Exception):
            await self.redis.connection_pool.disconnect(inuse_connections=False)

    def close_multiplexed(self) -> None:
        self._conn.close()
