"""Cluster mode's Lua scripts: each runs atomically in Redis, on Redis' own clock (replicas' clocks
need not agree).

Keys are built inside the scripts from the cluster's prefix (`am:{name}:`), so the cluster needs one
Redis (not Redis Cluster, where a script may touch only the keys it is given; docs/cluster.md has
the plan past one Redis).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_NOW = (
    "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + "
    "math.floor(tonumber(t[2]) / 1000)\n"
)

_LEAST_LOADED = """
local function least_loaded(P, now, skip)
  local best, load = nil, nil
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', P .. 'replicas', now, '+inf')) do
    if r ~= skip then
      local n = redis.call('SCARD', P .. 'owned:' .. r)
      if load == nil or n < load or (n == load and r < best) then best, load = r, n end
    end
  end
  return best
end
local function alive(P, r, now)
  if not r then return false end
  local s = redis.call('ZSCORE', P .. 'replicas', r)
  return s and tonumber(s) >= now
end
local function place(P, run, to)
  local was = redis.call('HGET', P .. 'assign', run)
  if was == to then return false end
  if was then redis.call('SREM', P .. 'owned:' .. was, run) end
  redis.call('HSET', P .. 'assign', run, to)
  redis.call('SADD', P .. 'owned:' .. to, run)
  return true
end
"""

_HEARTBEAT = (
    _NOW
    + """
local P, me, lease, info = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
-- The cluster's epoch: set once by the first replica to join an empty Redis. A replica that finds another
-- epoch than the one it joined (or none) knows Redis lost the cluster's data meanwhile.
local epoch = redis.call('GET', P .. 'epoch')
if not epoch then
  redis.call('SET', P .. 'epoch', ARGV[6])
  epoch = ARGV[6]
end
local before = redis.call('ZSCORE', P .. 'replicas', me)
local rejoined = 0
if before and tonumber(before) < now then rejoined = 1 end
if not before and ARGV[5] == '1' then rejoined = 1 end
redis.call('ZADD', P .. 'replicas', now + lease, me)
redis.call('HSET', P .. 'replicas:info', me, info)
return {redis.call('ZRANGEBYSCORE', P .. 'replicas', now, '+inf'),
        redis.call('ZRANGEBYSCORE', P .. 'replicas', '-inf', '(' .. now), rejoined, epoch}
"""
)

_RECEIVE = (
    _NOW
    + _LEAST_LOADED
    + """
-- A batch of received inputs, each appended to its run's inbox and its run placed. ARGV: prefix, receiver,
-- retention ms, notes kept, then per message: run, kind, payload, group ('' if none), held ('1': the receiver holds
-- the run's lease and feeds it itself). Returns per message its inbox id and its run's assignee, or {false, error}
-- for a message not appended (each message's append is its own: one that fails does not fail the others).
-- One note per assignee names the batch's runs placed there ('\0'-joined: an MQTT topic has no NUL), except runs
-- their receiver holds and that stay where they are: it feeds them without a note.
local P, me, retention, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local out, notes, order, noted = {}, {}, {}, {}
for i = 5, #ARGV, 5 do
  local run, group = ARGV[i], ARGV[i + 3]
  local inbox = P .. 'in:' .. run
  local id = redis.pcall('XADD', inbox, '*', 't', ARGV[i + 1], 'p', ARGV[i + 2], 'at', now)
  if type(id) == 'table' and id.err then
    table.insert(out, {false, id.err})
  else
    redis.call('PEXPIRE', inbox, retention)
    local a = redis.call('HGET', P .. 'assign', run)
    local want
    if group ~= '' then
      local g = redis.call('HGET', P .. 'gassign', group)
      if alive(P, g, now) then want = g elseif alive(P, a, now) then want = a else want = least_loaded(P, now, nil) end
      if want then redis.call('HSET', P .. 'gassign', group, want) end
      redis.call('HSET', P .. 'grun', run, group)
    elseif alive(P, a, now) then want = a
    else want = least_loaded(P, now, nil) end
    local moved = false
    if want then moved = place(P, run, want) else want = '' end
    if (moved or want ~= me or ARGV[i + 4] ~= '1') and not noted[want .. ' ' .. run] then
      noted[want .. ' ' .. run] = true
      if not notes[want] then notes[want] = {}; table.insert(order, want) end
      table.insert(notes[want], run)
    end
    table.insert(out, {id, want})
  end
end
for _, to in ipairs(order) do
  redis.call('XADD', P .. 'note', 'MAXLEN', '~', maxlen, '*', 'r', table.concat(notes[to], '\0'), 'a', to)
end
return out
"""
)

_REASSIGN = (
    _NOW
    + _LEAST_LOADED
    + """
-- Place a departed replica's runs on the least-loaded live replicas (a group's runs together), free their
-- leases, note each move, and (ARGV[5] == '1') forget the replica. ARGV: prefix, departed, claimer, notes kept,
-- forget. Returns the moved runs and the departed replica's info when the claimer is the one to take its MQTT
-- session over ('' otherwise).
local P, gone, me = ARGV[1], ARGV[2], ARGV[3]
local s = redis.call('ZSCORE', P .. 'replicas', gone)
if s and tonumber(s) >= now then return {{}, ''} end
local moved = {}
for _, run in ipairs(redis.call('SMEMBERS', P .. 'owned:' .. gone)) do
  local group = redis.call('HGET', P .. 'grun', run)
  local to
  if group then
    to = redis.call('HGET', P .. 'gassign', group)
    if not alive(P, to, now) or to == gone then
      to = least_loaded(P, now, gone)
      if to then redis.call('HSET', P .. 'gassign', group, to) end
    end
  else
    to = least_loaded(P, now, gone)
  end
  if not to then break end
  place(P, run, to)
  local lease = redis.call('GET', P .. 'lease:' .. run)
  if lease and string.sub(lease, 1, string.len(gone) + 1) == gone .. ' ' then redis.call('DEL', P .. 'lease:' .. run) end
  redis.call('XADD', P .. 'note', 'MAXLEN', '~', ARGV[4], '*', 'r', run, 'a', to)
  table.insert(moved, run)
end
if ARGV[5] ~= '1' or redis.call('SCARD', P .. 'owned:' .. gone) > 0 then return {moved, ''} end
local info = redis.call('HGET', P .. 'replicas:info', gone) or ''
redis.call('ZREM', P .. 'replicas', gone)
redis.call('HDEL', P .. 'replicas:info', gone)
local claimed = redis.call('SET', P .. 'adopt:' .. gone, me, 'NX', 'EX', 300)
if claimed and info ~= '' then return {moved, info} end
return {moved, ''}
"""
)

_REBALANCE = (
    _NOW
    + _LEAST_LOADED
    + """
-- Move ungrouped runs from the most to the least loaded live replica until loads differ by at most one
-- (at most ARGV[2] moves per call: a join moves runs over a few heartbeats, not in one burst).
local P, budget = ARGV[1], tonumber(ARGV[2])
local moved = 0
while moved < budget do
  local live = redis.call('ZRANGEBYSCORE', P .. 'replicas', now, '+inf')
  local hi, hn, lo, ln = nil, -1, nil, nil
  for _, r in ipairs(live) do
    local n = redis.call('SCARD', P .. 'owned:' .. r)
    if n > hn or (n == hn and r > hi) then hi, hn = r, n end
    if ln == nil or n < ln or (n == ln and r < lo) then lo, ln = r, n end
  end
  if not hi or hn - ln <= 1 then break end
  local run = nil
  for _, r in ipairs(redis.call('SRANDMEMBER', P .. 'owned:' .. hi, 16)) do
    if not redis.call('HGET', P .. 'grun', r) then run = r; break end
  end
  if not run then break end
  place(P, run, lo)
  redis.call('XADD', P .. 'note', 'MAXLEN', '~', ARGV[3], '*', 'r', run, 'a', lo)
  moved = moved + 1
end
return moved
"""
)

_ACQUIRE = """
-- Take or renew a run's lease. ARGV: prefix, run, me, lease ms. Returns the token, or -1 when another holds it,
-- or -2 when the directory places the run elsewhere (a moved run is not taken back).
local P, run, me = ARGV[1], ARGV[2], ARGV[3]
local key = P .. 'lease:' .. run
if redis.call('HGET', P .. 'assign', run) ~= me then return -2 end
local v = redis.call('GET', key)
if v then
  local owner, tok = string.match(v, '^(.*) (%d+)$')
  if owner == me then
    redis.call('PEXPIRE', key, ARGV[4])
    return tonumber(tok)
  end
  return -1
end
local tok = redis.call('INCR', P .. 'fence:' .. run)
redis.call('SET', key, me .. ' ' .. tok, 'PX', ARGV[4])
return tok
"""

_RELEASE = """
-- Give a lease back, if it is still this token's. ARGV: prefix, run, me, token
local key = ARGV[1] .. 'lease:' .. ARGV[2]
if redis.call('GET', key) == ARGV[3] .. ' ' .. ARGV[4] then redis.call('DEL', key); return 1 end
return 0
"""

_JOURNAL = """
-- The owner's records and inbox cursors of one batch, all or nothing: refused unless every run's token is its
-- current fencing token. ARGV: prefix, me, retention ms, nruns, then per run: run, token, cursor ('' none),
-- nrecords, then per record: kind, body, meta (JSON object of the run's listing fields to set).
local P, me, retention, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local i = 5
local runs = {}
for k = 1, n do
  local run, token, cursor, m = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  if redis.call('GET', P .. 'fence:' .. run) ~= token then return {0, run} end
  runs[k] = {run, cursor, i + 4, m}
  i = i + 4 + 3 * m
end
for k = 1, n do
  local run, cursor, j, m = runs[k][1], runs[k][2], runs[k][3], runs[k][4]
  local rec, meta = P .. 'rec:' .. run, P .. 'meta:' .. run
  for x = 0, m - 1 do
    local kind, body, fields = ARGV[j + 3 * x], ARGV[j + 3 * x + 1], ARGV[j + 3 * x + 2]
    if kind ~= 'step' and kind ~= 'amend' and kind ~= 'finished' and redis.call('HEXISTS', meta, 'ended_at') == 1 then
      -- a run id used again after its run ended: a new run
      redis.call('DEL', rec, P .. 'prog:' .. run, meta)
      redis.call('ZREM', P .. 'ended', run)
    end
    redis.call('RPUSH', rec, body)
    for f, v in pairs(cjson.decode(fields)) do redis.call('HSET', meta, f, tostring(v)) end
    if kind == 'finished' then
      local at = tonumber(cjson.decode(fields)['ended_at'])
      redis.call('ZADD', P .. 'ended', at, run)
      -- Runs that ended more than the retention ago have no journal left (their keys expired): the listing
      -- forgets them too, or it would grow by one entry per run for ever.
      redis.call('ZREMRANGEBYSCORE', P .. 'ended', '-inf', '(' .. string.format('%.3f', at - tonumber(retention) / 1000))
      if redis.call('HGET', P .. 'assign', run) == me then
        redis.call('HDEL', P .. 'assign', run)
        redis.call('SREM', P .. 'owned:' .. me, run)
        redis.call('HDEL', P .. 'grun', run)
      end
      for _, key in ipairs({rec, meta, P .. 'prog:' .. run, P .. 'cur:' .. run, P .. 'in:' .. run, P .. 'fence:' .. run}) do
        redis.call('PEXPIRE', key, retention)
      end
    end
  end
  if cursor ~= '' then
    redis.call('SET', P .. 'cur:' .. run, cursor)
    redis.call('XTRIM', P .. 'in:' .. run, 'MINID', cursor)
  end
end
return {1, ''}
"""

_PROGRESS = """
-- A score and the run's listing fields, if the token is still the run's. ARGV: prefix, run, token, step, body, meta
local P, run = ARGV[1], ARGV[2]
if redis.call('GET', P .. 'fence:' .. run) ~= ARGV[3] then return 0 end
redis.call('HSET', P .. 'prog:' .. run, ARGV[4], ARGV[5])
for f, v in pairs(cjson.decode(ARGV[6])) do redis.call('HSET', P .. 'meta:' .. run, f, tostring(v)) end
return 1
"""

_MARK = """
-- Note in a run's listing which signal or progress message the broker acknowledged (its step), if the token is
-- still the run's. ARGV: prefix, run, token, step, field ('signal_sent' or 'progress_sent')
if redis.call('GET', ARGV[1] .. 'fence:' .. ARGV[2]) ~= ARGV[3] then return 0 end
redis.call('HSET', ARGV[1] .. 'meta:' .. ARGV[2], ARGV[5], ARGV[4])
return 1
"""

_CURSOR = """
-- Move a run's inbox cursor past events that left no record (refused, duplicates). ARGV: prefix, run, token, id
local P, run = ARGV[1], ARGV[2]
if redis.call('GET', P .. 'fence:' .. run) ~= ARGV[3] then return 0 end
redis.call('SET', P .. 'cur:' .. run, ARGV[4])
redis.call('XTRIM', P .. 'in:' .. run, 'MINID', ARGV[4])
return 1
"""

_RETIRE = """
-- Take a run that is over out of the directory, unless its inbox got an event past the cursor meanwhile.
-- ARGV: prefix, run, me, token, retention ms
local P, run, me = ARGV[1], ARGV[2], ARGV[3]
if redis.call('GET', P .. 'fence:' .. run) ~= ARGV[4] then return 0 end
local last = redis.call('XREVRANGE', P .. 'in:' .. run, '+', '-', 'COUNT', 1)
if #last > 0 and last[1][1] ~= redis.call('GET', P .. 'cur:' .. run) then return 0 end
if redis.call('HGET', P .. 'assign', run) == me then
  redis.call('HDEL', P .. 'assign', run)
  redis.call('SREM', P .. 'owned:' .. me, run)
  redis.call('HDEL', P .. 'grun', run)
end
local key = P .. 'lease:' .. run
if redis.call('GET', key) == me .. ' ' .. ARGV[4] then redis.call('DEL', key) end
if redis.call('HEXISTS', P .. 'meta:' .. run, 'started_at') == 0 then
  -- never started (steps dropped after --hold, refused events, a flood of made-up run ids): nothing to keep. The
  -- fencing counter stays (expiring): a later owner's tokens must stay above any a paused replica may hold.
  redis.call('DEL', P .. 'in:' .. run, P .. 'cur:' .. run, P .. 'rec:' .. run, P .. 'prog:' .. run)
  redis.call('PEXPIRE', P .. 'fence:' .. run, ARGV[5])
end
return 1
"""


SCRIPTS = {
    "heartbeat": _HEARTBEAT,
    "receive": _RECEIVE,
    "reassign": _REASSIGN,
    "rebalance": _REBALANCE,
    "acquire": _ACQUIRE,
    "release": _RELEASE,
    "journal": _JOURNAL,
    "progress": _PROGRESS,
    "cursor": _CURSOR,
    "mark": _MARK,
    "retire": _RETIRE,
}
"""The scripts by name: each replica registers them at start (EVALSHA, loaded again after a Redis
restart)."""


async def piped(
    redis: Any, calls: Sequence[tuple[Any, Sequence[Any]]], *, raise_on_error: bool = True
) -> list[Any]:
    """Run script calls (a registered script and its ARGV) in one pipeline, one round trip; their
    results in order.

    redis-py's own way (`script(args, client=pipe)`) sends SCRIPT EXISTS before every such pipeline:
    a second round trip for each batch received, fed or written. Here the calls go as EVALSHA; a
    script Redis does not have (it restarted) is loaded and only the calls it refused run again (a
    refused call did nothing). With `raise_on_error` False a failed call's result is its exception.
    """
    from redis.exceptions import NoScriptError

    async with redis.pipeline(transaction=False) as pipe:
        for script, args in calls:
            pipe.evalsha(script.sha, 0, *args)
        results: list[Any] = await pipe.execute(raise_on_error=False)
    again = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
    if again:
        for script in {id(calls[i][0]): calls[i][0] for i in again}.values():
            script.sha = await redis.script_load(script.script)
        async with redis.pipeline(transaction=False) as pipe:
            for i in again:
                script, args = calls[i]
                pipe.evalsha(script.sha, 0, *args)
            for i, r in zip(again, await pipe.execute(raise_on_error=False), strict=True):
                results[i] = r
    if raise_on_error:
        for r in results:
            if isinstance(r, Exception):
                raise r
    return results
