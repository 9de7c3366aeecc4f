"""The journal's records: what a run accepted and what the monitor decided, and how each message
arrived.

Applying a record is the only way a run's state changes (`runs.RunBook.apply`); a store journals
each one before it is applied, so replaying the journal rebuilds the state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, TypeAlias

from ...wire import RunEnd, RunStart, StepIn

__all__ = [
    "Delivery",
    "Ended",
    "Finished",
    "GapFilled",
    "Orphaned",
    "OrphansDropped",
    "Record",
    "Started",
    "Stepped",
    "StoreFormatError",
    "event_of",
    "event_record",
]


@dataclass(frozen=True, slots=True)
class Delivery:
    """How a message arrived: the broker's packet id, a digest of topic and payload, and the
    broker's DUP flag."""

    mid: int
    digest: str
    dup: bool = False
    cursor: str = ""
    """Cluster mode: where the message sits in its run's shared inbox (a Redis stream id),
    journaled with it."""

    @classmethod
    def of(cls, mid: int, topic: str, payload: bytes, *, dup: bool = False) -> Delivery:
        """The delivery of one MQTT message."""
        h = hashlib.blake2b(topic.encode(), digest_size=12)
        h.update(b"\0")
        h.update(payload)
        return cls(mid, h.hexdigest(), dup)

    @property
    def key(self) -> tuple[int, str]:
        """What identifies the message among recent deliveries (a new message may reuse the
        packet id)."""
        return (self.mid, self.digest)


# -- records: what the journal holds; applying them is the only way the state changes --


@dataclass(frozen=True, slots=True)
class Started:
    """A run's start was accepted."""

    run_id: str
    start: RunStart
    at: float
    delivery: Delivery | None = None


@dataclass(frozen=True, slots=True)
class Stepped:
    """A step was accepted at `step.index` (resolved for a step sent without one); it may wait
    for earlier ones."""

    run_id: str
    step: StepIn
    at: float
    delivery: Delivery | None = None


@dataclass(frozen=True, slots=True)
class Orphaned:
    """A step came before its run's start and waits for it (at most `hold_s`)."""

    run_id: str
    step: StepIn
    at: float
    delivery: Delivery | None = None


@dataclass(frozen=True, slots=True)
class Ended:
    """A run's end was accepted (for a run not started yet, it waits with its orphan steps)."""

    run_id: str
    end: RunEnd
    at: float
    delivery: Delivery | None = None


@dataclass(frozen=True, slots=True)
class GapFilled:
    """The steps missing before `upto` were given up on: placeholders keep the harness's step
    numbers."""

    run_id: str
    upto: int
    at: float


@dataclass(frozen=True, slots=True)
class OrphansDropped:
    """The steps held for a run whose start never came were dropped (reported `no_start`)."""

    run_id: str
    at: float


@dataclass(frozen=True, slots=True)
class Finished:
    """A run left the live set: ended and scored, expired, evicted or rejected."""

    run_id: str
    outcome: str
    at: float


@dataclass(frozen=True, slots=True)
class Amended:
    """The text of a step already accepted at `step.index` was replaced (`step.amend`): it is
    scored again from there."""

    run_id: str
    step: StepIn
    at: float
    delivery: Delivery | None = None


Record: TypeAlias = (
    Started | Stepped | Orphaned | Ended | GapFilled | OrphansDropped | Finished | Amended
)


class StoreFormatError(RuntimeError):
    """A run store written by another version of agent-monitor, in a format this one cannot read."""


def event_of(
    record: Started | Stepped | Orphaned | Ended | Amended,
) -> tuple[str, RunStart | StepIn | RunEnd]:
    """An event record's kind in a journal, and its event (the SQLite store and the cluster's
    journal alike)."""
    if isinstance(record, Amended):
        return "amend", record.step  # a kind of its own: `steps_once` keeps one *step* per index
    if isinstance(record, Started):
        return "start", record.start
    if isinstance(record, Stepped):
        return "step", record.step
    if isinstance(record, Orphaned):
        return "orphan", record.step
    return "end", record.end


def event_record(
    kind: str, run_id: str, data: dict[str, Any], at: float, d: Delivery | None, *, where: str
) -> Record:
    """The record a journaled event makes again (`event_of` backwards); StoreFormatError for a
    kind not known."""
    # Validated again on the way in: a store must make sense to the models it is read with.
    ctx = {"max_image_bytes": 1 << 40}
    if kind == "start":
        return Started(run_id, RunStart.model_validate(data, context=ctx), at, d)
    if kind == "step":
        return Stepped(run_id, StepIn.model_validate(data, context=ctx), at, d)
    if kind == "orphan":
        return Orphaned(run_id, StepIn.model_validate(data, context=ctx), at, d)
    if kind == "end":
        return Ended(run_id, RunEnd.model_validate(data, context=ctx), at, d)
    if kind == "amend":
        return Amended(run_id, StepIn.model_validate(data, context=ctx), at, d)
    raise StoreFormatError(
        f"unknown record kind {kind!r} in {where}; was it written by a newer agent-monitor?"
    )
