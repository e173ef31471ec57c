"""Redis state backend: one registry and one set of counters for every worker and replica.

Why it is shaped like this:
- Exact budgets across processes: every check-and-change is one Lua script (state/lua.py), so two
  gateways can never both take the last bytes of a budget.
- One round trip per operation (a script, or one MULTI pipeline); records come from a per-process
  cache that pub/sub keeps honest (state/redis_events.py), so the per-request re-read is free. The
  per-request operations share one multiplexed connection (state/resp.py: ~5x less CPU per command
  than redis-py); redis-py (`self.redis`, a bounded pool) serves the rest. An allowed request of known
  size costs two round trips: the snapshot its decision reads, then `reserve_request` (its bytes, its
  rule's budget and its history in one script); bytes received ride along with the next write
  (gateway/shared/ledger.py), not one of their own.
- Fail closed: any Redis error (connection refused, timeout, a script error, a corrupt record) raises
  StateUnavailable and counts in `errors`; callers deny `state_unavailable`. No command is retried
  by the client library (a retried write could count twice, or give a lease back twice). After a
  connection failure, operations are refused at once for a short backoff (50 ms doubling to 1 s)
  instead of each waiting on a dead server; then the next one tries again, and the connections
  are made again by themselves when Redis is back (no gateway restart). A NOSCRIPT answer (Redis
  restarted) is the one resend: the script did not run.
- Leases: reserve_out records the grant under this worker's lease hash and refreshes its heartbeat
  key (TTL `heartbeat_ttl`); a task refreshes it while the process lives. reconcile() forfeits the
  leases of workers whose heartbeat key is gone (Redis's clock decides expiry, so replica clock skew
  does not matter; `now` is not used), atomically and so exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from types import MappingProxyType

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from egressgate.policy.facts import SandboxState
from egressgate.policy.globs import HostPattern
from egressgate.state import lua
from egressgate.state.base import RequestGrant, SandboxRecord, StateUnavailable
from egressgate.state.redis_codec import (
    decode_record,
    decode_usage,
    encode_record,
    pairs,
    rev_host,
    sandbox_keys,
    snapshot_spec,
)
from egressgate.state.redis_events import BACKOFF_MAX, BACKOFF_MIN, RecordCache, Revocations, Subscriber
from egressgate.state.resp import RespConnection
from egressgate.state.stall import BlockingPool

logger = logging.getLogger(__name__)

# One operation waits this long for Redis, then the request is denied; both count only time the event loop
# could run (a stalled loop is not a slow Redis), and end at stall.CAP times this of wall time (state/stall.py)
SOCKET_TIMEOUT = 2.0
CONNECT_TIMEOUT = 1.0
MAX_CONNECTIONS = 64  # per process; the subscription holds one of them
REVOKED_RETENTION = 7 * 86400.0  # a revoked sandbox's keys are dropped this long after its revocation
HEARTBEAT_TTL = 15.0  # a worker silent this long is dead: its leases are forfeited by reconcile()
_DOWN = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


def _limit(value: int | None) -> int:
    """A limit as the scripts read it: -1 is "none", so a limit below zero (no room at all) must not
    reach them as itself: it would read as unlimited. It is sent as 0."""
    return -1 if value is None else max(int(value), 0)


class RedisState:
    def __init__(self, url: str, key_prefix: str = "egressgate:", *, heartbeat_ttl: float = HEARTBEAT_TTL,
                 timeout: float = SOCKET_TIMEOUT) -> None:
        self.worker_id = uuid.uuid4().hex
        self.errors = 0
        self.prefix = key_prefix
        self.heartbeat_ttl = heartbeat_ttl
        # A bounded pool that makes callers wait for a free connection (the default pool fails with
        # "Too many connections" under a burst); waiting is bounded by SOCKET_TIMEOUT like the rest.
        # BlockingPool: a connect timed out by a stall of this loop is made again (state/stall.py)
        pool = BlockingPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=timeout, decode_responses=True,
            retry=Retry(NoBackoff(), 0), socket_timeout=timeout, socket_connect_timeout=CONNECT_TIMEOUT,
            # off: one round trip less per new connection (Redis 7 refuses it anyway), and with it off
            # the pool checks a pooled connection is still open before handing it out
            maint_notifications_config=MaintNotificationsConfig(enabled=False))
        self.redis: Redis = Redis.from_pool(pool)  # owns the pool: aclose() closes it
        # the hot path's commands: one multiplexed connection (state/resp.py)
        self._conn = RespConnection(url, timeout=timeout, connect_timeout=CONNECT_TIMEOUT)
        self._scripts = {name: self.redis.register_script(getattr(lua, name)).sha for name in (
            "RESERVE_OUT", "SETTLE_OUT", "RECORD_REQUEST", "RESERVE_REQUEST", "SNAPSHOT", "BY_ADDRESS",
            "LIST_SANDBOXES", "REVOKE", "RECONCILE", "ADD_COUNTERS", "COUNT_CALLS", "REFUND_CALLS", "MCP_PIN",
            "MCP_READ")}
        self._events = self.key("events")
        self._cache = RecordCache()
        self._revocations = Revocations(self.redis, self._cache, self._events, self.worker_id,
                                        lambda sandbox_id: self.key("sbx", sandbox_id))
        self._subscriber = Subscriber(self.redis, self._events, self._cache, self._revocations.on_event,
                                      self._revocations.resync, self._drop_idle_connections)
        self._retry_at = 0.0  # monotonic; before it, operations are refused without trying
        self._backoff = 0.0
        self._tasks: list[asyncio.Task] = []
        self._lease, self._hb, self._workers = (self.key("lease", self.worker_id), self.key("hb", self.worker_id),
                                                self.key("workers"))

    def key(self, *parts: str) -> str:
        """A key under this gateway's prefix (approvals keep their own keys here too)."""
        return self.prefix + ":".join(parts)

    async def start(self) -> None:
        """Start the subscription and the heartbeat (needs the running loop; open_state calls it)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._subscriber.run(), name="state-subscriber"),
                       loop.create_task(self._heartbeat(), name="state-heartbeat")]

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        await asyncio.wait_for(self._subscriber.subscribed.wait(), timeout)

    # -- failure handling -------------------------------------------------------------------------

    async def _call(self, what: str, op, *args):
        """Run one Redis operation (`await op(*args)`); any failure → StateUnavailable."""
        if self._backoff and time.monotonic() < self._retry_at:
            self.errors += 1
            raise StateUnavailable(f"state backend unavailable ({what.lower()}): Redis did not answer, "
                                   "retrying shortly")
        try:
            result = await op(*args)
        except _DOWN as exc:
            self._backoff = min(max(self._backoff * 2, BACKOFF_MIN), BACKOFF_MAX)
            self._retry_at = time.monotonic() + self._backoff
            self.errors += 1
            await self._drop_idle_connections()
            raise StateUnavailable(f"state backend unavailable ({what.lower()}): {exc}") from exc
        except (RedisError, StateUnavailable) as exc:
            self.errors += 1
            raise StateUnavailable(f"state backend error ({what.lower()}): {exc}") from exc
        except UnicodeError as exc:  # a value the wire cannot carry (a lone surrogate): nothing was sent
            self.errors += 1
            raise StateUnavailable(f"state backend error ({what.lower()}): a value cannot be encoded for Redis") \
                from exc
        self._backoff = 0.0
        return result

    async def _eval(self, name: str, keys: Sequence[str], args: list):
        """One script by its SHA (no closure per call: this is every request's path)."""
        return await self._call(name, self._script, name, ("EVALSHA", self._scripts[name], len(keys), *keys, *args))

    async def _script(self, name: str, command: tuple):
        """NOSCRIPT (Redis restarted or SCRIPT FLUSH) means the script did not run: load it and send it once
        more, so nothing runs twice."""
        try:
            return await self._conn.call(*command)
        except NoScriptError:
            await self._conn.call("SCRIPT", "LOAD", getattr(lua, name))
            return await self._conn.call(*command)

    async def _drop_idle_connections(self) -> None:
        """After a connection failure the pool's idle connections are likely dead too (Redis restarted):
        close them, so the next operations connect afresh instead of each failing on a stale one."""
        with contextlib.suppress(Exception):
            await self.redis.connection_pool.disconnect(inuse_connections=False)

    # -- registry -----------------------------------------------------------------------------------

    async def admit(self, record: SandboxRecord) -> None:
        sbx = self.key("sbx", record.id)
        event = json.dumps({"op": "admit", "id": record.id, "addresses": list(record.addresses), "w": self.worker_id})

        async def op():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(sbx)
                pipe.hset(sbx, mapping=encode_record(record))
                for address in record.addresses:
                    pipe.set(self.key("addr", address), record.id)
                pipe.sadd(self.key("sbxs"), record.id)
                pipe.publish(self._events, event)
                await pipe.execute()

        await self._call("admit", op)
        self._cache.invalidate(record.id, record.addresses)

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        cached = self._cache.record(sandbox_id)
        if cached is not None:
            return cached
        epoch = self._cache.epoch
        fields = await self._call("get", lambda: self._conn.call("HGETALL", self.key("sbx", sandbox_id)))
        record = self._decode(pairs(fields))
        if record is not None:
            self._remember(record, epoch)
        return record

    async def by_address(self, address: str) -> SandboxRecord | None:
        cached = self._cache.by_address(address)
        if cached is not None:
            return cached
        epoch = self._cache.epoch
        flat = await self._eval("BY_ADDRESS", [self.key("addr", address)], [self.prefix])
        record = self._decode(pairs(flat))
        if record is not None:
            self._remember(record, epoch, address)
        return record

    async def list_sandboxes(self) -> list[SandboxRecord]:
        flat = await self._eval("LIST_SANDBOXES", [self.key("sbxs")], [self.prefix])
        return [r for r in (self._decode(pairs(item)) for item in flat) if r is not None]

    def _decode(self, fields) -> SandboxRecord | None:
        try:
            return decode_record(fields)
        except StateUnavailable:
            self.errors += 1
            raise

    def _remember(self, record: SandboxRecord, epoch: int, address: str | None = None) -> None:
        if self._cache.live:
            self._cache.put(record, epoch, address)
        else:  # not subscribed: a revocation now would not reach us; check this id when we are back
            self._subscriber.missed.add(record.id)

    async def revoke(self, sandbox_id: str) -> bool:
        event = json.dumps({"op": "revoke", "id": sandbox_id, "w": self.worker_id})
        keys = [self.key("sbx", sandbox_id), self._events, self.key("ctr", sandbox_id),
                self.key("hosts", sandbox_id), self.key("hist", sandbox_id), self.key("usage", sandbox_id),
                self.key("mcp", sandbox_id), self.key("calls", sandbox_id)]
        found = await self._eval("REVOKE", keys, [event, int(REVOKED_RETENTION * 1000)])
        cached = self._cache.records.get(sandbox_id) is not None
        self._cache.invalidate(sandbox_id)
        if found or cached:
            # here at once, other processes by the published event; also when Redis lost the record this
            # process still caches (FLUSHALL): connections admitted before it must still close
            self._revocations.run(sandbox_id)
        return bool(found)

    def on_revoke(self, callback: Callable[[str], None]) -> None:
        self._revocations.callbacks.append(callback)

    # -- counters -----------------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, *, history: bool | Collection[HostPattern] = True,
                       rules: Collection[str] | None = None) -> SandboxState:
        record = self._cache.record(sandbox_id)
        epoch = self._cache.epoch
        keys = sandbox_keys(self.prefix, sandbox_id)  # ctr, hosts, hist, usage, sbx
        reply = await self._eval("SNAPSHOT", keys, [snapshot_spec(history, rules, record is None)])
        try:
            # cjson encodes an empty Lua table as {}: `or ()` reads it as the empty list it is
            ctr, hosts, reversed_hosts, usage, fields, exists = json.loads(reply)
            rule_usage = decode_usage(usage or ())
            out, in_, queries, name_bytes = map(int, ctr)
            seen = frozenset(hosts) if hosts else frozenset(rev_host(h) for h in reversed_hosts or ())
        except (ValueError, TypeError, AttributeError) as exc:
            self.errors += 1
            raise StateUnavailable(f"state backend error (snapshot): unreadable reply ({exc})") from exc
        if not exists:
            # Redis lost the record (FLUSHALL, a restart without its data) while this process still
            # caches it: its counters are gone too, so nothing read here may decide anything
            self._cache.invalidate(sandbox_id)
            raise KeyError(sandbox_id)
        if record is None:
            record = self._decode(pairs(fields or ()))
            if record is None:
                raise KeyError(sandbox_id)
            self._remember(record, epoch)
        return SandboxState(
            sandbox_id=sandbox_id, admitted_at=record.admitted_at, labels=MappingProxyType(record.labels),
            bytes_out=out, bytes_in=in_, dns_queries=queries, dns_name_bytes=name_bytes,
            seen_hosts=seen, rule_usage=MappingProxyType(rule_usage))

    async def reserve_out(self, sandbox_id: str, want: int, minimum: int, limit: int | None) -> int:
        keys = [self.key("ctr", sandbox_id), self.key("lease", self.worker_id), self.key("hb", self.worker_id),
                self.key("workers"), self.key("sbx", sandbox_id)]
        args = [sandbox_id, int(want), int(minimum), _limit(limit),
                int(self.heartbeat_ttl * 1000), self.worker_id]
        return int(await self._eval("RESERVE_OUT", keys, args))

    async def settle_out(self, sandbox_id: str, spent: int, unused: int) -> None:
        keys = [self.key("ctr", sandbox_id), self.key("lease", self.worker_id)]
        await self._eval("SETTLE_OUT", keys, [sandbox_id, int(spent), int(unused)])

    async def add_in(self, sandbox_id: str, amount: int) -> None:
        if amount:
            await self._call("add_in", lambda: self._conn.call(
                "HINCRBY", self.key("ctr", sandbox_id), "in", int(amount)))

    async def record_request(self, sandbox_id: str, host: str, rule_id: str | None, nbytes: int, *,
                             requests_max: int | None = None, bytes_max: int | None = None) -> bool:
        keys = [self.key("hosts", sandbox_id), self.key("hist", sandbox_id), self.key("usage", sandbox_id)]
        args = [host, rev_host(host), rule_id or "", int(nbytes), _limit(requests_max), _limit(bytes_max)]
        return bool(await self._eval("RECORD_REQUEST", keys, args))

    async def reserve_request(self, sandbox_id: str, host: str, rule_id: str | None, nbytes: int, want: int,
                              limit: int | None, *, requests_max: int | None = None, bytes_max: int | None = None,
                              add_in: int = 0) -> RequestGrant:
        ctr, hosts, hist, usage, sbx = sandbox_keys(self.prefix, sandbox_id)
        keys = [ctr, self._lease, self._hb, self._workers, sbx, hosts, hist, usage]
        args = [sandbox_id, int(want), _limit(limit), int(self.heartbeat_ttl * 1000), self.worker_id, host,
                rev_host(host), rule_id or "", int(nbytes), _limit(requests_max), _limit(bytes_max), int(add_in)]
        reply = await self._eval("RESERVE_REQUEST", keys, args)
        try:
            refused, used = reply
            return RequestGrant(refused or None, int(used))
        except (ValueError, TypeError) as exc:
            self.errors += 1
            raise StateUnavailable(f"state backend error (reserve_request): unreadable reply ({exc})") from exc

    async def add_dns_query(self, sandbox_id: str, name_bytes: int) -> tuple[int, int]:
        keys = [self.key("ctr", sandbox_id), self.key("sbx", sandbox_id)]
        queries, nbytes = await self._eval("ADD_COUNTERS", keys, ["dq", 1, "db", int(name_bytes)])
        return int(queries), int(nbytes)

    async def count_calls(self, sandbox_id: str, keys: Sequence[tuple[str, int | None]]) -> str | None:
        if not keys:
            return None
        args: list = []
        for key, limit in keys:
            args += [key, _limit(limit)]
        refused = await self._eval("COUNT_CALLS", [self.key("calls", sandbox_id), self.key("sbx", sandbox_id)], args)
        return refused or None

    async def call_counts(self, sandbox_id: str, keys: Sequence[str]) -> dict[str, int]:
        if not keys:
            return {}
        values = await self._call("call_counts", lambda: self._conn.call(
            "HMGET", self.key("calls", sandbox_id), *("m:" + key for key in keys)))
        try:
            return {key: int(value or 0) for key, value in zip(keys, values, strict=True)}
        except (ValueError, TypeError) as exc:
            self.errors += 1
            raise StateUnavailable(f"state backend error (call_counts): unreadable reply ({exc})") from exc

    async def refund_calls(self, sandbox_id: str, keys: Sequence[str]) -> None:
        if keys:
            await self._eval("REFUND_CALLS", [self.key("calls", sandbox_id)], list(keys))

    async def mcp_read(self, sandbox_id: str, server: str,
                       keys: Sequence[str]) -> tuple[dict[str, int], dict[str, str]]:
        reply = await self._eval("MCP_READ", [self.key("calls", sandbox_id), self.key("mcp", sandbox_id)],
                                 [server, *keys])
        try:
            counts, flat = json.loads(reply)
            # cjson encodes an empty Lua table as {}: `or ()` reads it as the empty list it is
            return ({key: int(n) for key, n in zip(keys, counts or (), strict=True)}, pairs(flat or ()))
        except (ValueError, TypeError) as exc:
            self.errors += 1
            raise StateUnavailable(f"state backend error (mcp_read): unreadable reply ({exc})") from exc

    async def mcp_pin(self, sandbox_id: str, server: str, name: str, value: str) -> str:
        # server names are [a-z0-9_-]: "|" cannot occur in them, so (server, name) -> field is one-to-one
        return str(await self._eval("MCP_PIN", [self.key("mcp", sandbox_id)], [f"{server}|{name}", value]))

    async def mcp_pins(self, sandbox_id: str, server: str) -> dict[str, str]:
        flat = await self._call("mcp_pins", lambda: self._conn.call("HGETALL", self.key("mcp", sandbox_id)))
        prefix = server + "|"
        return {k[len(prefix):]: v for k, v in pairs(flat).items() if k.startswith(prefix)}

    # -- liveness -----------------------------------------------------------------------------------

    async def ping(self) -> None:
        await self._call("ping", lambda: self._conn.call("PING"))

    async def reconcile(self, now: float) -> list[tuple[str, str, int]]:
        flat = await self._eval("RECONCILE", [self.key("workers")], [self.prefix])
        return [(flat[i], flat[i + 1], int(flat[i + 2])) for i in range(0, len(flat) - 2, 3)]

    async def _heartbeat(self) -> None:
        """Keep this worker's heartbeat key alive (its leases are not forfeited while it runs)."""
        hb = self.key("hb", self.worker_id)
        ttl_ms = int(self.heartbeat_ttl * 1000)
        while True:
            try:
                await self.redis.set(hb, "1", px=ttl_ms)
            except (RedisError, OSError) as exc:
                logger.warning("state: heartbeat not written (%s)", exc)
            await asyncio.sleep(self.heartbeat_ttl / 3)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # stopping anyway
                await task
        self._tasks = []
        self._conn.close()
        # a stopped worker holds no lease: let reconcile() forfeit leftovers now, not after the TTL
        with contextlib.suppress(RedisError, OSError):
            await self.redis.delete(self.key("hb", self.worker_id))
        await self.redis.aclose()
