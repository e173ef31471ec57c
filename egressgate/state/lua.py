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
local MAX_AMOUNT = 9007199254740991
"""

# Counting for a sandbox whose record Redis no longer has (FLUSHALL, a restart without persistence, an
# evicted key) would start its budgets again from zero while replicas still serve it from their caches:
# a script that takes from a budget refuses instead (an error: the caller denies `state_unavailable`).
GONE = "EGRESSGATE_NO_SANDBOX"
_LIVE_RECORD = """
local function live_record(key)
  if redis.call('EXISTS', key) == 0 then
    return redis.error_reply('""" + GONE + """ Redis has no record of this sandbox (data lost?)')
  end
  return nil
end
"""

# KEYS: ctr, lease(worker), hb(worker), workers, sbx   ARGV: sandbox, want, minimum, limit (-1: none), ttl_ms, worker
RESERVE_OUT = _HELPERS + _LIVE_RECORD + """
local want = N(ARGV[2])
if want <= 0 or want > MAX_AMOUNT then return 0 end
local gone = live_record(KEYS[5])
if gone then return gone end
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

# KEYS: calls, sbx   ARGV: key, max (-1: none), key, max, ... -> '' when every key was counted (one call
# each, field `m:<key>` of the sandbox's own `calls` hash: never in the rules' usage hash, so a network
# rule named like a counter cannot share it), else the first key already at its max (nothing counted)
COUNT_CALLS = _HELPERS + _LIVE_RECORD + """
local gone = live_record(KEYS[2])
if gone then return gone end
for i = 1, #ARGV, 2 do
  local limit = N(ARGV[i + 1])
  if limit >= 0 and N(redis.call('HGET', KEYS[1], 'm:' .. ARGV[i])) + 1 > limit then return ARGV[i] end
end
for i = 1, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], 'm:' .. ARGV[i], 1) end
return ''
"""

# KEYS: calls   ARGV: keys -> one call given back per key, never below zero
REFUND_CALLS = _HELPERS + """
for i = 1, #ARGV do
  if N(redis.call('HGET', KEYS[1], 'm:' .. ARGV[i])) > 0 then redis.call('HINCRBY', KEYS[1], 'm:' .. ARGV[i], -1) end
end
return 1
"""

# KEYS: calls, pins   ARGV: server, keys... -> JSON [counts in the order of the keys, flat pins of the server]
MCP_READ = _HELPERS + """
local counts = {}
for i = 2, #ARGV do counts[#counts + 1] = N(redis.call('HGET', KEYS[1], 'm:' .. ARGV[i])) end
local prefix = ARGV[1] .. '|'
local pins = {}
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  if string.sub(all[i], 1, #prefix) == prefix then
    pins[#pins + 1] = string.sub(all[i], #prefix + 1)
    pins[#pins + 1] = all[i + 1]
  end
end
return cjson.encode({counts, pins})
"""

# KEYS: pins   ARGV: field, value -> the stored value (set only when absent: trust on first use)
MCP_PIN = """
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], ARGV[1])
"""

# KEYS: ctr, sbx   ARGV: field, delta, field, delta, ... -> the new values, in order
ADD_COUNTERS = _HELPERS + _LIVE_RECORD + """
local gone = live_record(KEYS[2])
if gone then return gone end
local out = {}
for i = 1, #ARGV, 2 do
  table.insert(out, redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]))
end
return out
"""

# RESERVE_OUT (minimum = want) and RECORD_REQUEST as one step, all or nothing, the bytes checked first, plus
# the bytes in the ledger summed since its last write (base.StateStore.reserve_request; one round trip).
# KEYS: ctr, lease(worker), hb(worker), workers, sbx, hosts, hist, usage
# ARGV: sandbox, want (0: none), limit (-1: none), ttl_ms, worker, host, reversed host, rule ('' = none),
#       nbytes, requests_max (-1), bytes_max (-1), bytes in
# -> {'' | 'bytes' | 'rule', bytes_out after the step}
RESERVE_REQUEST = _HELPERS + _LIVE_RECORD + """
local gone = live_record(KEYS[5])
if gone then return gone end
local add = N(ARGV[12])
if add > 0 and add <= MAX_AMOUNT then redis.call('HINCRBY', KEYS[1], 'in', I(add)) end
local used = N(redis.call('HGET', KEYS[1], 'out'))
local want = N(ARGV[2])
if want < 0 or want > MAX_AMOUNT then return {'bytes', I(used)} end
local limit = N(ARGV[3])
if want > 0 and limit >= 0 and limit - used < want then return {'bytes', I(used)} end
local n = N(ARGV[9])
if n > MAX_AMOUNT then return {'rule', I(used)} end
local rule = ARGV[8]
if rule ~= '' then
  local rmax = N(ARGV[10])
  local bmax = N(ARGV[11])
  if rmax >= 0 or bmax >= 0 then
    local cur = redis.call('HMGET', KEYS[8], 'r:' .. rule, 'b:' .. rule)
    local r, b = N(cur[1]), N(cur[2])
    if rmax >= 0 and r + 1 > rmax then return {'rule', I(used)} end
    if bmax >= 0 and (b >= bmax or b + n > bmax) then return {'rule', I(used)} end
  end
end
if want > 0 then
  used = redis.call('HINCRBY', KEYS[1], 'out', I(want))
  redis.call('HINCRBY', KEYS[2], ARGV[1], I(want))
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
  redis.call('SADD', KEYS[4], ARGV[5])
end
if rule ~= '' then
  redis.call('HINCRBY', KEYS[8], 'r:' .. rule, 1)
  redis.call('HINCRBY', KEYS[8], 'b:' .. rule, I(n))
end
if redis.call('SADD', KEYS[6], ARGV[6]) == 1 then redis.call('ZADD', KEYS[7], 0, ARGV[7]) end
return {'', I(used)}
"""

# KEYS: hosts, hist, usage   ARGV: host, host with its labels reversed (redis_codec.rev_host), rule
# ('' = none), nbytes, requests_max (-1), bytes_max (-1). The history is kept twice: `hosts` (a set, read
# whole) and `hist` (sorted by reversed host, read by pattern; see SNAPSHOT)
RECORD_REQUEST = _HELPERS + """
if N(ARGV[4]) > MAX_AMOUNT then return 0 end
local rule = ARGV[3]
if rule ~= '' then
  local n = N(ARGV[4])
  local rmax = N(ARGV[5])
  local bmax = N(ARGV[6])
  if rmax >= 0 or bmax >= 0 then
    local cur = redis.call('HMGET', KEYS[3], 'r:' .. rule, 'b:' .. rule)
    local r, b = N(cur[1]), N(cur[2])
    if rmax >= 0 and r + 1 > rmax then return 0 end
    if bmax >= 0 and (b >= bmax or b + n > bmax) then return 0 end
  end
  redis.call('HINCRBY', KEYS[3], 'r:' .. rule, 1)
  redis.call('HINCRBY', KEYS[3], 'b:' .. rule, I(n))
end
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then redis.call('ZADD', KEYS[2], 0, ARGV[2]) end
return 1
"""

# KEYS: ctr, hosts, hist, usage, sbx   ARGV[1]: JSON {"h": "all"|"none"|"some", "x": [exact reversed hosts],
# "s": [reversed suffix prefixes, e.g. "com.example."], "r": [rule ids] or absent (all), "rec": 0|1}
# -> one JSON string [counters, hosts, reversed hosts, usage (flat field/value), record (flat field/value),
# 1 if the record exists else 0 (checked even when the caller has it cached: see _LIVE_RECORD)]:
# a single bulk reply, decoded by the C json module, instead of one RESP element per host.
# The history is a sorted set of hosts with their labels reversed, so "hosts under example.com" is one
# lexicographic range (O(log n + matches)) and a history of thousands of hosts costs nothing to a
# policy that asks about a few: neither this process nor Redis reads the rest.
SNAPSHOT = """
local spec = cjson.decode(ARGV[1])
local ctr = redis.call('HMGET', KEYS[1], 'out', 'in', 'dq', 'db')
for i = 1, 4 do if not ctr[i] then ctr[i] = '0' end end
local hosts = {}
local reversed = {}
if spec.h == 'all' then
  hosts = redis.call('SMEMBERS', KEYS[2])
elseif spec.h == 'some' then
  for _, host in ipairs(spec.x) do
    if redis.call('ZSCORE', KEYS[3], host) then table.insert(reversed, host) end
  end
  for _, prefix in ipairs(spec.s) do
    local stop = string.sub(prefix, 1, -2) .. '/'  -- the prefix ends in '.', and '/' follows '.'
    for _, host in ipairs(redis.call('ZRANGEBYLEX', KEYS[3], '[' .. prefix, '(' .. stop)) do
      table.insert(reversed, host)
    end
  end
end
local usage = {}
if spec.r then
  for _, rule in ipairs(spec.r) do
    local v = redis.call('HMGET', KEYS[4], 'r:' .. rule, 'b:' .. rule)
    if v[1] then
      table.insert(usage, 'r:' .. rule)
      table.insert(usage, v[1])
    end
    if v[2] then
      table.insert(usage, 'b:' .. rule)
      table.insert(usage, v[2])
    end
  end
else
  usage = redis.call('HGETALL', KEYS[4])
end
local record = {}
if spec.rec == 1 then record = redis.call('HGETALL', KEYS[5]) end
return cjson.encode({ctr, hosts, reversed, usage, record, redis.call('EXISTS', KEYS[5])})
"""

# KEYS: addr   ARGV: prefix -> {} or the record (flat field/value) the address points at
BY_ADDRESS = """
local id = redis.call('GET', KEYS[1])
if not id then return {} end
return redis.call('HGETALL', ARGV[1] .. 'sbx:' .. id)
"""

# KEYS: sbxs   ARGV: prefix -> {record, record, ...}; ids whose record expired (REVOKE) leave the set
LIST_SANDBOXES = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = redis.call('HGETALL', ARGV[1] .. 'sbx:' .. id)
  if #rec > 0 then table.insert(out, rec) else redis.call('SREM', KEYS[1], id) end
end
return out
"""

# KEYS: sbx, events, ctr, hosts, hist, usage, mcp pins, mcp calls   ARGV: message (JSON), retention_ms
# -> 1, or 0 when Redis has no such record. Published either way, with "found": replicas may still
# cache a record Redis lost (FLUSHALL), and they must drop it and close its connections. A revoked
# sandbox's keys expire after the retention (without it every sandbox ever admitted stayed in Redis,
# and LIST_SANDBOXES, one script that blocks Redis for every tenant, grew with them); then it is
# unknown, still refused.
REVOKE = """
local found = redis.call('EXISTS', KEYS[1])
if found == 1 then
  redis.call('HSET', KEYS[1], 'revoked', '1')
  for i = 1, #KEYS do if i ~= 2 then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end end
end
local event = cjson.decode(ARGV[1])
event['found'] = found
redis.call('PUBLISH', KEYS[2], cjson.encode(event))
return found
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
