"""Approvals in Redis, next to the sandbox registry (same client, same key prefix).

Every transition is one Lua script, so it is atomic across gateway processes and replicas: two
retries racing on two replicas get one pending approval, an approve racing a deny has one winner, and
the sweeper of every process may run at once while each expiry is returned (and audited) exactly once.
All keys share one hash tag, so the scripts also work on a Redis Cluster.

Layout (B = key("approvals{a}")):
  B:a:<id>              hash: the Approval's fields (Approval.to_fields)
  B:pending:<sandbox>   hash: target key -> id of its pending approval
  B:denied:<sandbox>    hash: target key -> id of its denied approval (remembered DENIED_MEMORY_SECONDS)
  B:grants:<sandbox>    hash: id -> Grant JSON (what decide() reads: one HGETALL per decision)
  B:index               zset: id by requested_at (listing)
  B:deadlines           zset: id by the instant it expires (pending: requested_at + its pending_ttl)
  B:ended               zset: id of a denied/expired approval by the instant it is dropped (RETENTION_SECONDS)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from egressgate.approvals.grant import Grant
from egressgate.approvals.model import (
    DENIED_MEMORY_SECONDS,
    MAX_PENDING_PER_SANDBOX,
    RETENTION_SECONDS,
    Approval,
    ApprovalNotFound,
    ApprovalState,
    ApprovalUnavailable,
    NotPending,
)

_LIVE_PENDING = """
local function live_pending(akey, now, ttl)
  local f = redis.call('HMGET', akey, 'state', 'requested_at')
  return f[1] == 'pending' and now < tonumber(f[2]) + ttl
end
"""

# KEYS: none (all keys derive from ARGV[1], one hash tag). ARGV: base, target, id, now, ttl, max,
# denied_memory, sandbox, then the new approval's field/value pairs.
_REQUEST = _LIVE_PENDING + """
local base, target, id = ARGV[1], ARGV[2], ARGV[3]
local now, ttl, max, dmem = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local sandbox = ARGV[8]
local pkey, dkey = base .. ':pending:' .. sandbox, base .. ':denied:' .. sandbox
local live = 0
local entries = redis.call('HGETALL', pkey)
for i = 1, #entries, 2 do
  if live_pending(base .. ':a:' .. entries[i + 1], now, ttl) then
    if entries[i] == target then return {entries[i + 1], 0} end
    live = live + 1
  else
    redis.call('HDEL', pkey, entries[i])
  end
end
local did = redis.call('HGET', dkey, target)
if did then
  local f = redis.call('HMGET', base .. ':a:' .. did, 'state', 'decided_at')
  if f[1] == 'denied' and now < tonumber(f[2]) + dmem then return {did, 0} end
  redis.call('HDEL', dkey, target)
end
if live >= max then return {'', 2} end
local fields = {}
for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', base .. ':a:' .. id, unpack(fields))
redis.call('HSET', pkey, target, id)
local requested = tonumber(redis.call('HGET', base .. ':a:' .. id, 'requested_at'))
redis.call('ZADD', base .. ':index', requested, id)
redis.call('ZADD', base .. ':deadlines', requested + ttl, id)
return {id, 1}
"""

# ARGV: base, id, now, ttl, retention, target, sandbox, approve(1/0), grant json, expires_at, field/value pairs
_DECIDE = _LIVE_PENDING + """
local base, id, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local target, sandbox = ARGV[6], ARGV[7]
local akey = base .. ':a:' .. id
if redis.call('EXISTS', akey) == 0 then return 0 end
if not live_pending(akey, now, ttl) then return 1 end
local fields = {}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', akey, unpack(fields))
local pkey = base .. ':pending:' .. sandbox
if redis.call('HGET', pkey, target) == id then redis.call('HDEL', pkey, target) end
redis.call('ZREM', base .. ':deadlines', id)
if ARGV[8] == '1' then
  redis.call('HSET', base .. ':grants:' .. sandbox, id, ARGV[9])
  redis.call('ZADD', base .. ':deadlines', tonumber(ARGV[10]), id)
else
  redis.call('HSET', base .. ':denied:' .. sandbox, target, id)
  redis.call('ZADD', base .. ':ended', now + tonumber(ARGV[5]), id)
end
return 2
"""

# ARGV: base, now, batch, retention. Returns the ids this call moved to `expired` (each id at most once,
# ever), after dropping the approvals whose retention is over.
_EXPIRE = """
local base, now = ARGV[1], tonumber(ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', base .. ':ended', '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(gone) do
  redis.call('ZREM', base .. ':ended', id)
  redis.call('ZREM', base .. ':index', id)
  local akey = base .. ':a:' .. id
  local f = redis.call('HMGET', akey, 'sandbox_id', 'scheme', 'host', 'port')
  if f[1] then
    local dkey = base .. ':denied:' .. f[1]
    if redis.call('HGET', dkey, (f[2] or '-') .. '|' .. f[3] .. '|' .. f[4]) == id then
      redis.call('HDEL', dkey, (f[2] or '-') .. '|' .. f[3] .. '|' .. f[4])
    end
  end
  redis.call('DEL', akey)
end
local ids = redis.call('ZRANGEBYSCORE', base .. ':deadlines', '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZREM', base .. ':deadlines', id)
  local akey = base .. ':a:' .. id
  local f = redis.call('HMGET', akey, 'state', 'sandbox_id', 'scheme', 'host', 'port')
  if f[1] == 'pending' or f[1] == 'approved' then
    redis.call('HSET', akey, 'state', 'expired')
    redis.call('ZADD', base .. ':ended', now + tonumber(ARGV[4]), id)
    redis.call('HDEL', base .. ':grants:' .. f[2], id)
    local target = (f[3] or '-') .. '|' .. f[4] .. '|' .. f[5]
    local pkey = base .. ':pending:' .. f[2]
    if redis.call('HGET', pkey, target) == id then redis.call('HDEL', pkey, target) end
    out[#out + 1] = id
  end
end
return out
"""


# ARGV: base, id, sandbox, now, retention. 1 when this call removed the live grant (and ended its approval).
_CONSUME = """
local base, id, sandbox, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local raw = redis.call('HGET', base .. ':grants:' .. sandbox, id)
if not raw then return 0 end
redis.call('HDEL', base .. ':grants:' .. sandbox, id)
local akey = base .. ':a:' .. id
local f = redis.call('HMGET', akey, 'state', 'expires_at')
if f[1] ~= 'approved' or now >= tonumber(f[2]) then return 0 end
redis.call('HSET', akey, 'state', 'expired', 'expires_at', ARGV[4])
redis.call('ZREM', base .. ':deadlines', id)
redis.call('ZADD', base .. ':ended', now + tonumber(ARGV[5]), id)
return 1
"""


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisApprovals:
    def __init__(self, redis: Any, key: Callable[..., str], on_error: Callable[[], None] | None = None) -> None:
        self.redis = redis
        self._on_error = on_error  # counts a failure in the state store's `errors` (/metrics)
        self.base = key("approvals{a}")
        self._request = redis.register_script(_REQUEST)
        self._decide = redis.register_script(_DECIDE)
        self._expire = redis.register_script(_EXPIRE)
        self._consume = redis.register_script(_CONSUME)

    def _unavailable(self, exc: Exception) -> ApprovalUnavailable:
        if self._on_error is not None:
            self._on_error()
        return ApprovalUnavailable(f"approval store: {type(exc).__name__}")

    async def _call(self, script, args: list) -> Any:
        try:
            return await script(keys=[], args=args)
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    async def _fetch(self, ids: list[str]) -> list[Approval]:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for approval_id in ids:
                    pipe.hgetall(f"{self.base}:a:{approval_id}")
                rows = await pipe.execute()
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        return [Approval.from_fields({_text(k): _text(v) for k, v in row.items()}) for row in rows if row]

    async def request(self, draft: Approval, now: float) -> tuple[Approval | None, bool]:
        fields = draft.to_fields()
        reply = await self._call(self._request, [
            self.base, draft.target_key, draft.id, repr(now), repr(draft.pending_ttl),
            MAX_PENDING_PER_SANDBOX, repr(DENIED_MEMORY_SECONDS), draft.sandbox_id, *_flat(fields)])
        approval_id, status = _text(reply[0]), int(reply[1])
        if status == 2:
            return None, False
        if status == 1:
            return draft, True
        found = await self._fetch([approval_id])
        if not found:
            raise ApprovalUnavailable("approval store: a pending approval vanished")
        return found[0], False

    async def get(self, approval_id: str) -> Approval | None:
        found = await self._fetch([approval_id])
        return found[0] if found else None

    async def list(self, state: ApprovalState | None, now: float) -> list[Approval]:
        try:
            ids = [_text(i) for i in await self.redis.zrange(f"{self.base}:index", 0, -1)]
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        current = (a.current(now) for a in await self._fetch(ids))
        return [a for a in current if state is None or a.state is state]

    async def decide(self, approval_id: str, *, approve: bool, by: str | None, scope: str, for_seconds: int,
                     now: float) -> Approval:
        approval = await self.get(approval_id)
        if approval is None:
            raise ApprovalNotFound(approval_id)
        if approval.current(now).state is not ApprovalState.PENDING:
            raise NotPending(approval_id)
        decided = approval.decided(approve=approve, by=by, scope=scope, for_seconds=for_seconds, now=now)
        grant = json.dumps(decided.grant().to_json()) if approve else ""
        status = await self._call(self._decide, [
            self.base, approval_id, repr(now), repr(approval.pending_ttl), repr(RETENTION_SECONDS),
            approval.target_key, approval.sandbox_id, "1" if approve else "0", grant,
            repr(decided.expires_at or 0.0), *_flat(decided.to_fields())])
        if int(status) == 0:
            raise ApprovalNotFound(approval_id)
        if int(status) == 1:
            raise NotPending(approval_id)  # another operator (or replica) decided it first
        return decided

    async def grants(self, sandbox_id: str, now: float) -> tuple[Grant, ...]:
        try:
            raw = await self.redis.hgetall(f"{self.base}:grants:{sandbox_id}")
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        out = []
        for value in raw.values():
            try:
                grant = Grant.from_json(json.loads(value))
            except ValueError:
                continue  # a malformed entry grants nothing
            if grant.sandbox_id == sandbox_id and now < grant.expires_at:
                out.append(grant)
        return tuple(out)

    async def consume(self, sandbox_id: str, approval_id: str, now: float) -> Approval | None:
        done = await self._call(self._consume, [self.base, approval_id, sandbox_id, repr(now), repr(RETENTION_SECONDS)])
        return await self.get(approval_id) if int(done) == 1 else None

    async def expire(self, now: float) -> list[Approval]:
        ids = [_text(i) for i in await self._call(self._expire, [self.base, repr(now), 256, repr(RETENTION_SECONDS)])]
        return await self._fetch(ids) if ids else []

    async def close(self) -> None:
        return None  # the client belongs to the state store
