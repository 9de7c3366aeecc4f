"""Cluster mode: replicas share runs through Redis and an MQTT 5 shared subscription, one owner per run.

Why it is built this way (docs/cluster.md has the operator's side):

- Mosquitto hands each message of a shared subscription to one member, round-robin per message,
  and keeps what it queued for a member whose session is offline in that member's session
  (mosquitto #1747, #2662). So a run's steps reach different replicas in any order, and a dead
  replica's share must be taken from its session.
- Receiving is therefore separate from owning. Any replica appends what it receives to the run's
  inbox (a Redis stream) before it acknowledges it (journal before ack); the receiver does not decode.
- A directory in Redis places each run on one live replica (least loaded at its first event,
  sticky; a group's runs together). The placed replica holds the run's lease (`SET NX PX`, renewed
  every heartbeat) with a fencing token (`INCR`); every write it makes (records, cursor, scores)
  runs in a script that refuses it unless the token is the run's current one, and what it queued
  to publish is dropped once its local lease deadline has passed. A paused "zombie" owner is
  therefore harmless.
- The owner reads the inbox from its cursor and hands the events to the ordinary Monitor
  (`handle_batch`: decide, journal, apply; steps in index order, out-of-order steps held), whose
  run store here is `ClusterStore`: the accepted records and the new cursor in one fenced script.
  A new owner replays the records, takes the stored scores and scores only the newest prefix.
- A replica whose heartbeat is older than the lease is dead: its runs are placed again (leases
  freed at once), and one survivor takes its MQTT session over (same client id, session expiry 0),
  journals what the broker had queued there, unsubscribes and lets the session go.

Keys (one Redis; the per-run ones end in the run id, ready for Redis Cluster hash tags):
`am:{name}:replicas` (zset: replica -> heartbeat deadline, ms of Redis' clock), `:replicas:info`,
`:assign` (run -> replica), `:owned:{replica}` (set), `:gassign` (group -> replica), `:grun`
(run -> group), `:note` (stream: run, assignee), `:ended` (zset), `:samples`, `:rankings`, and per run
`:in:{run}` (inbox stream), `:lease:{run}`, `:fence:{run}`, `:rec:{run}` (records), `:cur:{run}`
(inbox cursor), `:prog:{run}` (step -> progress), `:meta:{run}`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from ..calibration import Sample
from ..wire import RunEnd, RunStart, StepIn
from ._config import ClusterSettings
from ._metrics import Metrics
from ._state import (
    Delivery,
    Ended,
    Finished,
    GapFilled,
    Orphaned,
    OrphansDropped,
    Record,
    Started,
    Stepped,
)
from ._store import PLACEHOLDER_PNG, Replay, _totals, _totals_row

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from ._monitor import Monitor
    from ._mqtt import MqttLink

log = structlog.get_logger("agent_monitor.cluster")
T = TypeVar("T")

_MAX_RUN_ID = 256
"""Longest run id a receiver journals (topic-safe ids are far shorter; a key per run is built from it)."""
_NOTES_MAXLEN = 100_000
"""Notes kept (approximately): a replica reads them as they come; a missed one is caught by the heartbeat's check."""
_FEED_PAGE = 256
"""Inbox entries read per run at once."""
_PUBLISH_MARGIN_S = 0.5
"""A replica stops publishing about a run this long before its lease would expire (clocks and delays)."""
_CHECK_EVERY = 5
"""Heartbeats between checks of the owned runs' inboxes for events no note announced."""
_SESSION_TRIES = 10
"""Attempts at taking a departed replica's session over (one every two heartbeats) before leaving it."""
_QUIET_S = 1.0
"""Taking a session over: it is emptied once the broker has sent nothing for this long."""

# -- scripts (Lua, run atomically by Redis; times are Redis' own clock, so replicas' clocks need not agree) --

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

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
local before = redis.call('ZSCORE', P .. 'replicas', me)
local rejoined = 0
if before and tonumber(before) < now then rejoined = 1 end
if not before and ARGV[5] == '1' then rejoined = 1 end
redis.call('ZADD', P .. 'replicas', now + lease, me)
redis.call('HSET', P .. 'replicas:info', me, info)
return {redis.call('ZRANGEBYSCORE', P .. 'replicas', now, '+inf'),
        redis.call('ZRANGEBYSCORE', P .. 'replicas', '-inf', '(' .. now), rejoined}
"""
)

_RECEIVE = (
    _NOW
    + _LEAST_LOADED
    + """
-- KEYS[1]: the run's inbox. ARGV: prefix, run, kind, payload, group ('' if none), retention ms
local P, run, group = ARGV[1], ARGV[2], ARGV[5]
local id = redis.call('XADD', KEYS[1], '*', 't', ARGV[3], 'p', ARGV[4], 'at', now)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
local a = redis.call('HGET', P .. 'assign', run)
local want
if group ~= '' then
  local g = redis.call('HGET', P .. 'gassign', group)
  if alive(P, g, now) then want = g elseif alive(P, a, now) then want = a else want = least_loaded(P, now, nil) end
  redis.call('HSET', P .. 'gassign', group, want)
  redis.call('HSET', P .. 'grun', run, group)
elseif alive(P, a, now) then want = a
else want = least_loaded(P, now, nil) end
if want then place(P, run, want) else want = '' end
redis.call('XADD', P .. 'note', 'MAXLEN', '~', ARGV[7], '*', 'r', run, 'a', want)
return {id, want}
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
    if kind ~= 'step' and kind ~= 'finished' and redis.call('HEXISTS', meta, 'ended_at') == 1 then
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
-- Note in a run's listing which signal the broker acknowledged (its decision's step), if the token is still the
-- run's. ARGV: prefix, run, token, step
if redis.call('GET', ARGV[1] .. 'fence:' .. ARGV[2]) ~= ARGV[3] then return 0 end
redis.call('HSET', ARGV[1] .. 'meta:' .. ARGV[2], 'signal_sent', ARGV[4])
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


class ClusterUnavailable(ConnectionError):
    """Redis cannot be reached or refused the cluster's commands; the message says which and what to check."""


class Fenced(RuntimeError):
    """A write refused because this replica no longer owns the run (another took it over)."""


@dataclass(slots=True)
class _Owned:
    """A run this replica holds the lease of."""

    token: int
    deadline: float
    """Monotonic time until which this replica may publish about the run."""
    cursor: str = ""
    """The inbox id of the last event journaled (persisted with the records)."""
    fed: str = ""
    """The inbox id of the last event handed to the monitor."""
    ready: bool = False
    """Taken over (its journal replayed): only then are its inbox's events handed to the monitor."""


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _later(a: str, b: str) -> str:
    """The later of two stream ids ('' is before every id)."""
    if not a:
        return b
    if not b:
        return a
    return a if _id(a) >= _id(b) else b


def _text(v: object) -> str:
    """A Redis reply as text (replies are bytes: the connection does not decode, payloads are bytes)."""
    return v.decode() if isinstance(v, bytes) else str(v)


class Cluster:
    """One replica's part in the cluster: membership, placement, leases, the shared inboxes and journals."""

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        monitor: Monitor,
        metrics: Metrics,
        retention_s: float,
        redis: aioredis.Redis | None = None,
    ) -> None:
        if redis is None:
            redis, _ = cluster_redis(settings)
        self.redis = redis
        self.settings = settings
        self.monitor = monitor
        self.metrics = metrics
        self.replica_id = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.prefix = f"am:{settings.name}:"
        self.lease_ms = int(settings.lease_s * 1000)
        self.retention_ms = max(1, int(retention_s * 1000))
        self.store = ClusterStore(self)
        self.owned: dict[str, _Owned] = {}
        self._closing: dict[str, tuple[float, int]] = {}
        """Runs no longer owned here (finished, or being handed over) whose queued messages may still be published,
        with the lease deadline until which they may."""
        self.live: tuple[str, ...] = ()
        """The live replicas at the last heartbeat (this one included)."""
        self._client_id = ""
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._owning = asyncio.Lock()
        self._sessions: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._notes_from = "$"
        self._joined = False
        self._leaving = False
        self._aside = False
        """Stepped aside (cut off from the broker past a lease): no heartbeats, no runs, until the broker is back."""
        self._scripts: dict[str, Any] = {}
        self._beats = 0

    # -- identity --

    def client_id(self, base: str) -> str:
        """This replica's MQTT client id: unique per replica (the broker keeps one session per client id)."""
        self._client_id = f"{base}-{self.replica_id}"
        return self._client_id

    def status(self) -> dict[str, Any]:
        """The replica's part of `Monitor.status()`."""
        return {"replica": self.replica_id, "replicas": len(self.live), "owned": len(self.owned)}

    def key(self, what: str, run_id: str = "") -> str:
        """A cluster key: `am:{name}:{what}` or, per run, `am:{name}:{what}:{run}`."""
        return f"{self.prefix}{what}:{run_id}" if run_id else f"{self.prefix}{what}"

    # -- lifecycle --

    async def open(self) -> None:
        """Reach Redis, register the scripts and join (raise ClusterUnavailable with a one-line reason)."""
        for name, src in (
            ("heartbeat", _HEARTBEAT),
            ("receive", _RECEIVE),
            ("reassign", _REASSIGN),
            ("rebalance", _REBALANCE),
            ("acquire", _ACQUIRE),
            ("release", _RELEASE),
            ("journal", _JOURNAL),
            ("progress", _PROGRESS),
            ("cursor", _CURSOR),
            ("mark", _MARK),
            ("retire", _RETIRE),
        ):
            self._scripts[name] = self.redis.register_script(src)
        try:
            await self.redis.ping()
            if self.settings.replica_id is not None and await self._alive(self.replica_id):
                raise ClusterUnavailable(
                    f"replica id {self.replica_id!r} is in use by a live replica of cluster {self.settings.name!r}; "
                    "give each replica its own --replica-id (or none: a fresh one each start)"
                )
            await self._heartbeat()
            last = await self.redis.xrevrange(self.key("note"), count=1)
            self._notes_from = _text(last[0][0]) if last else "0-0"
        except ClusterUnavailable:
            raise
        except Exception as e:
            raise ClusterUnavailable(
                f"cannot join the cluster in Redis at {self.settings.url}: {type(e).__name__}: {e}; "
                "check that Redis runs there (redis-server) and the URL's host, port and database"
            ) from None
        self._joined = True
        log.info("cluster_joined", cluster=self.settings.name, replica=self.replica_id, replicas=len(self.live))

    def loops(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """The background loops the Monitor runs in its TaskGroup, with their task names."""
        return [
            ("cluster-heartbeat", self._heartbeats()),
            ("cluster-notes", self._notes()),
            ("cluster-feed", self._feeder()),
            ("cluster-writer", self.store.writer()),
            ("cluster-sessions", self._session_taker()),
        ]

    async def leave(self, link: MqttLink | None) -> None:
        """Leave the cluster (a graceful stop): stop receiving, hand the runs over, let a survivor clean the session."""
        if not self._joined or self._leaving:
            return
        self._leaving = True
        try:
            async with asyncio.timeout(10):
                if link is not None:
                    await link.stop_receiving()
                    await asyncio.sleep(0.2)  # a batch being journaled finishes and is acknowledged
                owned = len(self.owned)
                # As for a move: what the runs queued goes out, their scores are written, then their leases freed.
                await self._give_back(list(self.owned))
                await self.store.flush()
                async with self.redis.pipeline(transaction=False) as pipe:
                    # Marked departed (not removed): a survivor places our runs at once and takes over our MQTT
                    # session, which may still hold a message delivered as we unsubscribed.
                    pipe.zadd(self.key("replicas"), {self.replica_id: 0})
                    pipe.delete(self.key("adopt", self.replica_id))
                    await pipe.execute()
                # Our runs go to the others now (not when our heartbeat expires); a survivor forgets us later.
                moved, _ = await self._reassign(self.replica_id, claim=False)
                log.info("cluster_left", replica=self.replica_id, runs_handed_over=owned, placed=len(moved))
        except Exception as e:
            log.warning("cluster_leave_incomplete", error=f"{type(e).__name__}: {e}", note="the lease will expire")

    async def aclose(self) -> None:
        """Close the Redis connection."""
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    # -- receiving: any replica, before the MQTT acknowledgement --

    async def receive(self, batch: Sequence[tuple[str, bytes, Delivery | None]]) -> list[BaseException | None]:
        """Journal received messages into their runs' inboxes (in one round trip); per message None or the error."""
        errors: list[BaseException | None] = [None] * len(batch)
        m = self.monitor
        calls: list[int] = []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i, (topic, payload, _) in enumerate(batch):
                if m.topics.is_output(topic):
                    continue
                parts = topic.rsplit("/", 2)
                run_id, kind = (parts[-2], parts[-1]) if len(parts) == 3 else ("", "")
                if not run_id or len(run_id) > _MAX_RUN_ID or kind not in ("start", "step", "end"):
                    continue  # not an input (the shared filters match only inputs)
                if len(payload) > m.config.max_payload_bytes:
                    log.warning("payload_too_large", run_id=run_id[:80], bytes=len(payload))
                    self.metrics.invalid_events.labels("payload_too_large").inc()
                    continue
                group = _group_of(payload) if kind == "start" else ""
                await self._scripts["receive"](
                    keys=[self.key("in", run_id)],
                    args=[self.prefix, run_id, kind, payload, group, self.retention_ms, _NOTES_MAXLEN],
                    client=pipe,
                )
                calls.append(i)
            if not calls:
                return errors
            try:
                results = await pipe.execute(raise_on_error=False)
            except Exception as e:
                self.metrics.cluster_errors.labels("receive").inc()
                log.warning("cluster_receive_failed", messages=len(calls), error=f"{type(e).__name__}: {e}")
                for i in calls:
                    errors[i] = e
                return errors
        for i, r in zip(calls, results, strict=True):
            if isinstance(r, Exception):
                self.metrics.cluster_errors.labels("receive").inc()
                errors[i] = r
                continue
            assignee = _text(r[1])
            if assignee == self.replica_id:
                run_id = batch[i][0].rsplit("/", 2)[-2]
                if run_id in self.owned:
                    self._dirty.add(run_id)
                    self._wake.set()
        return errors

    # -- owning --

    def may_publish(self, run_id: str) -> bool:
        """Whether this replica owns the run now (holds its lease, with time to spare): only the owner publishes."""
        o = self.owned.get(run_id)
        if o is not None:
            return time.monotonic() < o.deadline
        # A run that just finished or is being handed over: what it queued (a retained signal) still goes out.
        return time.monotonic() < self._closing.get(run_id, (0.0, 0))[0]

    def signal_sent(self, run_id: str, step: int) -> None:
        """The broker acknowledged a run's signal: note it, so that a new owner publishes it again only if it was not."""
        o = self.owned.get(run_id)
        token = o.token if o is not None else self._closing.get(run_id, (0.0, 0))[1]
        if token:
            self.store.later(self._scripts["mark"], [self.prefix, run_id, token, step])

    def token(self, run_id: str) -> int:
        """The run's fencing token this replica holds; Fenced when it holds none."""
        o = self.owned.get(run_id)
        if o is None:
            self.metrics.cluster_fenced.labels("write").inc()
            raise Fenced(f"run {run_id!r} is not owned by replica {self.replica_id}")
        return o.token

    async def _run(self, op: str, aw: Any) -> Any:
        try:
            return await aw
        except Exception:
            self.metrics.cluster_errors.labels(op).inc()
            raise

    async def _heartbeat(self) -> None:
        info = json.dumps({"client_id": self._client_id, "pid": os.getpid(), "host": socket.gethostname()})
        sent = time.monotonic()
        live, dead, rejoined = await self._scripts["heartbeat"](
            args=[self.prefix, self.replica_id, self.lease_ms, info, "1" if self._joined else "0"]
        )
        self.live = tuple(sorted(_text(r) for r in live))
        self.metrics.cluster_replicas.set(len(self.live))
        if rejoined and self._joined:
            # Declared dead meanwhile (paused, or cut off from Redis past the lease): our runs were placed
            # elsewhere and our leases freed; whatever we hold here is stale.
            log.warning("cluster_rejoined", replica=self.replica_id, runs_dropped=len(self.owned))
            for run_id in list(self.owned):
                await self._drop(run_id)
        for d in dead:
            await self._reassign(_text(d), claim=True)
        self._last_beat = sent

    async def _reassign(self, gone: str, *, claim: bool) -> tuple[list[str], str]:
        moved, info = await self._scripts["reassign"](
            args=[self.prefix, gone, self.replica_id, _NOTES_MAXLEN, "1" if claim else "0"]
        )
        runs = [_text(r) for r in moved]
        if runs:
            log.info("cluster_runs_placed", departed=gone, runs=len(runs))
        text = _text(info)
        if claim and text:
            self._sessions.put_nowait({"replica": gone, **json.loads(text)})
        return runs, text

    async def _heartbeats(self) -> None:
        link = self.monitor.link
        last_ok = time.monotonic()
        broker_lost: float | None = None
        while True:
            try:
                if self._aside:
                    await self.redis.ping()  # no heartbeat while stepped aside, only whether Redis answers
                else:
                    await self._tick()
                redis_ok = True
            except asyncio.CancelledError:
                raise
            except Exception as e:
                redis_ok = False
                self.metrics.cluster_errors.labels("heartbeat").inc()
                log.warning("cluster_heartbeat_failed", error=f"{type(e).__name__}: {e}")
            now = time.monotonic()
            if link is not None:
                if redis_ok:
                    last_ok = now
                    if not link.allowed.is_set():
                        log.info("cluster_reachable_again", replica=self.replica_id)
                        link.allowed.set()
                elif link.allowed.is_set() and now - last_ok > self.settings.lease_s:
                    # Cut off from Redis past the lease: the others count this replica dead and take its session
                    # over. It must not connect again meanwhile (a second client with the same id would push the
                    # taker off): its link waits, once its connection ends, until Redis answers again.
                    log.warning("cluster_unreachable", replica=self.replica_id, note="receiving paused")
                    link.allowed.clear()
                if link.connected.is_set():
                    broker_lost = None
                    if self._aside:
                        log.info("cluster_broker_back", replica=self.replica_id, note="joining again")
                        self._aside = False  # the next heartbeat finds it was counted departed, and joins afresh
                elif not link.allowed.is_set():
                    broker_lost = None  # not connected because it waits for Redis: not the broker's doing
                elif broker_lost is None:
                    broker_lost = now
                elif not self._aside and now - broker_lost > self.settings.lease_s:
                    try:
                        await self._step_aside()
                    except Exception as e:
                        log.warning("cluster_step_aside_incomplete", error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _step_aside(self) -> None:
        """Without the broker past a lease: hand the runs over and count as departed until the broker is back.

        Its session keeps getting a share of every run's inputs meanwhile (the broker queues them there), so the
        other replicas' runs would wait for those steps too: departed, a survivor takes the session over and
        empties it, and the runs go on elsewhere. Its heartbeats stop until the broker answers again.
        """
        log.warning("cluster_broker_unreachable", replica=self.replica_id, runs=len(self.owned), note="stepping aside")
        self._aside = True
        await self._give_back(list(self.owned))
        await self.store.flush()
        await self.redis.zadd(self.key("replicas"), {self.replica_id: 0})
        await self._reassign(self.replica_id, claim=False)

    async def _tick(self) -> None:
        """One heartbeat: membership, departed replicas, balance, then this replica's leases (taken, renewed, given)."""
        if self._leaving or self._aside:
            return
        await self._heartbeat()
        now = time.monotonic()
        for run_id in [r for r, (until, _) in self._closing.items() if until <= now]:
            del self._closing[run_id]
        await self._scripts["rebalance"](args=[self.prefix, 8, _NOTES_MAXLEN])
        mine = {_text(r) for r in await self.redis.smembers(self.key("owned", self.replica_id))}
        await self._give_back([r for r in self.owned if r not in mine])
        await self._renew()
        await self._take(sorted(mine - set(self.owned)))
        self._beats += 1
        # Runs that are over here but still placed here (steps that never got a start, dropped after --hold).
        m = self.monitor
        for run_id, o in list(self.owned.items()):
            if o.ready and run_id not in m.book.live and run_id not in m.book.orphans:
                await self._retire_if_over(run_id)
        # A missed note (or one for a run taken since) is caught here, every few beats: an owned inbox past what was
        # fed.
        owned = list(self.owned) if self._beats % _CHECK_EVERY == 0 else []
        if owned:
            async with self.redis.pipeline(transaction=False) as pipe:
                for run_id in owned:
                    pipe.xrevrange(self.key("in", run_id), count=1)
                lasts = await pipe.execute()
            for run_id, last in zip(owned, lasts, strict=True):
                held = self.owned.get(run_id)
                if held is not None and last and _id(_text(last[0][0])) > _id(held.fed or "0-0"):
                    self._dirty.add(run_id)
            if self._dirty:
                self._wake.set()
        self.metrics.runs_owned.set(len(self.owned))

    async def _renew(self) -> None:
        owned = list(self.owned.items())
        if not owned:
            return
        sent = time.monotonic()
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, _ in owned:
                await self._scripts["acquire"](args=[self.prefix, run_id, self.replica_id, self.lease_ms], client=pipe)
            tokens = await pipe.execute()
        for (run_id, o), tok in zip(owned, tokens, strict=True):
            if self.owned.get(run_id) is not o:
                continue
            if int(tok) == o.token:
                o.deadline = sent + self.settings.lease_s - _PUBLISH_MARGIN_S
            else:
                # Lost (another holds it, the directory moved it) or taken afresh after it expired: what we hold may
                # be stale either way, so drop it; a run still placed here is taken again from its journal.
                log.info("cluster_lease_lost", run_id=run_id, token=o.token, now=int(tok))
                await self._drop(run_id)
                if int(tok) == -2:  # moved elsewhere while still ours: free it for its new owner now
                    self.store.later(self._scripts["release"], [self.prefix, run_id, self.replica_id, o.token])

    async def _take(self, runs: Sequence[str]) -> None:
        """Acquire runs' leases and take each over from its journal (records, scores, inbox cursor).

        Many at once (a burst of new runs, a failover): one round trip for the leases, one for the journals.
        """
        async with self._owning:
            runs = [r for r in dict.fromkeys(runs) if r not in self.owned]
            if not runs or self._leaving or self._aside:
                return
            sent = time.monotonic()
            async with self.redis.pipeline(transaction=False) as pipe:
                for run_id in runs:
                    await self._scripts["acquire"](
                        args=[self.prefix, run_id, self.replica_id, self.lease_ms], client=pipe
                    )
                tokens = await pipe.execute()
            got = {r: int(t) for r, t in zip(runs, tokens, strict=True) if int(t) > 0}
            if not got:
                return
            journals = await self.store.read_runs(list(got))
            for run_id, tok in got.items():
                o = _Owned(tok, sent + self.settings.lease_s - _PUBLISH_MARGIN_S)
                try:
                    replay, cursor, signal_out = journals[run_id]
                    self.owned[run_id] = o
                    o.cursor = o.fed = cursor
                    await self.monitor.adopt(
                        run_id, replay.records, replay.progress.get(run_id, ()), signal_sent=signal_out
                    )
                    o.ready = True
                except Exception:
                    self.owned.pop(run_id, None)
                    log.exception("cluster_take_failed", run_id=run_id)
                    with contextlib.suppress(Exception):
                        await self._scripts["release"](args=[self.prefix, run_id, self.replica_id, tok])
                    continue
                if tok > 1:
                    self.metrics.run_takeovers.inc()
                self._dirty.add(run_id)
            self.metrics.runs_owned.set(len(self.owned))
            self._wake.set()

    async def _drop(self, run_id: str) -> None:
        """Forget a run here (another replica owns it, or will)."""
        if self.owned.pop(run_id, None) is not None:
            await self.monitor.release(run_id)
            self.metrics.runs_owned.set(len(self.owned))

    async def _give_back(self, runs: Sequence[str]) -> None:
        """Runs placed elsewhere now: forget them, let what they queued be published, then free their leases."""
        handed = {r: o for r in runs if (o := self.owned.get(r)) is not None}
        if not handed:
            return
        for run_id, o in handed.items():
            self._closing[run_id] = (o.deadline, o.token)
            await self._drop(run_id)
        # A signal queued just before the move must still reach the harness (the new owner does not publish it
        # again), and before the new owner can publish anything newer: the leases are freed once the messages
        # are out (or after a bounded wait).
        outbox = self.monitor.outbox
        until = time.monotonic() + min(1.0, self.settings.lease_s / 4)
        while any(outbox.pending(r) for r in handed) and time.monotonic() < until:  # noqa: ASYNC110 (bounded poll)
            await asyncio.sleep(0.02)
        for run_id, o in handed.items():
            self._closing.pop(run_id, None)
            # Queued behind the run's score writes (the writer keeps order): its scores so far go with it.
            self.store.later(self._scripts["release"], [self.prefix, run_id, self.replica_id, o.token])

    async def _notes(self) -> None:
        """Follow the note stream: runs placed here are taken at once, owned runs with new events are fed."""
        while True:
            try:
                got: Any = await self.redis.xread({self.key("note"): self._notes_from}, count=1000, block=1000)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.metrics.cluster_errors.labels("notes").inc()
                log.warning("cluster_notes_failed", error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(self.settings.heartbeat_s)
                continue
            new: list[str] = []
            for _, entries in got or ():
                for entry_id, fields in entries:
                    self._notes_from = _text(entry_id)
                    sample = fields.get(b"s")
                    if sample is not None:
                        self._learn(sample)
                        continue
                    run_id, to = _text(fields.get(b"r", b"")), _text(fields.get(b"a", b""))
                    if run_id in self.owned:
                        self._dirty.add(run_id)
                    elif to == self.replica_id and not self._leaving:
                        new.append(run_id)
            try:
                await self._take(new)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the heartbeat takes them at its next beat
                self.metrics.cluster_errors.labels("take").inc()
                log.warning("cluster_take_failed", runs=len(new), error=f"{type(e).__name__}: {e}")
            if self._dirty:
                self._wake.set()

    def _learn(self, raw: bytes) -> None:
        """A calibration sample another replica learnt: every replica's "auto" thresholds use the same evidence."""
        try:
            sample = Sample.from_json(json.loads(raw))
            if self.monitor.calibration.add(sample):
                self.monitor._families.update(sample.family, sample.at)
        except Exception:
            log.exception("calibration_sample_unreadable")

    async def _feeder(self) -> None:
        """Hand owned runs' new inbox events to the monitor, in inbox order per run, many runs per batch."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            try:
                held = [r for r in dirty if (o := self.owned.get(r)) is not None and o.ready]
                self._dirty |= {r for r in dirty if r in self.owned and r not in held}
                await self._feed(held)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.metrics.cluster_errors.labels("feed").inc()
                log.warning("cluster_feed_failed", error=f"{type(e).__name__}: {e}")
                self._dirty |= dirty
                await asyncio.sleep(0.5)
                self._wake.set()

    async def _feed(self, runs: list[str]) -> None:
        if not runs:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in runs:
                fed = self.owned[run_id].fed
                pipe.xrange(self.key("in", run_id), min=f"({fed}" if fed else "-", count=_FEED_PAGE)
            pages = await pipe.execute()
        messages: list[tuple[str, bytes, Delivery | None]] = []
        last: dict[str, str] = {}
        topics = self.monitor.topics
        for run_id, page in zip(runs, pages, strict=True):
            if len(page) >= _FEED_PAGE:
                self._dirty.add(run_id)  # more after this page
                self._wake.set()
            for entry_id, fields in page:
                eid = _text(entry_id)
                kind = _text(fields[b"t"])
                topic = topics.of(run_id, kind)
                payload = fields[b"p"]
                messages.append((topic, payload, Delivery(0, eid, cursor=eid)))
                last[run_id] = eid
        if not messages:
            return
        for run_id, eid in last.items():
            if (held := self.owned.get(run_id)) is not None:
                held.fed = eid
        errors = await self.monitor.handle_batch(messages)
        failed = {messages[i][0].rsplit("/", 2)[-2] for i, e in enumerate(errors) if e is not None}
        for run_id in failed:
            # A record that did not commit: forget the run rather than guess which of its events the state holds.
            # Fenced, it is another replica's now; otherwise (Redis failed) the next heartbeat takes it again from
            # its journal, under the lease this replica still holds.
            await self._drop(run_id)
        # Events that left no record (refused, duplicates) are consumed too: the cursor moves past them.
        behind = [(r, w) for r in last if r not in failed and (w := self.owned.get(r)) and w.fed != w.cursor]
        if behind:
            async with self.redis.pipeline(transaction=False) as pipe:
                for run_id, o in behind:
                    await self._scripts["cursor"](args=[self.prefix, run_id, o.token, o.fed], client=pipe)
                done = await pipe.execute()
            for (_run, o), ok in zip(behind, done, strict=True):
                if int(ok):
                    o.cursor = _later(o.cursor, o.fed)
        for run_id in last:
            if run_id in failed:
                continue
            await self._retire_if_over(run_id)

    async def _retire_if_over(self, run_id: str) -> None:
        """A run that is over here (finished, or only late events for an ended run) leaves the directory."""
        m = self.monitor
        if run_id in m.book.live or run_id in m.book.orphans:
            return
        o = self.owned.get(run_id)
        if o is None:
            return
        if int(await self._scripts["retire"](args=[self.prefix, run_id, self.replica_id, o.token, self.retention_ms])):
            self.owned.pop(run_id, None)
            self.metrics.runs_owned.set(len(self.owned))

    def finished(self, run_id: str) -> None:
        """The run finished here (its end record journaled): it left the directory, so the lease goes too."""
        o = self.owned.pop(run_id, None)
        if o is not None:
            self._closing[run_id] = (o.deadline, o.token)
            self.metrics.runs_owned.set(len(self.owned))
            self.store.later(self._scripts["release"], [self.prefix, run_id, self.replica_id, o.token])

    # -- a departed replica's MQTT session --

    async def _session_taker(self) -> None:
        while True:
            info = await self._sessions.get()
            try:
                await self._take_session(info)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                tries = int(info.get("tries", 0)) + 1
                gone = str(info.get("replica", ""))
                back = await self._alive(gone)
                log.warning(
                    "cluster_session_not_taken",
                    replica=gone,
                    error=f"{type(e).__name__}: {e}",
                    retry=not back and tries < _SESSION_TRIES,
                    note="the replica is back: its session is its own" if back else None,
                )
                if not back and tries < _SESSION_TRIES:
                    # Its queued messages stay in the session (kept: nothing asked the broker to delete it); again.
                    await asyncio.sleep(self.settings.heartbeat_s * 2)
                    self._sessions.put_nowait({**info, "tries": tries})

    async def _alive(self, replica: str) -> bool:
        """Whether a replica's heartbeat is current (by Redis' clock); False when Redis cannot say."""
        with contextlib.suppress(Exception):
            score = await self.redis.zscore(self.key("replicas"), replica)
            secs, micros = await self.redis.time()
            return score is not None and float(score) >= secs * 1000 + micros // 1000
        return False

    async def _take_session(self, info: Mapping[str, Any]) -> None:
        """Empty a departed replica's MQTT session into the inboxes, then let the broker delete it."""
        link = self.monitor.link
        client_id = str(info.get("client_id") or "")
        if link is None or not client_id:
            return
        import aiomqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        b = link.broker
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        # Resume the session (clean start off), keeping its expiry: if this fails halfway, what is still queued
        # there stays for the next attempt. Only once it is empty does the DISCONNECT ask the broker to delete it.
        props.SessionExpiryInterval = link.session_expiry_s
        client = aiomqtt.Client(
            b.host,
            b.port,
            identifier=client_id,
            username=b.username,
            password=b.password,
            tls_context=b.ssl_context(),
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=False,
            properties=props,
            timeout=10,
        )
        client._client.manual_ack_set(True)
        taken = 0
        async with client:
            # Out of the shared subscription first: as a member, the resumed session gets its turn of every new
            # message, so under steady traffic it would never fall quiet (and a second dead session, queued behind
            # this one, would wait as long). The messages already queued in the session are still delivered after
            # the UNSUBSCRIBE (MQTT 5 3.10.4; measured on Mosquitto 2.0.11: 100 queued of 100 arrived).
            await client.unsubscribe(link.shared_filters())
            it: AsyncIterator[aiomqtt.Message] = client.messages.__aiter__()
            while True:
                try:
                    first = await asyncio.wait_for(it.__anext__(), _QUIET_S)
                except TimeoutError:
                    break  # emptied
                batch = [first]
                while not client._queue.empty():
                    batch.append(client._queue.get_nowait())
                items = []
                for msg in batch:
                    payload = msg.payload if isinstance(msg.payload, bytes) else str(msg.payload or "").encode()
                    items.append((msg.topic.value, payload, None))
                errors = await self.receive(items)
                for msg, error in zip(batch, errors, strict=True):
                    if error is None and msg.qos > 0:
                        client._client.ack(msg.mid, msg.qos)
                taken += sum(e is None for e in errors)
                if any(e is not None for e in errors):
                    raise ConnectionError("messages could not be journaled; the session is left for another attempt")
            gone = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
            gone.SessionExpiryInterval = 0  # emptied and unsubscribed: the broker may delete it now
            client._client.disconnect(properties=gone)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(client._disconnected), 10)
        self.metrics.sessions_adopted.inc()
        log.info("cluster_session_taken", replica=info.get("replica"), client_id=client_id, messages=taken)


def _group_of(payload: bytes) -> str:
    """A start's group, read just enough to place the run with its siblings ('' when none or unreadable)."""
    if b'"group"' not in payload:
        return ""
    try:
        group = json.loads(payload).get("group")
    except (ValueError, AttributeError):
        return ""
    return group if isinstance(group, str) and len(group) <= _MAX_RUN_ID else ""


# -- the owner's run store --


def _record_body(record: Record) -> tuple[str, str, dict[str, Any]]:
    """A record as its kind, its JSON form, and the listing fields it sets."""
    at = record.at
    if isinstance(record, Finished):
        return (
            "finished",
            json.dumps({"k": "finished", "at": at, "outcome": record.outcome}),
            {
                "ended_at": at,
                "outcome": record.outcome,
                "updated_at": at,
            },
        )
    if isinstance(record, OrphansDropped):
        return "dropped", json.dumps({"k": "dropped", "at": at}), {}
    if isinstance(record, GapFilled):
        return "gap", json.dumps({"k": "gap", "at": at, "upto": record.upto}), {"updated_at": at}
    event: RunStart | StepIn | RunEnd
    if isinstance(record, Started):
        kind, event = "start", record.start
    elif isinstance(record, Stepped):
        kind, event = "step", record.step
    elif isinstance(record, Orphaned):
        kind, event = "orphan", record.step
    else:
        assert isinstance(record, Ended)
        kind, event = "end", record.end
    data = json.loads(event.model_dump_json(exclude={"images"} if not isinstance(event, RunEnd) else None))
    if not isinstance(event, RunEnd):
        data["images"] = [{"data": base64.b64encode(i.decoded()).decode("ascii"), "mime": i.mime} for i in event.images]
    meta: dict[str, Any] = {"updated_at": at}
    if isinstance(event, RunStart):
        meta.update(task=event.task, started_at=at, labels=json.dumps(event.labels))
    return kind, json.dumps({"k": kind, "at": at, "e": data}), meta


def _record_of(run_id: str, body: str) -> Record:
    d = json.loads(body)
    kind, at = d["k"], float(d["at"])
    if kind == "finished":
        return Finished(run_id, d["outcome"], at)
    if kind == "dropped":
        return OrphansDropped(run_id, at)
    if kind == "gap":
        return GapFilled(run_id, int(d["upto"]), at)
    data = d["e"]
    for im in data.get("images") or ():
        if not im.get("data"):
            im["data"] = base64.b64encode(PLACEHOLDER_PNG).decode("ascii")
    ctx = {"max_image_bytes": 1 << 40}
    if kind == "start":
        return Started(run_id, RunStart.model_validate(data, context=ctx), at, None)
    if kind == "step":
        return Stepped(run_id, StepIn.model_validate(data, context=ctx), at, None)
    if kind == "orphan":
        return Orphaned(run_id, StepIn.model_validate(data, context=ctx), at, None)
    if kind == "end":
        return Ended(run_id, RunEnd.model_validate(data, context=ctx), at, None)
    raise ValueError(f"unknown record kind {kind!r} in the cluster journal; was it written by a newer agent-monitor?")


class ClusterStore:
    """The run store of cluster mode: each run's accepted records and scores in Redis, written by its owner only.

    Implements `RunStore`. Every write names the run's fencing token; Redis refuses it (and the batch with it)
    when another replica took the run over. Scores are written in the background, in order.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._pending: list[tuple[Any, list[Any]] | Callable[[], Awaitable[None]]] = []
        """Writes in order: a script and its arguments, or a coroutine function of its own (samples, rankings)."""
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def redis(self) -> aioredis.Redis:
        return self.cluster.redis

    async def journal(self, record: Record) -> None:
        """Journal one record (fenced)."""
        await self.journal_batch([record])

    async def journal_batch(self, records: Sequence[Record]) -> None:
        """Journal records and their runs' inbox cursors in one script: all or none; Fenced for a run not owned."""
        if not records:
            return
        c = self.cluster
        by_run: dict[str, list[Record]] = {}
        for r in records:
            by_run.setdefault(r.run_id, []).append(r)
        args: list[Any] = [c.prefix, c.replica_id, c.retention_ms, len(by_run)]
        cursors: dict[str, str] = {}
        finished: list[str] = []
        for run_id, rs in by_run.items():
            token = c.token(run_id)
            cursor = ""
            for r in rs:
                d = getattr(r, "delivery", None)
                if d is not None and d.cursor:
                    cursor = _later(cursor, d.cursor)
            o = c.owned[run_id]
            cursor = _later(o.cursor, cursor) if cursor else ""
            cursors[run_id] = cursor
            args += [run_id, token, cursor, len(rs)]
            for r in rs:
                kind, body, meta = _record_body(r)
                args += [kind, body, json.dumps(meta)]
                if kind == "finished":
                    finished.append(run_id)
        ok, who = await c._run("journal", c._scripts["journal"](args=args))
        if not int(ok):
            c.metrics.cluster_fenced.labels("write").inc()
            raise Fenced(f"run {_text(who)!r} was taken over by another replica; its records were not journaled")
        for run_id, cursor in cursors.items():
            held = c.owned.get(run_id)
            if held is not None and cursor:
                held.cursor = _later(held.cursor, cursor)
        for run_id in finished:
            c.finished(run_id)

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Queue a score for the run's journal (fenced; written in order, in the background)."""
        c = self.cluster
        o = c.owned.get(run_id)
        if o is None:
            c.metrics.cluster_fenced.labels("write").inc()
            return
        meta = {
            "last_step": step,
            "last_score": data.get("score") if data.get("ok") else "",
            "signal": data.get("signal") or "",
            "updated_at": time.time(),
        }
        self.later(c._scripts["progress"], [c.prefix, run_id, o.token, step, json.dumps(data), json.dumps(meta)])

    def later(self, script: Any, args: list[Any]) -> None:
        """Queue a script call for the writer (in order, without waiting)."""
        self._queue((script, args))

    def _queue(self, item: tuple[Any, list[Any]] | Callable[[], Awaitable[None]]) -> None:
        self._pending.append(item)
        self._idle.clear()
        self._ready.set()

    async def writer(self) -> None:
        """Write what was queued, in order, in pipelines (the cluster-writer task)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                # Consecutive script calls share one pipeline; a write of its own runs alone, in its place.
                n = 0
                while n < min(512, len(self._pending)) and isinstance(self._pending[n], tuple):
                    n += 1
                batch, self._pending = self._pending[: max(n, 1)], self._pending[max(n, 1) :]
                try:
                    if n == 0:
                        call = batch[0]
                        assert callable(call)
                        await call()
                        continue
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for item in batch:
                            assert isinstance(item, tuple)
                            script, args = item
                            await script(args=args, client=pipe)
                        await pipe.execute(raise_on_error=False)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    # Scores are kept in memory by the owner; a lost write costs a rescoring after a failover.
                    self.cluster.metrics.cluster_errors.labels("progress").inc()
                    log.warning("cluster_progress_not_written", writes=len(batch), error=f"{type(e).__name__}: {e}")
            self._idle.set()

    async def flush(self) -> None:
        """Wait until the queued writes are written (bounded by the caller)."""
        if self._pending:
            self._ready.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._idle.wait()

    async def read_runs(self, runs: Sequence[str]) -> dict[str, tuple[Replay, str, int | None]]:
        """Runs' records, scores, inbox cursors and last signal out, as a new owner takes them over (one round trip)."""
        c = self.cluster
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in runs:
                pipe.lrange(c.key("rec", run_id), 0, -1)
                pipe.hgetall(c.key("prog", run_id))
                pipe.get(c.key("cur", run_id))
                pipe.hget(c.key("meta", run_id), "signal_sent")
            got = await pipe.execute()
        out: dict[str, tuple[Replay, str, int | None]] = {}
        for k, run_id in enumerate(runs):
            recs, prog, cur, sent = got[4 * k : 4 * k + 4]
            replay = Replay(records=[_record_of(run_id, _text(b)) for b in recs])
            if prog:
                replay.progress[run_id] = [json.loads(prog[i]) for i in sorted(prog, key=lambda i: int(i))]
            out[run_id] = (replay, _text(cur) if cur else "", int(sent) if sent else None)
        return out

    async def replay(self) -> Replay:
        """Nothing at start-up: runs are taken one by one as the directory places them here."""
        return Replay()

    def record_sample(self, sample: Sample, keep: int, total: int) -> None:
        """Keep a calibration sample for every replica (and tell the others now, through the notes)."""
        c = self.cluster
        body = json.dumps(sample.to_json())

        async def write() -> None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(c.key("samples"), body)
                pipe.ltrim(c.key("samples"), -total, -1)
                pipe.xadd(c.key("note"), {"s": body}, maxlen=_NOTES_MAXLEN, approximate=True)
                await pipe.execute()

        self._queue(write)

    async def samples(self) -> list[Sample]:
        """Every calibration sample the cluster kept, oldest first."""
        return await _samples(self.redis, self.cluster.prefix)

    async def reset_family(self, name: str) -> int:
        """Delete the samples of every family called `name`; how many."""
        return await _reset_family(self.redis, self.cluster.prefix, name)

    def record_ranking(self, group: str, ranking: Mapping[str, Any] | None) -> None:
        """Keep a group's ranking (its owner's); None clears it."""
        c = self.cluster

        async def write() -> None:
            if ranking is None:
                await self.redis.hdel(c.key("rankings"), group)
            else:
                await self.redis.hset(c.key("rankings"), group, json.dumps(dict(ranking)))

        self._queue(write)

    async def rankings(self) -> dict[str, dict[str, Any]]:
        """None at start-up: a group's ranking is its owner's, rebuilt from the runs it takes."""
        return {}

    async def aclose(self) -> None:
        """Nothing to close: the cluster owns the connection."""


# -- reading the shared journal (agent-monitor runs / export --cluster, no replica needed) --


class ClusterJournal:
    """A cluster's shared journal, read without joining it: what `runs`, `export` and `calibration --cluster` show.

    ```python
    async with ClusterJournal(ClusterSettings(url="redis://127.0.0.1:6379/0")) as journal:
        rows = await journal.list_runs()
    ```
    The same rows and forms as `SqliteStore`'s readers. Entering raises ClusterUnavailable with a one-line reason.
    """

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.redis, self.prefix = cluster_redis(settings)
        self.where = f"cluster {settings.name} on {settings.url}"
        """Where the journal is, for messages."""

    async def __aenter__(self) -> ClusterJournal:
        await self._call(self.redis.ping())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.redis.aclose()

    async def _call(self, aw: Awaitable[T]) -> T:
        from redis.exceptions import RedisError

        try:
            return await aw
        except (OSError, RedisError) as e:
            raise ClusterUnavailable(
                f"cannot read the {self.where}: {type(e).__name__}: {e}; check the URL (--cluster) and that Redis "
                "runs there"
            ) from None

    async def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        """Live and recent runs, most recently updated first (the rows SqliteStore.list_runs gives)."""
        return await self._call(list_runs(self.redis, self.prefix, limit))

    async def export(self, run_id: str) -> dict[str, Any] | None:
        """A run as the cluster journaled it (the form SqliteStore.export gives), or None."""
        return await self._call(export_run(self.redis, self.prefix, run_id))

    async def samples(self) -> list[Sample]:
        """Every calibration sample the cluster kept, oldest first."""
        return await self._call(_samples(self.redis, self.prefix))

    async def reset_family(self, name: str) -> int:
        """Delete the calibration samples of every family called `name` (any model or rubric); how many."""
        return await self._call(_reset_family(self.redis, self.prefix, name))


async def _samples(redis: aioredis.Redis, prefix: str) -> list[Sample]:
    return [Sample.from_json(json.loads(b)) for b in await redis.lrange(prefix + "samples", 0, -1)]


async def _reset_family(redis: aioredis.Redis, prefix: str, name: str) -> int:
    key = prefix + "samples"
    kept, gone = [], 0
    for b in await redis.lrange(key, 0, -1):
        if json.loads(b).get("family") == name:
            gone += 1
        else:
            kept.append(b)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        if kept:
            pipe.rpush(key, *kept)
        await pipe.execute()
    return gone


def cluster_redis(settings: ClusterSettings) -> tuple[aioredis.Redis, str]:
    """A Redis client for a cluster's URL and the cluster's key prefix (ImportError names the extra)."""
    try:
        import redis.asyncio as aioredis
    except ImportError as e:
        raise ImportError(f"cluster mode needs the redis client ({e}); pip install 'agent-monitor[cluster]'") from None
    if settings.url is None:
        raise ValueError("no cluster URL; pass --cluster redis://HOST:PORT/DB")
    # A reply slower than the lease is as good as none (the lease is gone by then): time out, say so, try again.
    # At least 2 s: the notes are read with a blocking XREAD of one second.
    timeout = max(2.0, settings.lease_s)
    client = aioredis.Redis.from_url(settings.url, socket_timeout=timeout, socket_connect_timeout=timeout)
    return client, f"am:{settings.name}:"


async def list_runs(redis: aioredis.Redis, prefix: str, limit: int = 100) -> list[dict[str, Any]]:
    """Live and recent runs of a cluster, most recently updated first (the rows SqliteStore.list_runs gives)."""
    live = [_text(r) for r in await redis.hkeys(prefix + "assign")]
    ended = [_text(r) for r in await redis.zrevrange(prefix + "ended", 0, limit - 1)]
    ids = list(dict.fromkeys([*live, *ended]))
    async with redis.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hgetall(f"{prefix}meta:{run_id}")
            pipe.hvals(f"{prefix}prog:{run_id}")
        got = await pipe.execute()
    rows = []
    for k, run_id in enumerate(ids):
        meta = {_text(a): _text(b) for a, b in got[2 * k].items()}
        if not meta.get("started_at"):
            continue  # steps with no start yet: not a run
        curve = [json.loads(b) for b in got[2 * k + 1]]
        rows.append(
            {
                "run_id": run_id,
                "task": meta.get("task"),
                "started_at": _float(meta.get("started_at")),
                "updated_at": _float(meta.get("updated_at")),
                "ended_at": _float(meta.get("ended_at")),
                "outcome": meta.get("outcome") or None,
                "last_step": int(meta["last_step"]) if meta.get("last_step") else None,
                "last_score": _float(meta.get("last_score")),
                "signal": meta.get("signal") or None,
                "totals": _totals([_totals_row(p) for p in curve]),
            }
        )
    rows.sort(key=lambda r: r["updated_at"] or 0.0, reverse=True)  # type: ignore[arg-type,return-value]
    return rows[:limit]


async def export_run(redis: aioredis.Redis, prefix: str, run_id: str) -> dict[str, Any] | None:
    """A run as the cluster journaled it: task, steps in index order (placeholders marked), curve, totals; or None."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(f"{prefix}meta:{run_id}")
        pipe.lrange(f"{prefix}rec:{run_id}", 0, -1)
        pipe.hgetall(f"{prefix}prog:{run_id}")
        meta_raw, recs, prog = await pipe.execute()
    meta = {_text(a): _text(b) for a, b in meta_raw.items()}
    if not meta.get("started_at"):
        return None
    steps: dict[int, dict[str, Any]] = {}
    early: list[dict[str, Any]] = []  # steps that came before the start: placed by it, unless dropped before
    for b in recs:
        d = json.loads(b)
        if d["k"] == "orphan":
            early.append(d["e"])
        elif d["k"] == "dropped":
            early = []
        elif d["k"] == "start":
            for e in early:
                index = int(e.get("index") or max(steps, default=0) + 1)
                steps.setdefault(index, _exported_step(index, e))
            early = []
        elif d["k"] == "gap":
            for i in range(1, int(d["upto"])):
                steps.setdefault(i, {"index": i, "placeholder": True, "text": None, "ts": None, "images": []})
        elif d["k"] == "step":
            index = int(d["e"]["index"])
            steps[index] = _exported_step(index, d["e"])
    curve = [json.loads(prog[k]) for k in sorted(prog, key=lambda k: int(k))]
    return {
        "run_id": run_id,
        "task": meta.get("task"),
        "started_at": _float(meta.get("started_at")),
        "ended_at": _float(meta.get("ended_at")),
        "outcome": meta.get("outcome") or None,
        "labels": json.loads(meta.get("labels") or "{}"),
        "steps": [steps[i] for i in sorted(steps)],
        "curve": curve,
        "totals": _totals([_totals_row(p) for p in curve]),
    }


def _exported_step(index: int, e: Mapping[str, Any]) -> dict[str, Any]:
    digests = [hashlib.sha256(base64.b64decode(im["data"])).hexdigest() for im in e.get("images") or ()]
    return {"index": index, "text": e.get("text", ""), "ts": e.get("ts"), "images": digests}


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None
