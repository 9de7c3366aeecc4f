"""Cluster mode's inboxes: any replica journals what it receives into the runs' inboxes; each owner
feeds its runs.

Receiving is separate from owning: the receiver appends each input to its run's inbox (a Redis
stream) before it is acknowledged, without decoding it; the run's owner reads the inbox from its
cursor and hands the events to its host's ingest (`Host.handle_batch`), in inbox order per run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ...calibration import Sample
from ...wire import Topics
from ..sinks import Metrics
from ..sources import Host
from ..stores import Delivery
from ._leases import Leases
from ._leases import later as _later
from ._lua import piped
from ._store import NOTES_MAXLEN, _text

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = structlog.get_logger("agent_monitor.cluster")

_MAX_RUN_ID = 256
"""Longest run id a receiver journals (topic-safe ids are far shorter; a key per run is built
from it)."""
_FEED_PAGE = 256
"""Inbox entries read per run at once."""

Message = tuple[str, bytes, Delivery | None]


class Inboxes:
    """The runs' shared inboxes as one replica uses them: journal what it receives, feed the runs
    it owns."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        prefix: str,
        leases: Leases,
        scripts: Mapping[str, Any],
        topics: Topics,
        metrics: Metrics,
        retention_ms: int,
        max_payload_bytes: int,
        drop: Callable[[str], Awaitable[None]],
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.leases = leases
        self.scripts = scripts
        self.topics = topics
        self.metrics = metrics
        self.retention_ms = retention_ms
        self.max_payload_bytes = max_payload_bytes
        self.drop = drop
        """Forget a run here (a record of it did not commit)."""
        self.host: Host | None = None
        self.dirty: set[str] = set()
        """Owned runs whose inbox may hold events not yet fed."""
        self.wake = asyncio.Event()

    def mark(self, run_id: str) -> None:
        """An owned run's inbox has new events: feed it."""
        self.dirty.add(run_id)
        self.wake.set()

    def key(self, what: str, run_id: str) -> str:
        """A per-run cluster key."""
        return f"{self.prefix}{what}:{run_id}"

    # -- receiving: any replica, before the MQTT acknowledgement --

    async def receive(self, batch: Sequence[Message]) -> list[BaseException | None]:
        """Journal received messages into their runs' inboxes (one script, one round trip); per
        message None or the error."""
        errors: list[BaseException | None] = [None] * len(batch)
        calls: list[tuple[int, str]] = []
        leases = self.leases
        args: list[Any] = [self.prefix, leases.replica_id, self.retention_ms, NOTES_MAXLEN]
        for i, (topic, payload, _) in enumerate(batch):
            if self.topics.is_output(topic):
                continue
            parts = topic.rsplit("/", 2)
            run_id, kind = (parts[-2], parts[-1]) if len(parts) == 3 else ("", "")
            if not run_id or len(run_id) > _MAX_RUN_ID or kind not in ("start", "step", "end"):
                continue  # not an input (the shared filters match only inputs)
            if len(payload) > self.max_payload_bytes:
                log.warning("payload_too_large", run_id=run_id[:80], bytes=len(payload))
                self.metrics.invalid_events.labels("payload_too_large").inc()
                continue
            group = _group_of(payload) if kind == "start" else ""
            args += [run_id, kind, payload, group, "1" if run_id in leases else "0"]
            calls.append((i, run_id))
        if not calls:
            return errors
        try:
            (results,) = await piped(self.redis, [(self.scripts["receive"], args)])
        except Exception as e:
            self.metrics.cluster_errors.labels("receive").inc()
            log.warning(
                "cluster_receive_failed", messages=len(calls), error=f"{type(e).__name__}: {e}"
            )
            for i, _ in calls:
                errors[i] = e
            return errors
        me = leases.replica_id.encode()
        for (i, run_id), (entry_id, assignee) in zip(calls, results, strict=True):
            if entry_id is None:
                self.metrics.cluster_errors.labels("receive").inc()
                errors[i] = RuntimeError(f"not appended to the run's inbox: {_text(assignee)}")
            elif assignee == me and run_id in leases:
                self.mark(run_id)  # ours: fed now, with no note
        return errors

    # -- feeding: the owner --

    async def feeder(self) -> None:
        """Hand owned runs' new inbox events to the host, in inbox order per run, many runs per
        batch."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            dirty, self.dirty = self.dirty, set()
            try:
                held = [r for r in dirty if (o := self.leases.get(r)) is not None and o.ready]
                self.dirty |= {r for r in dirty if r in self.leases and r not in held}
                await self._feed(held)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.metrics.cluster_errors.labels("feed").inc()
                log.warning("cluster_feed_failed", error=f"{type(e).__name__}: {e}")
                self.dirty |= dirty
                await asyncio.sleep(0.5)
                self.wake.set()

    async def _feed(self, runs: list[str]) -> None:
        if not runs or self.host is None:
            return
        leases = self.leases
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in runs:
                fed = leases.owned[run_id].fed
                pipe.xrange(self.key("in", run_id), min=f"({fed}" if fed else "-", count=_FEED_PAGE)
            pages = await pipe.execute()
        messages: list[Message] = []
        last: dict[str, str] = {}
        for run_id, page in zip(runs, pages, strict=True):
            if len(page) >= _FEED_PAGE:
                self.mark(run_id)  # more after this page
            if page:
                last[run_id] = _text(page[-1][0])
        # In rounds: every run's first new event, then every run's second, ... (each run's in inbox
        # order). The host commits a batch holding one record per run, so a run's events one after
        # the other would each cost a journal write (a Redis round trip) of their own: a backlog of
        # 300 runs x 6 steps, 1,800 writes in a row instead of 6, and the owner falls behind what it
        # receives.
        for k in range(max((len(p) for p in pages), default=0)):
            for run_id, page in zip(runs, pages, strict=True):
                if k < len(page):
                    entry_id, fields = page[k]
                    eid = _text(entry_id)
                    messages.append(
                        (
                            self.topics.of(run_id, _text(fields[b"t"])),
                            fields[b"p"],
                            Delivery(0, eid, cursor=eid),
                        )
                    )
        if not messages:
            return
        for run_id, eid in last.items():
            if (held := leases.get(run_id)) is not None:
                held.fed = eid
        errors = await self.host.handle_batch(messages)
        failed = {messages[i][0].rsplit("/", 2)[-2] for i, e in enumerate(errors) if e is not None}
        for run_id in failed:
            # A record that did not commit: forget the run rather than guess which of its events the
            # state holds. Fenced, it is another replica's now; otherwise (Redis failed) the next
            # heartbeat takes it again from its journal, under the lease this replica still holds.
            await self.drop(run_id)
        # Events that left no record (refused, duplicates) are consumed too: the cursor moves past
        # them.
        behind = [
            (r, w) for r in last if r not in failed and (w := leases.get(r)) and w.fed != w.cursor
        ]
        if behind:
            cursor = self.scripts["cursor"]
            done = await piped(
                self.redis,
                [(cursor, [self.prefix, run_id, o.token, o.fed]) for run_id, o in behind],
            )
            for (_run, o), ok in zip(behind, done, strict=True):
                if int(ok):
                    o.cursor = _later(o.cursor, o.fed)
        for run_id in last:
            if run_id not in failed:
                await self.retire_if_over(run_id)

    async def retire_if_over(self, run_id: str) -> None:
        """A run that is over here (finished, or only late events for an ended run) leaves the
        directory."""
        o = self.leases.get(run_id)
        if o is None or self.host is None or self.host.is_live(run_id):
            return
        args = [self.prefix, run_id, self.leases.replica_id, o.token, self.retention_ms]
        if int(await self.scripts["retire"](args=args)):
            self.leases.drop(run_id)


class Notes:
    """Follow the cluster's note stream: runs placed here are taken at once, owned runs with new
    events are fed.

    A note names a run and the replica it is placed on, or carries a calibration sample another
    replica learnt.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        key: str,
        leases: Leases,
        inboxes: Inboxes,
        placed: Callable[[list[str]], list[str]],
        take: Callable[[list[str]], Awaitable[None]],
        on_sample: Callable[[Sample], object],
        metrics: Metrics,
        retry_s: float,
    ) -> None:
        self.redis = redis
        self.key = key
        self.leases = leases
        self.inboxes = inboxes
        self.placed = placed
        """Of the runs placed here, those to take now (none while the replica is leaving)."""
        self.take = take
        self.on_sample = on_sample
        self.metrics = metrics
        self.retry_s = retry_s
        self.start = "$"
        """The stream id after which notes are read (set on joining: the newest note then)."""

    async def run(self) -> None:
        """Read notes until cancelled (the `cluster-notes` task)."""
        while True:
            try:
                got: Any = await self.redis.xread({self.key: self.start}, count=1000, block=1000)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.metrics.cluster_errors.labels("notes").inc()
                log.warning("cluster_notes_failed", error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(self.retry_s)
                continue
            new: list[str] = []
            for _, entries in got or ():
                for entry_id, fields in entries:
                    self.start = _text(entry_id)
                    sample = fields.get(b"s")
                    if sample is not None:
                        self._learn(sample)
                        continue
                    # One run (a move) or a received batch's runs placed on one replica, NUL-joined.
                    to = _text(fields.get(b"a", b""))
                    for run_id in _text(fields.get(b"r", b"")).split("\0"):
                        if run_id in self.leases:
                            self.inboxes.dirty.add(run_id)
                        elif to == self.leases.replica_id and run_id:
                            new.append(run_id)
            try:
                await self.take(self.placed(new))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the heartbeat takes them at its next beat
                self.metrics.cluster_errors.labels("take").inc()
                log.warning("cluster_take_failed", runs=len(new), error=f"{type(e).__name__}: {e}")
            if self.inboxes.dirty:
                self.inboxes.wake.set()

    def _learn(self, raw: bytes) -> None:
        """A calibration sample another replica learnt: every replica's "auto" thresholds use the
        same evidence."""
        try:
            self.on_sample(Sample.from_json(json.loads(raw)))
        except Exception:
            log.exception("calibration_sample_unreadable")


def _group_of(payload: bytes) -> str:
    """A start's group, read just enough to place the run with its siblings ('' when none or
    unreadable)."""
    if b'"group"' not in payload:
        return ""
    try:
        group = json.loads(payload).get("group")
    except (ValueError, AttributeError):
        return ""
    return group if isinstance(group, str) and len(group) <= _MAX_RUN_ID else ""
