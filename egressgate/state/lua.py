"""The Redis backend's Lua scripts: every check-and-change runs inside Redis as one atomic step.

Redis runs one script at a time, so a budget check and the write it permits cannot interleave with
another process's (the exactness the memory backend gets from a single event loop). The rules are the
ones stated in state/base.py (`grant_size`, `rule_budget_allows`); these scripts mirror them and the
contract tests (tests/state) hold both backends to the same answers.

Numbers: Lua 5.1 numbers are doubles (exact to 2^53 bytes); they go back to Redis through `I()`
(`%d`), because Lua's own number-to-string turns 1e14 and above into "1e+14", which HINCRBY refuses.
Keys other than KEYS[] are built from the prefix in ARGV: fine on one Redis (or a Sentinel-managed
primary), not Redis Cluster (docs/operations.md, State).
"""

from __future__ import annotations

_HELPERS = """
local function I(n) return string.format('%d', n) end
local function N(v) return tonumber(v or '0') or 0 end
"""

# KEYS: ctr, lease(worker), hb(worker), workers   ARGV: sandbox, want, minimum, limit (-1: none), ttl_ms, worker
RESERVE_OUT = _HELPERS + """
local want = N(ARGV[2])
if want <= 0 then return 0 end
local minimum = N(ARGV[3])
if minimum > want then minimum = want end
if minimum < 1 then minimum = 1 end
local limit = N(ARGV[4])
local grant = want
if limit >= 0 then
  local room = limit - N(redis.call('HGET', KEYS[1], 'out'))
  if room < grant then grant = room end
end
if grant < minimum then return 0 end
redis.call('HINCRBY', KEYS[1], 'out', I(grant))
redis.call('HINCRBY', KEYS[2], ARGV[1], I(grant))
redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
redis.call('SADD', KEYS[4], ARGV[6])
return grant
"""

# KEYS: ctr, lease(worker)   ARGV: sandbox, spent, unused
# Only what this worker's lease still holds can shrink it: a lease reconcile forfeited stays spent.
SETTLE_OUT = _HELPERS + """
local lease = N(redis.call('HGET', KEYS[2], ARGV[1]))
local spent = math.max(N(ARGV[2]), 0)
local unused = math.max(N(ARGV[3]), 0)
local back = math.min(unused, lease)
local drop = back + math.min(spent, lease - back)
if drop > 0 then
  if lease - drop > 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], I(-drop))
  else
    redis.call('HDEL', KEYS[2], ARGV[1])
  end
end
if back > 0 then redis.call('HINCRBY', KEYS[1], 'out', I(-back)) end
return back
"""

# KEYS: ctr   ARGV: field, delta, field, delta, ... -> the new values, in order
ADD_COUNTERS = _HELPERS + """
local out = {}
for i = 1, #ARGV, 2 do
  table.insert(out, redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]))
end
return out
"""

# KEYS: hosts, usage   ARGV: host, rule ('' = none), nbytes, requests_max (-1), bytes_max (-1)
RECORD_REQUEST = _HELPERS + """
local rule = ARGV[2]
if rule ~= '' then
  local n = N(ARGV[3])
  local rmax = N(ARGV[4])
  local bmax = N(ARGV[5])
  if rmax >= 0 or bmax >= 0 then
    local cur = redis.call('HMGET', KEYS[2], 'r:' .. rule, 'b:' .. rule)
    local r, b = N(cur[1]), N(cur[2])
    if rmax >= 0 and r + 1 > rmax then return 0 end
    if bmax >= 0 and (b >= bmax or b + n > bmax) then return 0 end
  end
  redis.call('HINCRBY', KEYS[2], 'r:' .. rule, 1)
  redis.call('HINCRBY', KEYS[2], 'b:' .. rule, I(n))
end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""

# KEYS: ctr, hosts, usage, sbx   ARGV: want_hosts ('1'/'0'), want_record ('1'/'0'), rule ids... (none: all)
# -> one JSON string [counters, hosts, usage (flat field/value), record (flat field/value)]: a single bulk
# reply, decoded by the C json module, instead of one RESP element per host (the pure-Python RESP
# parser cost ~6 us per element: most of a snapshot's CPU with a few dozen hosts in the history)
SNAPSHOT = """
local ctr = redis.call('HMGET', KEYS[1], 'out', 'in', 'dq', 'db')
for i = 1, 4 do if not ctr[i] then ctr[i] = '0' end end
local hosts = {}
if ARGV[1] == '1' then hosts = redis.call('SMEMBERS', KEYS[2]) end
local usage = {}
if #ARGV > 2 then
  for i = 3, #ARGV do
    local v = redis.call('HMGET', KEYS[3], 'r:' .. ARGV[i], 'b:' .. ARGV[i])
    if v[1] then
      table.insert(usage, 'r:' .. ARGV[i])
      table.insert(usage, v[1])
    end
    if v[2] then
      table.insert(usage, 'b:' .. ARGV[i])
      table.insert(usage, v[2])
    end
  end
else
  usage = redis.call('HGETALL', KEYS[3])
end
local record = {}
if ARGV[2] == '1' then record = redis.call('HGETALL', KEYS[4]) end
return cjson.encode({ctr, hosts, usage, record})
"""

# KEYS: addr   ARGV: prefix -> {} or the record (flat field/value) the address points at
BY_ADDRESS = """
local id = redis.call('GET', KEYS[1])
if not id then return {} end
return redis.call('HGETALL', ARGV[1] .. 'sbx:' .. id)
"""

# KEYS: sbxs   ARGV: prefix -> {record, record, ...}
LIST_SANDBOXES = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = redis.call('HGETALL', ARGV[1] .. 'sbx:' .. id)
  if #rec > 0 then table.insert(out, rec) end
end
return out
"""

# KEYS: sbx, events   ARGV: message
REVOKE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'revoked', '1')
redis.call('PUBLISH', KEYS[2], ARGV[1])
return 1
"""

# KEYS: workers   ARGV: prefix -> flat {worker, sandbox, bytes, ...}
# Atomic: a second reconciler running at the same time finds the leases already gone.
RECONCILE = """
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. 'hb:' .. w) == 0 then
    local lk = ARGV[1] .. 'lease:' .. w
    local leases = redis.call('HGETALL', lk)
    for i = 1, #leases, 2 do
      if tonumber(leases[i + 1]) ~= 0 then
        table.insert(out, w)
        table.insert(out, leases[i])
        table.insert(out, leases[i + 1])
      end
    end
    redis.call('DEL', lk)
    redis.call('SREM', KEYS[1], w)
  end
end
return out
"""
