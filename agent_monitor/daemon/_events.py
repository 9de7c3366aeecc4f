"""The monitor's events: what it says about runs, the vocabulary every part speaks and every sink
gets.

The run state decides them, the doors and the run parts emit them through the `Fanout`, the sinks
take them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, get_args

import structlog

from ..groups import RankingJSON
from ..policy import Policy
from ..progress import Decision, Progress, ProgressJSON, Signal
from ..wire import RunStart

__all__ = [
    "Accepted",
    "Duplicated",
    "Fanout",
    "GroupRanked",
    "MonitorEvent",
    "Refused",
    "RunClosed",
    "RunOpened",
    "Scored",
    "SignalChanged",
    "Sink",
    "Skipped",
]


# -- the events: what the monitor says about runs, handed to the sinks (structlog's pipeline style)
# --
#
# One vocabulary from the run state to the sinks: deciding an event that changes nothing gives the
# event the sinks get (`Refused`, `Duplicated`), and so does a notice of applying a record. A sink
# is any callable taking one `MonitorEvent`; it must not block and must not raise (the `Fanout` logs
# and ignores a sink that does, and the other sinks still run). A sink with an `events` attribute (a
# tuple of event classes) is given only those. Adding a sink (OpenTelemetry, a web board) is
# appending a callable: `Monitor(config, judge=..., sinks=[my_sink])`.


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
    counted: bool = True
    """Counted as a duplicate step (re-delivered steps are; a re-delivered start or end is not)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """An input event was refused, or something about a run's events needs saying (a gap, an
    eviction)."""

    run_id: str | None
    reason: str
    message: str
    topic: str
    """The topic the event came on (for a notice not tied to one event: the run's topic of
    `kind`)."""
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
    """Published again by a replica that took the run over: the previous owner journaled the score
    but may not have got its message out (its outbox drops what a run it no longer owns queued). Not
    a new scoring."""


@dataclass(frozen=True, slots=True)
class Skipped:
    """The schedule did not score a run's newest step now (it folds into the run's next scoring)."""

    run_id: str
    step: int
    reason: str
    """Why not: `policy.FAR` ("far from thresholds")."""
    heartbeat: Mapping[str, Any] | None = None
    """With `--heartbeat`: the run's last score again (its progress message, marked heartbeat,
    with its age)."""


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
    """The final result's progress JSON with its rubric `verdict` (pass / review / fail), when the
    run's rubric has thresholds and its last scoring gave a score; published and kept once more, so
    the verdict reaches both."""


@dataclass(frozen=True, slots=True)
class GroupRanked:
    """A group's ranking changed (order or a state), or the group was cleared (`ranking` None)."""

    group: str
    ranking: RankingJSON | None
    republished: bool = False
    """Published again after a restart (retained messages may have been lost with the crash)."""


MonitorEvent: TypeAlias = (
    Accepted
    | Duplicated
    | Refused
    | RunOpened
    | Scored
    | Skipped
    | SignalChanged
    | RunClosed
    | GroupRanked
)
Sink: TypeAlias = Callable[[MonitorEvent], object]


class Fanout:
    """Hand each event to the sinks that take its kind, in order; a sink that raises is logged,
    never fatal."""

    def __init__(self, sinks: Sequence[Sink], logger: Any = None) -> None:
        self.log = logger if logger is not None else structlog.get_logger("agent_monitor.daemon")
        self.sinks = sinks

    @property
    def sinks(self) -> tuple[Sink, ...]:
        """The sinks, in the order they are handed each event."""
        return self._sinks

    @sinks.setter
    def sinks(self, sinks: Sequence[Sink]) -> None:
        self._sinks = tuple(sinks)
        self._routes: dict[type, tuple[Sink, ...]] = {
            kind: self._route(kind) for kind in get_args(MonitorEvent)
        }
        self.taken: frozenset[type] = frozenset(
            kind for kind, route in self._routes.items() if route
        )
        """The kinds of event some sink takes: an event of another kind need not even be built."""

    def _route(self, kind: type) -> tuple[Sink, ...]:
        """The sinks that take one kind of event (all of them, unless a sink lists its `events`)."""
        return tuple(s for s in self._sinks if kind in getattr(s, "events", (kind,)))

    def __call__(self, event: MonitorEvent) -> None:
        """Emit one event."""
        kind = type(event)
        route = self._routes.get(kind)
        if route is None:  # a kind outside MonitorEvent (a subclass of one): routed on first sight
            route = self._routes[kind] = self._route(kind)
        for sink in route:
            try:
                sink(event)
            except Exception:
                # One broken sink (a user's, or a full disk under the store) must not silence the
                # others.
                self.log.exception(
                    "sink_failed", sink=getattr(sink, "__qualname__", type(sink).__name__)
                )
