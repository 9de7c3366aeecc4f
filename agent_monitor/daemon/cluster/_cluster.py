"""Cluster mode: replicas share runs through Redis and an MQTT 5 shared subscription, one owner per
run.

Why it is built this way (docs/cluster.md has the operator's side):

- Mosquitto hands each message of a shared subscription to one member, round-robin per message,
  and keeps what it queued for a member whose session is offline in that member's session
  (mosquitto #1747, #2662). So a run's steps reach different replicas in any order, and a dead
  replica's share must be taken from its session.
- Receiving is therefore separate from owning. Any replica appends what it receives to the run's
  inbox (a Redis stream) before it acknowledges it (journal before ack); the receiver does not
  decode.
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

Modules: this one (the replica: membership, placement, taking and giving up runs), `_leases` (the
lease table), `_cluster_inbox` (receiving into the inboxes, feeding the owned runs),
`_cluster_session` (a departed replica's MQTT session), `_cluster_store` (the fenced run store, the
journal's readers), `_cluster_lua` (the scripts Redis runs atomically). The replica is the monitor's
mode (`_mode.Mode`): the monitor hands it a `Host` (`handle_batch`, `adopt`, `release`, `is_live`)
and its MQTT link, and knows nothing of clusters.

Keys (one Redis; the per-run ones end in the run id, ready for Redis Cluster hash tags):
`am:{name}:replicas` (zset: replica -> heartbeat deadline, ms of Redis' clock), `:replicas:info`,
`:assign` (run -> replica), `:owned:{replica}` (set), `:gassign` (group -> replica), `:grun` (run ->
group), `:note` (stream: run, assignee), `:ended` (zset), `:samples`, `:rankings`, and per run
`:in:{run}` (inbox stream), `:lease:{run}`, `:fence:{run}`, `:rec:{run}` (records), `:cur:{run}`
(inbox cursor), `:prog:{run}` (step -> progress), `:meta:{run}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ...calibration import Sample
from ...wire import Topics
from .._config import ClusterSettings
from ..sinks import Metrics, Outbox
from ..sources import Host, Receive
from ._inbox import Inboxes, Notes
from ._leases import Fenced, Lease, Leases, _id
from ._lua import SCRIPTS, piped
from ._session import SessionTaker
from ._store import NOTES_MAXLEN, ClusterStore, ClusterUnavailable, _text, cluster_redis

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from ..sources import MqttLink

__all__ = ["Cluster", "ClusterUnavailable", "Fenced"]

log = structlog.get_logger("agent_monitor.cluster")

_PUBLISH_MARGIN_S = 0.5
"""A replica stops publishing about a run this long before its lease would expire (clocks and
delays)."""
_CHECK_EVERY = 5
"""Heartbeats between checks of the owned runs' inboxes for events no note announced."""


class Epoch:
    """The cluster's epoch in Redis, as this replica last saw it: another (or none) means Redis
    lost its data."""

    def __init__(self, replica_id: str, metrics: Metrics) -> None:
        self.replica_id = replica_id
        self.metrics = metrics
        self.value: str | None = None
        self.emptied_at: float | None = None
        """When this replica last found the cluster's Redis emptied (wall clock), for `status()`
        and /healthz."""

    def seen(self, epoch: str, *, owned: int) -> None:
        """One heartbeat's epoch: a change is said once, loudly (a log error, a counter,
        /healthz)."""
        if self.value is not None and epoch != self.value:
            self.emptied_at = time.time()
            self.metrics.cluster_redis_emptied.inc()
            log.error(
                "cluster_redis_emptied",
                replica=self.replica_id,
                owned=owned,
                note="Redis came back without the cluster's data: the live runs' journals, "
                "inboxes and calibration "
                "samples are gone (their next steps are refused as no_start). Run Redis with "
                "appendonly yes and "
                "keep its data directory (docs/cluster.md)",
            )
        self.value = epoch


class Cluster:
    """One replica's part in the cluster: membership, placement, leases, the shared inboxes and
    journals."""

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        metrics: Metrics,
        retention_s: float,
        topics_prefix: str,
        max_payload_bytes: int,
        outbox: Outbox,
        on_sample: Callable[[Sample], object],
        redis: aioredis.Redis | None = None,
    ) -> None:
        if redis is None:
            redis, _ = cluster_redis(settings)
        self.redis = redis
        self.settings = settings
        self.metrics = metrics
        self.outbox = outbox
        """The monitor's outbox: a run handed over waits until what it queued is out."""
        self.on_sample = on_sample
        """Told each calibration sample another replica learnt."""
        self.replica_id = (
            settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.prefix = f"am:{settings.name}:"
        self.lease_ms = int(settings.lease_s * 1000)
        self.retention_ms = max(1, int(retention_s * 1000))
        # Registering a script only makes its object (nothing is sent until it runs): shared by
        # every part below.
        self._scripts: dict[str, Any] = {
            name: redis.register_script(src) for name, src in SCRIPTS.items()
        }
        self.leases = Leases(
            self.replica_id,
            on_fenced=metrics.cluster_fenced.labels("write").inc,
            on_owned=metrics.runs_owned.set,
        )
        self.owned = self.leases.owned
        """The runs this replica holds the lease of (the lease table's)."""
        self.store = ClusterStore(
            redis,
            prefix=self.prefix,
            leases=self.leases,
            scripts=self._scripts,
            metrics=metrics,
            retention_ms=self.retention_ms,
        )
        self.inboxes = Inboxes(
            redis,
            prefix=self.prefix,
            leases=self.leases,
            scripts=self._scripts,
            topics=Topics(topics_prefix),
            metrics=metrics,
            retention_ms=self.retention_ms,
            max_payload_bytes=max_payload_bytes,
            drop=self._drop,
        )
        self.notes = Notes(
            redis,
            key=f"{self.prefix}note",
            leases=self.leases,
            inboxes=self.inboxes,
            # taken now, unless this replica is leaving
            placed=lambda runs: [] if self._leaving else runs,
            take=self._take,
            on_sample=on_sample,
            metrics=metrics,
            retry_s=settings.heartbeat_s,
        )
        self.sessions = SessionTaker(
            receive=self.inboxes.receive,
            alive=self._alive,
            metrics=metrics,
            retry_s=settings.heartbeat_s * 2,
        )
        self.host: Host | None = None
        self.link: MqttLink | None = None
        self.live: tuple[str, ...] = ()
        """The live replicas at the last heartbeat (this one included)."""
        self._client_id = ""
        self._owning = asyncio.Lock()
        self._joined = False
        self._leaving = False
        self._aside = False
        """Stepped aside (cut off from the broker past a lease): no heartbeats, no runs, until
        the broker is back."""
        self._beats = 0
        self.epoch = Epoch(self.replica_id, metrics)

    # -- the monitor's mode (`_mode.Mode`) --

    @property
    def share(self) -> str:
        """The shared subscription's group: the cluster's name."""
        return self.settings.name

    @property
    def gate(self) -> Callable[[str], bool]:
        """Only the run's owner publishes: what a replica queued for a run it no longer owns is
        dropped."""
        return self.leases.may_publish

    @property
    def signal_sent(self) -> Callable[[str, int], None]:
        """Told once a run's signal is out: a new owner publishes it again only if it was not."""
        return self.store.mark_signal

    @property
    def progress_sent(self) -> Callable[[str, int], None]:
        """Told once a run's progress message is out: a new owner publishes the latest score
        again only if it was not."""
        return self.store.mark_progress

    def receiver(self, own: Receive) -> Receive:
        """Where the sources' events go: the runs' shared inboxes (the owner feeds them to its
        host)."""
        return self.inboxes.receive

    def may_publish(self, run_id: str) -> bool:
        """Whether this replica owns the run now (holds its lease, with time to spare): only the
        owner publishes."""
        return self.leases.may_publish(run_id)

    # -- identity --

    def client_id(self, base: str) -> str:
        """This replica's MQTT client id: unique per replica (the broker keeps one session per
        client id)."""
        self._client_id = f"{base}-{self.replica_id}"
        return self._client_id

    def status(self) -> dict[str, Any]:
        """The replica's part of `Monitor.status()`."""
        emptied = (
            {} if self.epoch.emptied_at is None else {"redis_emptied_at": self.epoch.emptied_at}
        )
        return {
            "replica": self.replica_id,
            "replicas": len(self.live),
            "owned": len(self.owned),
            **emptied,
        }

    def key(self, what: str, run_id: str = "") -> str:
        """A cluster key: `am:{name}:{what}` or, per run, `am:{name}:{what}:{run}`."""
        return f"{self.prefix}{what}:{run_id}" if run_id else f"{self.prefix}{what}"

    # -- lifecycle --

    async def open(self, host: Host, link: MqttLink | None) -> None:
        """Reach Redis and join, feeding `host` (raise ClusterUnavailable with a one-line
        reason)."""
        self.host = self.inboxes.host = host
        self.link = self.sessions.link = link
        try:
            await self.redis.ping()
            if self.settings.replica_id is not None and not await self._lapsed(self.replica_id):
                raise ClusterUnavailable(
                    f"replica id {self.replica_id!r} is in use by a live replica of cluster "
                    f"{self.settings.name!r}; "
                    "give each replica its own --replica-id (or none: a fresh one each start)"
                )
            await self._heartbeat()
            last = await self.redis.xrevrange(self.key("note"), count=1)
            self.notes.start = _text(last[0][0]) if last else "0-0"
        except ClusterUnavailable:
            raise
        except Exception as e:
            raise ClusterUnavailable(
                f"cannot join the cluster in Redis at {self.settings.url}: "
                f"{type(e).__name__}: {e}; "
                "check that Redis runs there (redis-server) and the URL's host, port and database"
            ) from None
        self._joined = True
        log.info(
            "cluster_joined",
            cluster=self.settings.name,
            replica=self.replica_id,
            replicas=len(self.live),
        )

    def loops(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """The background loops the Monitor runs in its TaskGroup, with their task names."""
        return [
            ("cluster-heartbeat", self._heartbeats()),
            ("cluster-notes", self.notes.run()),
            ("cluster-feed", self.inboxes.feeder()),
            ("cluster-writer", self.store.writer()),
            ("cluster-sessions", self.sessions.run()),
        ]

    async def leave(self) -> None:
        """Leave the cluster (a graceful stop): stop receiving, hand the runs over, let a
        survivor clean the session."""
        if not self._joined or self._leaving:
            return
        self._leaving = True
        link = self.link
        try:
            async with asyncio.timeout(10):
                if link is not None:
                    await link.stop_receiving()
                    await asyncio.sleep(0.2)  # a batch being journaled finishes and is acknowledged
                owned = len(self.owned)
                # As for a move: what the runs queued goes out, their scores are written, then their
                # leases freed.
                await self._give_back(list(self.owned))
                await self.store.flush()
                async with self.redis.pipeline(transaction=False) as pipe:
                    # Marked departed (not removed): a survivor places our runs at once and takes
                    # over our MQTT session, which may still hold a message delivered as we
                    # unsubscribed.
                    pipe.zadd(self.key("replicas"), {self.replica_id: 0})
                    pipe.delete(self.key("adopt", self.replica_id))
                    await pipe.execute()
                # Our runs go to the others now (not when our heartbeat expires); a survivor forgets
                # us later.
                moved, _ = await self._reassign(self.replica_id, claim=False)
                log.info(
                    "cluster_left",
                    replica=self.replica_id,
                    runs_handed_over=owned,
                    placed=len(moved),
                )
        except Exception as e:
            log.warning(
                "cluster_leave_incomplete",
                error=f"{type(e).__name__}: {e}",
                note="the lease will expire",
            )

    async def aclose(self) -> None:
        """Close the Redis connection."""
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    # -- owning --

    async def _heartbeat(self) -> None:
        info = json.dumps(
            {"client_id": self._client_id, "pid": os.getpid(), "host": socket.gethostname()}
        )
        live, dead, rejoined, epoch = await self._scripts["heartbeat"](
            args=[
                self.prefix,
                self.replica_id,
                self.lease_ms,
                info,
                "1" if self._joined else "0",
                uuid.uuid4().hex,
            ]
        )
        self.epoch.seen(_text(epoch), owned=len(self.owned))
        self.live = tuple(sorted(_text(r) for r in live))
        self.metrics.cluster_replicas.set(len(self.live))
        if rejoined and self._joined:
            # Declared dead meanwhile (paused, or cut off from Redis past the lease): our runs were
            # placed elsewhere and our leases freed; whatever we hold here is stale.
            log.warning("cluster_rejoined", replica=self.replica_id, runs_dropped=len(self.owned))
            for run_id in list(self.owned):
                await self._drop(run_id)
        for d in dead:
            await self._reassign(_text(d), claim=True)

    async def _reassign(self, gone: str, *, claim: bool) -> tuple[list[str], str]:
        moved, info = await self._scripts["reassign"](
            args=[self.prefix, gone, self.replica_id, NOTES_MAXLEN, "1" if claim else "0"]
        )
        runs = [_text(r) for r in moved]
        if runs:
            log.info("cluster_runs_placed", departed=gone, runs=len(runs))
        text = _text(info)
        if claim and text:
            self.sessions.queue.put_nowait({"replica": gone, **json.loads(text)})
        return runs, text

    async def _heartbeats(self) -> None:
        link = self.link
        last_ok = time.monotonic()
        broker_lost: float | None = None
        while True:
            try:
                if self._aside:
                    # no heartbeat while stepped aside, only whether Redis answers
                    await self.redis.ping()
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
                    # Cut off from Redis past the lease: the others count this replica dead and take
                    # its session over. It must not connect again meanwhile (a second client with
                    # the same id would push the taker off): its link waits, once its connection
                    # ends, until Redis answers again.
                    log.warning(
                        "cluster_unreachable", replica=self.replica_id, note="receiving paused"
                    )
                    link.allowed.clear()
                if link.connected.is_set():
                    broker_lost = None
                    if self._aside:
                        log.info(
                            "cluster_broker_back", replica=self.replica_id, note="joining again"
                        )
                        # the next heartbeat finds it was counted departed, and joins afresh
                        self._aside = False
                elif not link.allowed.is_set():
                    # not connected because it waits for Redis: not the broker's doing
                    broker_lost = None
                elif broker_lost is None:
                    broker_lost = now
                elif not self._aside and now - broker_lost > self.settings.lease_s:
                    try:
                        await self._step_aside()
                    except Exception as e:
                        log.warning(
                            "cluster_step_aside_incomplete", error=f"{type(e).__name__}: {e}"
                        )
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _step_aside(self) -> None:
        """Without the broker past a lease: hand the runs over and count as departed until the
        broker is back.

        Its session keeps getting a share of every run's inputs meanwhile (the broker queues them
        there), so the other replicas' runs would wait for those steps too: departed, a survivor
        takes the session over and empties it, and the runs go on elsewhere. Its heartbeats stop
        until the broker answers again.
        """
        log.warning(
            "cluster_broker_unreachable",
            replica=self.replica_id,
            runs=len(self.owned),
            note="stepping aside",
        )
        self._aside = True
        await self._give_back(list(self.owned))
        await self.store.flush()
        await self.redis.zadd(self.key("replicas"), {self.replica_id: 0})
        await self._reassign(self.replica_id, claim=False)

    async def _tick(self) -> None:
        """One heartbeat: membership, departed replicas, balance, then this replica's leases
        (taken, renewed, given)."""
        if self._leaving or self._aside:
            return
        await self._heartbeat()
        self.leases.expire(time.monotonic())
        await self._scripts["rebalance"](args=[self.prefix, 8, NOTES_MAXLEN])
        mine = {_text(r) for r in await self.redis.smembers(self.key("owned", self.replica_id))}
        await self._give_back([r for r in self.owned if r not in mine])
        await self._renew()
        await self._take(sorted(mine - set(self.owned)))
        self._beats += 1
        # Runs that are over here but still placed here (steps that never got a start, dropped after
        # --hold).
        for run_id, o in list(self.owned.items()):
            if o.ready:
                await self.inboxes.retire_if_over(run_id)
        # A missed note (or one for a run taken since) is caught here, every few beats: an owned
        # inbox past what was fed.
        owned = list(self.owned) if self._beats % _CHECK_EVERY == 0 else []
        if owned:
            async with self.redis.pipeline(transaction=False) as pipe:
                for run_id in owned:
                    pipe.xrevrange(self.key("in", run_id), count=1)
                lasts = await pipe.execute()
            for run_id, last in zip(owned, lasts, strict=True):
                held = self.owned.get(run_id)
                if held is not None and last and _id(_text(last[0][0])) > _id(held.fed or "0-0"):
                    self.inboxes.mark(run_id)
        self.metrics.runs_owned.set(len(self.owned))

    async def _renew(self) -> None:
        owned = list(self.owned.items())
        if not owned:
            return
        sent = time.monotonic()
        acquire = self._scripts["acquire"]
        tokens = await piped(
            self.redis,
            [
                (acquire, [self.prefix, run_id, self.replica_id, self.lease_ms])
                for run_id, _ in owned
            ],
        )
        for (run_id, o), tok in zip(owned, tokens, strict=True):
            if self.owned.get(run_id) is not o:
                continue
            if int(tok) == o.token:
                o.deadline = sent + self.settings.lease_s - _PUBLISH_MARGIN_S
            else:
                # Lost (another holds it, the directory moved it) or taken afresh after it expired:
                # what we hold may be stale either way, so drop it; a run still placed here is taken
                # again from its journal.
                log.info("cluster_lease_lost", run_id=run_id, token=o.token, now=int(tok))
                await self._drop(run_id)
                # moved elsewhere while still ours: free it for its new owner now
                if int(tok) == -2:
                    self.store.release(run_id, o.token)

    async def _take(self, runs: Sequence[str]) -> None:
        """Acquire runs' leases and take each over from its journal (records, scores, inbox cursor).

        Many at once (a burst of new runs, a failover): one round trip for the leases, one for the
        journals.
        """
        async with self._owning:
            runs = [r for r in dict.fromkeys(runs) if r not in self.owned]
            if not runs or self._leaving or self._aside:
                return
            sent = time.monotonic()
            acquire = self._scripts["acquire"]
            tokens = await piped(
                self.redis,
                [
                    (acquire, [self.prefix, run_id, self.replica_id, self.lease_ms])
                    for run_id in runs
                ],
            )
            got = {r: int(t) for r, t in zip(runs, tokens, strict=True) if int(t) > 0}
            if not got:
                return
            journals = await self.store.read_runs(list(got))
            for run_id, tok in got.items():
                o = Lease(tok, sent + self.settings.lease_s - _PUBLISH_MARGIN_S)
                try:
                    replay, cursor, signal_out, progress_out = journals[run_id]
                    o.cursor = o.fed = cursor
                    self.leases.hold(run_id, o)
                    assert self.host is not None, "taken over only once joined"
                    await self.host.adopt(
                        run_id,
                        replay.records,
                        replay.progress.get(run_id, ()),
                        signal_sent=signal_out,
                        progress_sent=progress_out,
                    )
                    o.ready = True
                except Exception:
                    self.leases.drop(run_id)
                    log.exception("cluster_take_failed", run_id=run_id)
                    with contextlib.suppress(Exception):
                        await self._scripts["release"](
                            args=[self.prefix, run_id, self.replica_id, tok]
                        )
                    continue
                if tok > 1:
                    self.metrics.run_takeovers.inc()
                self.inboxes.mark(run_id)

    async def _drop(self, run_id: str) -> None:
        """Forget a run here (another replica owns it, or will)."""
        if self.leases.drop(run_id) is not None and self.host is not None:
            await self.host.release(run_id)

    async def _give_back(self, runs: Sequence[str]) -> None:
        """Runs placed elsewhere now: forget them, let what they queued be published, then free
        their leases."""
        handed = {r: o for r in runs if (o := self.owned.get(r)) is not None}
        if not handed:
            return
        for run_id in handed:
            self.leases.close(run_id)
            if self.host is not None:
                await self.host.release(run_id)
        # A signal queued just before the move must still reach the harness (the new owner does not
        # publish it again), and before the new owner can publish anything newer: the leases are
        # freed once the messages are out (or after a bounded wait).
        outbox = self.outbox
        until = time.monotonic() + min(1.0, self.settings.lease_s / 4)
        while any(outbox.pending(r) for r in handed) and time.monotonic() < until:  # noqa: ASYNC110 (bounded poll)
            await asyncio.sleep(0.02)
        for run_id, o in handed.items():
            self.leases.closed(run_id)
            # Queued behind the run's score writes (the writer keeps order): its scores so far go
            # with it.
            self.store.release(run_id, o.token)

    async def _lapsed(self, replica: str) -> bool:
        """Whether a replica id is free: its heartbeat is not current, or stops being so within one
        lease.

        A replica restarted with its fixed id (a host restart, its peer and broker with it) finds
        its dead incarnation's heartbeat current until the lease runs out; a live replica renews it
        every heartbeat. So the id is waited for, a lease and two heartbeats at most, rather than
        refused at once.
        """
        deadline = time.monotonic() + self.settings.lease_s + 2 * self.settings.heartbeat_s
        waited = False
        while await self._alive(replica):
            if time.monotonic() >= deadline:
                return False
            if not waited:
                waited = True
                log.warning(
                    "cluster_replica_id_busy",
                    replica=replica,
                    wait_s=round(deadline - time.monotonic(), 2),
                    note="a previous run of this replica id may still hold its "
                    "lease; waiting for it to lapse",
                )
            await asyncio.sleep(self.settings.heartbeat_s / 2)
        return True

    def _alive(self, replica: str) -> Awaitable[bool]:
        return alive(self.redis, self.key("replicas"), replica)


async def alive(redis: Any, replicas_key: str, replica: str) -> bool:
    """Whether a replica's heartbeat is current (by Redis' clock); False when Redis cannot say."""
    with contextlib.suppress(Exception):
        score = await redis.zscore(replicas_key, replica)
        secs, micros = await redis.time()
        return score is not None and float(score) >= secs * 1000 + micros // 1000
    return False
