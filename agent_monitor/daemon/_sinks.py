"""Publishing: what the monitor says about runs, as events handed to a list of sinks (structlog's pipeline style).

A sink is any callable taking one `MonitorEvent`; it must not block and must not raise (the
monitor logs and ignores a sink that does, and the other sinks still run). A sink with an
`events` attribute (a tuple of event classes) is given only those. The daemon's own
sinks publish to MQTT (through the bounded outbox), keep scores in the run store, count
Prometheus metrics (`MetricsSink`, next to the metrics) and log. Adding a sink (OpenTelemetry,
a web board) is appending a callable: `Monitor(config, judge=..., sinks=[my_sink])`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeAlias

import structlog

from ..groups import RankingJSON
from ..policy import Policy
from ..progress import Decision, Progress, ProgressJSON, Signal
from ..wire import RunStart, Topics, signal_json
from ._outbox import Message, Outbox
from ._store import RunStore


@dataclass(frozen=True, slots=True)
class Accepted:
    """An input event was accepted (journaled) for a run."""

    run_id: str
    kind: str


@dataclass(frozen=True, slots=True)
class Duplicated:
    """A redelivered input event was recognised and ignored."""

    run_id: str
    kind: str
    counted: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """An input event was refused, or something about a run's events needs saying (a gap, an eviction)."""

    run_id: str | None
    reason: str
    message: str
    topic: str
    """The topic the event came on (for a notice not tied to one event: the run's topic of `kind`)."""
    count: int = 1
    invalid: bool = True
    """The harness's doing (counted as invalid input), not the monitor's own (an eviction)."""


@dataclass(frozen=True, slots=True)
class RunOpened:
    """A run became live."""

    run_id: str
    start: RunStart
    live: int


@dataclass(frozen=True, slots=True)
class Scored:
    """A run's newest prefix was scored (or failed to be)."""

    run_id: str
    progress: Progress
    data: ProgressJSON
    """`progress.to_json()`, made once for every sink."""
    arrived: tuple[float, ...]
    """When each step this score newly covers arrived (for step-to-score latency)."""
    at: float
    republished: bool = False
    """Published again by a replica that took the run over: the previous owner journaled the score but may not
    have got its message out (its outbox drops what a run it no longer owns queued). Not a new scoring."""


@dataclass(frozen=True, slots=True)
class Skipped:
    """The schedule did not score a run's newest step now (it folds into the run's next scoring)."""

    run_id: str
    step: int
    reason: str
    """Why not: `policy.FAR` ("far from thresholds")."""
    heartbeat: Mapping[str, Any] | None = None
    """With `--heartbeat`: the run's last score again (its progress message, marked heartbeat, with its age)."""


@dataclass(frozen=True, slots=True)
class SignalChanged:
    """The run policy's decision changed (or is published again after a restart)."""

    run_id: str
    decision: Decision
    policy: Policy
    republished: bool = False
    """Published again after a restart (it may have been lost with the crash); not a new change."""


@dataclass(frozen=True, slots=True)
class RunClosed:
    """A run left the live set: ended and scored, expired, evicted or rejected."""

    run_id: str
    outcome: str
    steps: int
    latest: Progress | None
    last_ok: Progress | None
    signal: Signal
    labels: Mapping[str, str]
    at: float
    live: int
    final: Mapping[str, Any] | None = None
    """The final result's progress JSON with its rubric `verdict` (pass / review / fail), when the run's rubric has
    thresholds and its last scoring gave a score; published and kept once more, so the verdict reaches both."""


@dataclass(frozen=True, slots=True)
class GroupRanked:
    """A group's ranking changed (order or a state), or the group was cleared (`ranking` None)."""

    group: str
    ranking: RankingJSON | None
    republished: bool = False
    """Published again after a restart (retained messages may have been lost with the crash)."""


MonitorEvent: TypeAlias = (
    Accepted | Duplicated | Refused | RunOpened | Scored | Skipped | SignalChanged | RunClosed | GroupRanked
)
Sink: TypeAlias = Callable[[MonitorEvent], object]


def _payload(data: Mapping[str, Any]) -> bytes:
    # The JSON form has no NaN (progress.to_json maps non-finite numbers to null); compact UTF-8.
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


_COMPACT_KEYS = ("run_id", "step", "score", "delta", "uncertainty", "criteria", "ok", "error", "reason", "mass",
                 "signal", "decision", "degraded", "final", "verdict")  # fmt: skip
_REQUIRED = frozenset(("run_id", "step", "score", "ok"))
_CRITERION_KEYS = ("score", "weight", "uncertainty", "mass")


def _rounded(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def compact_form(data: Mapping[str, Any]) -> dict[str, Any]:
    """A progress message for terminals (`mosquitto_sub -v`): what a person reads, numbers to 4 decimals.

    Each criterion keeps its score, weight, uncertainty and mass (no letter distribution); the
    bookkeeping (tokens, totals, judge, latency, ...) and empty values are left out. It is still a
    progress message: `ProgressOut` reads it, with defaults for what is left out.
    """
    out: dict[str, Any] = {}
    for k in _COMPACT_KEYS:
        v = data.get(k)
        if k == "criteria":
            out[k] = {n: {f: _rounded(c.get(f)) for f in _CRITERION_KEYS} for n, c in (v or {}).items()}
        elif k == "decision" and isinstance(v, Mapping):
            out[k] = {f: _rounded(x) for f, x in v.items() if x is not None and x is not False}
        elif k in _REQUIRED or (v is not None and v is not False):
            out[k] = _rounded(v)
    return out


class MqttSink:
    """Publish progress, signals and run states (both retained; cleared when the run closes) and errors."""

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
        """Progress in the compact form (`serve --progress-form compact`): no letter distributions, rounded."""
        self.on_signal_sent = on_signal_sent
        """Told (run id, the decision's step) once a signal is out: cluster mode remembers which one is."""
        self.on_progress_sent = on_progress_sent
        """Told (run id, step) once a progress message is out: cluster mode remembers the last one."""
        self._progress_topics: dict[str, str] = {}

    def __call__(self, event: MonitorEvent) -> None:
        """Queue the messages for one event."""
        t = self.topics
        if isinstance(event, Scored):
            # One topic name per live run, built once: a run id is checked when its event is decoded.
            where = self._progress_topics.get(event.run_id)
            if where is None:
                where = self._progress_topics[event.run_id] = t.of(event.run_id, "progress")
            shown = self.on_progress_sent
            sent = None if shown is None else partial(shown, event.run_id, event.progress.step)
            data = compact_form(event.data) if self.compact else event.data
            self.outbox.put(Message(where, _payload(data), run_id=event.run_id, sent=sent))
        elif isinstance(event, Skipped):
            if event.heartbeat is not None:
                self.outbox.put(Message(t.of(event.run_id, "progress"), _payload(event.heartbeat), run_id=event.run_id))
        elif isinstance(event, SignalChanged):
            payload = _payload(signal_json(event.run_id, event.decision, event.policy))
            sent = (
                None if self.on_signal_sent is None else partial(self.on_signal_sent, event.run_id, event.decision.step)
            )
            self.outbox.put(
                Message(
                    t.of(event.run_id, "signal"), payload, retain=True, droppable=False, run_id=event.run_id, sent=sent
                )
            )
        elif isinstance(event, Refused):
            where = t.of(event.run_id, "error") if event.run_id else t.errors
            body = {"run_id": event.run_id, "topic": event.topic[:512], "reason": event.reason, "error": event.message}
            self.outbox.put(Message(where, _payload(body), run_id=event.run_id or None))
        elif isinstance(event, GroupRanked):
            # Retained, so a late subscriber sees the ranking now; an empty payload clears it.
            ranking = b"" if event.ranking is None else _payload(event.ranking)
            self.outbox.put(Message(t.ranking(event.group), ranking, retain=True, droppable=False))
        elif isinstance(event, RunOpened):
            # Retained while the run lives: a viewer subscribing later (`top`) lists it at once. The signal topic
            # stays the policy's alone (its first message is the first decision). Droppable, as progress is: in a
            # burst of starts a full outbox loses a viewer's row, never a signal; its clearing is not droppable.
            s = event.start
            state = {"run_id": event.run_id, "state": "live", "task": s.task[:200], "group": s.group,
                     "labels": dict(s.labels), "started_at": s.started_at}  # fmt: skip
            self.outbox.put(Message(t.of(event.run_id, "state"), _payload(state), retain=True, run_id=event.run_id))
        elif isinstance(event, RunClosed):
            self.outbox.put(
                Message(t.of(event.run_id, "state"), b"", retain=True, droppable=False, run_id=event.run_id)
            )
            where = self._progress_topics.pop(event.run_id, None) or t.of(event.run_id, "progress")
            if event.final is not None:
                final = compact_form(event.final) if self.compact else event.final
                self.outbox.put(Message(where, _payload(final), droppable=False, run_id=event.run_id))
            # An empty retained payload deletes the retained signal: a later subscriber sees no stale abort.
            self.outbox.put(
                Message(t.of(event.run_id, "signal"), b"", retain=True, droppable=False, run_id=event.run_id)
            )


class Fanout:
    """Hand each event to the sinks that take its kind, in order; a sink that raises is logged, never fatal."""

    def __init__(self, sinks: Sequence[Sink], logger: Any = None) -> None:
        self.sinks = tuple(sinks)
        self.log = logger if logger is not None else structlog.get_logger("agent_monitor.daemon")
        self._routes: dict[type, list[Sink]] = {}

    def __call__(self, event: MonitorEvent) -> None:
        """Emit one event."""
        kind = type(event)
        route = self._routes.get(kind)
        if route is None:
            # The sinks that take this kind of event (all of them, unless a sink lists its `events`).
            route = self._routes[kind] = [s for s in self.sinks if kind in getattr(s, "events", (kind,))]
        for sink in route:
            try:
                sink(event)
            except Exception:
                # One broken sink (a user's, or a full disk under the store) must not silence the others.
                self.log.exception("sink_failed", sink=getattr(sink, "__qualname__", type(sink).__name__))


class StoreSink:
    """Keep every published score and group ranking in the run store (a restart takes them up again)."""

    events = (Scored, GroupRanked, RunClosed)

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def __call__(self, event: MonitorEvent) -> None:
        """Record a score (a run's final one again, with its verdict) or a ranking."""
        if isinstance(event, Scored) and not event.republished:
            self.store.record_progress(event.run_id, event.progress.step, dict(event.data))
        elif isinstance(event, RunClosed) and event.final is not None:
            self.store.record_progress(event.run_id, int(event.final["step"]), dict(event.final))
        elif isinstance(event, GroupRanked) and not event.republished:
            self.store.record_ranking(event.group, event.ranking)


class LogSink:
    """One structured log line per thing worth a line: runs opened and closed, signals, refusals.

    (A failed score is logged by the run's tracker, with the run id bound.)
    """

    events = (SignalChanged, Refused, RunOpened, RunClosed)

    def __init__(self, logger: Any = None) -> None:
        self.log = logger if logger is not None else structlog.get_logger("agent_monitor.daemon")

    def __call__(self, event: MonitorEvent) -> None:
        """Log one event."""
        log = self.log
        if isinstance(event, SignalChanged):
            d = event.decision
            log.info(
                "signal", run_id=event.run_id, signal=d.signal, reason=d.reason, step=d.step, score=d.score,
                best_step=d.best_step,
            )  # fmt: skip
        elif isinstance(event, Refused):
            log.warning(
                "event_refused", run_id=event.run_id, reason=event.reason, error=event.message, topic=event.topic
            )
        elif isinstance(event, RunOpened):
            s = event.start
            log.info("run_started", run_id=event.run_id, task=s.task[:200], labels=s.labels)
        elif isinstance(event, RunClosed):
            log.info(
                "run_finished", run_id=event.run_id, outcome=event.outcome, steps=event.steps,
                score=event.latest.score if event.latest else None, signal=event.signal,
            )  # fmt: skip


__all__ = [
    "Accepted",
    "Duplicated",
    "Fanout",
    "GroupRanked",
    "LogSink",
    "MonitorEvent",
    "MqttSink",
    "Refused",
    "RunClosed",
    "RunOpened",
    "Scored",
    "SignalChanged",
    "Sink",
    "Skipped",
    "StoreSink",
]
