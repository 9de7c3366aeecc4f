"""The MQTT sink: the monitor's events as MQTT messages (progress, signals, run states, rankings,
errors).

It fills its outbox, a bounded queue that drops the oldest droppable message when full; the MQTT
door's link (`sources.MqttLink`) drains it through the narrow `Publishing` protocol it declares, so
neither the door nor this sink imports the other.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ...wire import Topics, signal_json
from .._events import (
    GroupRanked,
    MonitorEvent,
    Refused,
    RunClosed,
    RunOpened,
    Scored,
    SignalChanged,
    Skipped,
)

__all__ = ["Message", "MqttSink", "Outbox", "compact_form"]


# -- the outbox --


@dataclass(frozen=True, slots=True)
class Message:
    """One MQTT message to publish."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    droppable: bool = True
    """Progress and error messages may be dropped when the outbox is full; signals never are."""
    run_id: str | None = None
    """The run the message is about (the outbox's `gate` may hold it back: cluster mode's
    fencing)."""
    sent: Callable[[], None] | None = field(default=None, compare=False)
    """Called once the broker acknowledged the message (cluster mode: a signal known to be out is
    not republished)."""


@dataclass(frozen=True, slots=True)
class OutboxStatistics:
    """The outbox's messages waiting, its bound, and the messages it did not publish."""

    depth: int
    """Messages waiting to be published."""
    maxsize: int
    """The bound: beyond it, the oldest droppable message makes room."""
    dropped: int
    """Droppable messages (progress, errors) dropped for room."""
    fenced: int
    """Messages the gate held back (cluster mode: this replica may no longer publish about their
    run)."""


class Outbox:
    """The bounded queue of messages to publish; when full, the oldest droppable message makes room.

    Droppable and kept messages wait in two queues, each message numbered in arrival order, and
    leave in that order: finding the oldest droppable one is O(1) however many signals wait (a burst
    of evictions at --max-runs queues thousands of signal clears, and a scan past them per message
    was the ingest's cost there).
    """

    def __init__(
        self,
        maxsize: int = 10_000,
        *,
        on_dropped: Callable[[], None] | None = None,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError("outbox maxsize must be >= 1")
        self.maxsize = maxsize
        self.on_dropped = on_dropped
        """Told each message dropped for room (the dropped counter); the depth is read,
        `statistics()`."""
        self.on_fenced = on_fenced
        """Told each message the gate held back (cluster mode's fenced publishes)."""
        self.dropped = 0
        self.fenced = 0
        self._droppable: deque[tuple[int, Message]] = deque()
        self._kept: deque[tuple[int, Message]] = deque()
        self._next = 0
        self._first = 0
        """The number a requeued message gets: below every other, so it goes first."""
        self._ready = asyncio.Event()
        self.gate: Callable[[str], bool] | None = None
        """Cluster mode: whether this replica may still publish about a run; a message it may not
        is dropped."""
        self._by_run: dict[str, int] = {}
        """Messages waiting per run (those that name one): a replica handing a run over waits for
        them to leave."""
        self.on_run_out: Callable[[str], None] | None = None
        """Told when a run's last waiting message left (published, dropped or fenced): the
        scoring held for it."""

    def put(self, m: Message) -> None:
        """Queue a message (never blocks: a scorer must not wait on a slow broker)."""
        if len(self) >= self.maxsize:
            # The oldest droppable message makes room; with none queued, a droppable newcomer is the
            # one dropped, and a signal still goes in (there is at most one per run change).
            newcomer_dropped = not self._droppable and m.droppable
            if self._droppable or newcomer_dropped:
                if self._droppable:
                    self._left(self._droppable.popleft()[1])
                self.dropped += 1
                if self.on_dropped is not None:
                    self.on_dropped()
            if newcomer_dropped:
                return
        self._next += 1
        (self._droppable if m.droppable else self._kept).append((self._next, m))
        if m.run_id is not None:
            self._by_run[m.run_id] = self._by_run.get(m.run_id, 0) + 1
        self._ready.set()

    def requeue(self, m: Message) -> None:
        """Put back a message whose publication failed, first in line."""
        self._first -= 1
        (self._droppable if m.droppable else self._kept).appendleft((self._first, m))
        if m.run_id is not None:
            self._by_run[m.run_id] = self._by_run.get(m.run_id, 0) + 1
        self._ready.set()

    async def get(self) -> Message:
        """The next message, waiting for one."""
        while True:
            while not len(self):
                self._ready.clear()
                await self._ready.wait()
            m = self._pop()
            # Checked as it leaves, not as it came: a replica paused past its lease (a zombie) must
            # not publish what it queued before the pause, once another replica owns the run.
            if self._may(m):
                return m

    def get_nowait(self) -> Message | None:
        """The next message, or None (the gate applies as in `get`)."""
        while len(self):
            m = self._pop()
            if self._may(m):
                return m
        return None

    def _may(self, m: Message) -> bool:
        if m.run_id is None or self.gate is None or self.gate(m.run_id):
            return True
        self.fenced += 1
        if self.on_fenced is not None:
            self.on_fenced()
        return False

    def pending(self, run_id: str) -> int:
        """Messages about one run waiting to be published."""
        return self._by_run.get(run_id, 0)

    def _pop(self) -> Message:
        d, k = self._droppable, self._kept
        m = d.popleft()[1] if d and (not k or d[0][0] < k[0][0]) else k.popleft()[1]
        self._left(m)
        return m

    def _left(self, m: Message) -> None:
        if m.run_id is not None:
            n = self._by_run.pop(m.run_id, 1) - 1
            if n > 0:
                self._by_run[m.run_id] = n
            elif self.on_run_out is not None:
                self.on_run_out(m.run_id)

    def __len__(self) -> int:
        return len(self._droppable) + len(self._kept)

    def statistics(self) -> OutboxStatistics:
        """Messages waiting, the bound, and how many were dropped for room or held back by the
        gate."""
        return OutboxStatistics(
            depth=len(self), maxsize=self.maxsize, dropped=self.dropped, fenced=self.fenced
        )


# -- the sink --


def _payload(data: Mapping[str, Any]) -> bytes:
    # The JSON form has no NaN (progress.to_json maps non-finite numbers to null); compact UTF-8.
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


_COMPACT_KEYS = (
    "run_id",
    "step",
    "score",
    "delta",
    "uncertainty",
    "criteria",
    "ok",
    "error",
    "reason",
    "mass",
    "signal",
    "decision",
    "degraded",
    "final",
    "verdict",
)
_REQUIRED = frozenset(("run_id", "step", "score", "ok"))
_CRITERION_KEYS = ("score", "weight", "uncertainty", "mass")


def _rounded(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def compact_form(data: Mapping[str, Any]) -> dict[str, Any]:
    """A progress message for terminals (`mosquitto_sub -v`): what a person reads, numbers to 4
    decimals.

    Each criterion keeps its score, weight, uncertainty and mass (no letter distribution); the
    bookkeeping (tokens, totals, judge, latency, ...) and empty values are left out. It is still a
    progress message: `ProgressOut` reads it, with defaults for what is left out.
    """
    out: dict[str, Any] = {}
    for k in _COMPACT_KEYS:
        v = data.get(k)
        if k == "criteria":
            out[k] = {
                n: {f: _rounded(c.get(f)) for f in _CRITERION_KEYS} for n, c in (v or {}).items()
            }
        elif k == "decision" and isinstance(v, Mapping):
            out[k] = {f: _rounded(x) for f, x in v.items() if x is not None and x is not False}
        elif k in _REQUIRED or (v is not None and v is not False):
            out[k] = _rounded(v)
    return out


class MqttSink:
    """Publish progress, signals and run states (both retained; cleared when the run closes) and
    errors."""

    events = (Scored, Skipped, SignalChanged, Refused, RunOpened, RunClosed, GroupRanked)

    def __init__(
        self,
        outbox: Outbox,
        topics: Topics,
        *,
        on_signal_sent: Callable[[str, int], None] | None = None,
        on_progress_sent: Callable[[str, int], None] | None = None,
        compact: bool = False,
    ) -> None:
        self.outbox = outbox
        self.topics = topics
        self.compact = compact
        """Progress in the compact form (`serve --progress-form compact`): no letter
        distributions, rounded."""
        self.on_signal_sent = on_signal_sent
        """Told (run id, the decision's step) once a signal is out: cluster mode remembers which
        one is."""
        self.on_progress_sent = on_progress_sent
        """Told (run id, step) once a progress message is out: cluster mode remembers the last
        one."""
        self._progress_topics: dict[str, str] = {}

    def __call__(self, event: MonitorEvent) -> None:
        """Queue the messages for one event."""
        t = self.topics
        if isinstance(event, Scored):
            # One topic name per live run, built once: a run id is checked when its event is
            # decoded.
            where = self._progress_topics.get(event.run_id)
            if where is None:
                where = self._progress_topics[event.run_id] = t.of(event.run_id, "progress")
            shown = self.on_progress_sent
            sent = None if shown is None else partial(shown, event.run_id, event.progress.step)
            data = compact_form(event.data) if self.compact else event.data
            self.outbox.put(Message(where, _payload(data), run_id=event.run_id, sent=sent))
        elif isinstance(event, Skipped):
            if event.heartbeat is not None:
                self.outbox.put(
                    Message(
                        t.of(event.run_id, "progress"),
                        _payload(event.heartbeat),
                        run_id=event.run_id,
                    )
                )
        elif isinstance(event, SignalChanged):
            payload = _payload(signal_json(event.run_id, event.decision, event.policy))
            sent = (
                None
                if self.on_signal_sent is None
                else partial(self.on_signal_sent, event.run_id, event.decision.step)
            )
            self.outbox.put(
                Message(
                    t.of(event.run_id, "signal"),
                    payload,
                    retain=True,
                    droppable=False,
                    run_id=event.run_id,
                    sent=sent,
                )
            )
        elif isinstance(event, Refused):
            where = t.of(event.run_id, "error") if event.run_id else t.errors
            body = {
                "run_id": event.run_id,
                "topic": event.topic[:512],
                "reason": event.reason,
                "error": event.message,
            }
            self.outbox.put(Message(where, _payload(body), run_id=event.run_id or None))
        elif isinstance(event, GroupRanked):
            # Retained, so a late subscriber sees the ranking now; an empty payload clears it.
            ranking = b"" if event.ranking is None else _payload(event.ranking)
            self.outbox.put(Message(t.ranking(event.group), ranking, retain=True, droppable=False))
        elif isinstance(event, RunOpened):
            # Retained while the run lives: a viewer subscribing later (`top`) lists it at once. The
            # signal topic stays the policy's alone (its first message is the first decision).
            # Droppable, as progress is: in a burst of starts a full outbox loses a viewer's row,
            # never a signal; its clearing is not droppable.
            s = event.start
            state = {
                "run_id": event.run_id,
                "state": "live",
                "task": s.task[:200],
                "group": s.group,
                "labels": dict(s.labels),
                "started_at": s.started_at,
            }
            self.outbox.put(
                Message(
                    t.of(event.run_id, "state"), _payload(state), retain=True, run_id=event.run_id
                )
            )
        elif isinstance(event, RunClosed):
            self.outbox.put(
                Message(
                    t.of(event.run_id, "state"),
                    b"",
                    retain=True,
                    droppable=False,
                    run_id=event.run_id,
                )
            )
            where = self._progress_topics.pop(event.run_id, None) or t.of(event.run_id, "progress")
            if event.final is not None:
                final = compact_form(event.final) if self.compact else event.final
                self.outbox.put(
                    Message(where, _payload(final), droppable=False, run_id=event.run_id)
                )
            # An empty retained payload deletes the retained signal: a later subscriber sees no
            # stale abort.
            self.outbox.put(
                Message(
                    t.of(event.run_id, "signal"),
                    b"",
                    retain=True,
                    droppable=False,
                    run_id=event.run_id,
                )
            )
