"""The run book: ordering, idempotency, gaps, orphans and liveness of every run the daemon follows.

Pure: no I/O, no event loop, no clock.

The state changes only by applying a *record*: what a run accepted (a start, a step at its resolved
index, an end), or a decision the monitor took (a gap filled with placeholders, orphan steps
dropped, a run finished). `decide` turns an input event into a record, or into the event a sink gets
for a refusal or a duplicate (`Refused`, `Duplicated`), which change nothing; `due` gives the
decisions that time has made due. The daemon journals each record before it applies it, so the
journal is exactly what each run accepted, and replaying it through `apply` rebuilds exactly the
state the daemon had: the same steps under the same indexes (placeholders included), the same
activity times and eviction order, the same held steps and orphans. Everything `apply` derives
(index order, evictions, orphan adoption) is a function of the state and the record alone.

A redelivered MQTT message is recognised by its packet id and payload digest among the
recent deliveries, when the broker marks it a redelivery (DUP): that is how a step without an
`index`, journaled just before a crash and redelivered after it, is not applied twice.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ...wire import RunEnd, RunStart, StepIn, Topics
from .._config import RunLimits
from .._events import Duplicated, Refused
from ..stores import (
    Amended,
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

# -- effects: what applying a record asks the daemon to do --


@dataclass(frozen=True, slots=True)
class Opened:
    """A run became live: set up its scoring."""

    run_id: str
    start: RunStart
    at: float


@dataclass(frozen=True, slots=True)
class Appended:
    """Steps are now in order at the end of the run: score them."""

    run_id: str
    steps: tuple[AcceptedStep, ...]


@dataclass(frozen=True, slots=True)
class Closing:
    """The run's end was accepted: finish it once its newest prefix is scored."""

    run_id: str
    outcome: str


@dataclass(frozen=True, slots=True)
class Closed:
    """The run left the live set."""

    run_id: str
    outcome: str
    at: float


@dataclass(frozen=True, slots=True)
class Revised:
    """A step in the run's order has new text (an amendment): score the run again from it."""

    run_id: str
    index: int
    step: StepIn
    at: float


Effect: TypeAlias = Opened | Appended | Closing | Closed | Refused | Revised
"""`Refused`: something to report about a run's events (a gap, an eviction, orphan steps that
never got a start)."""


# -- the state --


@dataclass(frozen=True, slots=True)
class AcceptedStep:
    """A step now in a run's order, on its way to scoring: the harness's step, or a placeholder
    for a missing one."""

    index: int
    step: StepIn
    at: float
    placeholder: bool = False


@dataclass(eq=False, slots=True)
class RunState:
    """One live run: its start, its steps in order, the steps waiting for earlier ones, its
    activity."""

    run_id: str
    start: RunStart
    started_at: float
    last_event: float
    steps: int = 0
    """Steps in order so far (their content went to scoring: the tracker keeps it, once)."""
    placeholders: set[int] = field(default_factory=set)
    """Indexes among them that stand in for steps that never arrived."""
    held: dict[int, tuple[StepIn, float, bool]] = field(default_factory=dict)
    """Steps waiting for earlier ones: index -> (step, arrival time, is a placeholder)."""
    gap_since: float | None = None
    ended: RunEnd | None = None
    contents: bytearray = field(default_factory=bytearray)
    """A short digest of each step in order (`_CONTENT` bytes apiece): a re-send is told from a
    conflict by it."""
    revised: dict[int, bytes] = field(default_factory=dict)
    """The digest of each amended step's current text, by index (`contents` keeps the step as
    first sent)."""

    @property
    def next_index(self) -> int:
        """The index the next in-order step must have."""
        return self.steps + 1


@dataclass(eq=False, slots=True)
class Orphan:
    """Steps (and perhaps an end) for a run whose start has not come."""

    first_seen: float
    steps: list[tuple[StepIn, float]] = field(default_factory=list)
    end: RunEnd | None = None


def outcome_of(end: RunEnd) -> str:
    """The outcome label of an end: success, failure, scored (a number) or unknown."""
    if end.outcome in ("success", "failure"):
        return str(end.outcome)
    return "unknown" if end.outcome is None else "scored"


def placeholder(index: int) -> StepIn:
    """The step that stands for one that never arrived."""
    return StepIn(index=index, text=f"(step {index} was not received by the monitor)", images=[])


def same_start(a: RunStart, b: RunStart) -> bool:
    """Whether two starts are the same start (a redelivery), images compared by their base64
    text."""
    return a.model_dump(exclude={"images"}) == b.model_dump(exclude={"images"}) and [
        i.data for i in a.images
    ] == [i.data for i in b.images]


class RunBook:
    """Every run one daemon follows: live runs in least-recently-active order, orphans, recently
    ended ids."""

    def __init__(self, limits: RunLimits | None = None, topics: Topics | None = None) -> None:
        self.limits = limits or RunLimits()
        self.topics = topics or Topics()
        """The topic names a refusal or notice says it is about."""
        self.live: OrderedDict[str, RunState] = OrderedDict()
        self.orphans: OrderedDict[str, Orphan] = OrderedDict()
        self.ended: OrderedDict[str, float] = OrderedDict()
        self._gapped: set[str] = set()
        self._asked: dict[str, int] = {}  # runs asked to resend, and from which index
        self._recent: OrderedDict[tuple[int, str], str] = OrderedDict()

    # -- deciding: an event becomes a record, or a refusal or duplicate that changes nothing --

    def _refused(
        self,
        run_id: str,
        reason: str,
        message: str,
        kind: str = "step",
        *,
        count: int = 1,
        invalid: bool = True,
    ) -> Refused:
        """The event a refusal (or a notice, `invalid=False` for the monitor's own) is, on the
        run's topic of `kind`."""
        return Refused(run_id, reason, message, self.topics.of(run_id, kind), count, invalid)

    def _conflict(self, run_id: str, index: int) -> Refused:
        return self._refused(
            run_id,
            "conflict",
            f"step {index} was sent again with different content; the first one stays (a new "
            "step needs a new index)",
        )

    def decide(
        self,
        run_id: str,
        event: RunStart | StepIn | RunEnd,
        now: float,
        delivery: Delivery | None = None,
    ) -> Record | Refused | Duplicated:
        """What the event means for its run now; nothing changes until the record is applied."""
        if delivery is not None and delivery.dup and delivery.key in self._recent:
            return Duplicated(run_id, kind_of(event), counted=isinstance(event, StepIn))
        if isinstance(event, RunStart):
            return self._decide_start(run_id, event, now, delivery)
        if isinstance(event, StepIn):
            if event.amend:
                return decide_amend(self, run_id, event, now, delivery)
            return self._decide_step(run_id, event, now, delivery)
        return self._decide_end(run_id, event, now, delivery)

    def _decide_start(
        self, run_id: str, start: RunStart, now: float, d: Delivery | None
    ) -> Started | Refused | Duplicated:
        run = self.live.get(run_id)
        if run is None:
            return Started(run_id, start, now, d)
        if same_start(run.start, start):
            return Duplicated(run_id, "start", counted=False)
        return self._refused(
            run_id,
            "duplicate_start",
            "the run has already started with another start; use a new run id",
            "start",
        )

    def _decide_step(
        self, run_id: str, step: StepIn, now: float, d: Delivery | None
    ) -> Stepped | Orphaned | Refused | Duplicated:
        run = self.live.get(run_id)
        if run is None:
            if run_id in self.ended:
                return self._refused(
                    run_id, "run_ended", "a step came for a run that has ended; it was ignored"
                )
            orphan = self.orphans.get(run_id)
            if orphan is None and len(self.orphans) >= self.limits.max_orphan_runs:
                return self._refused(
                    run_id,
                    "too_many_held",
                    "too many runs have steps but no start; publish start first",
                )
            if orphan is not None and len(orphan.steps) >= self.limits.max_held_steps:
                return self._refused(
                    run_id,
                    "too_many_held",
                    "too many steps before the run's start; publish start first",
                )
            return Orphaned(run_id, step, now, d)
        verdict = self._place(run, step)
        if isinstance(verdict, int):
            return Stepped(
                run_id,
                step if step.index == verdict else step.model_copy(update={"index": verdict}),
                now,
                d,
            )
        return verdict

    def _place(self, run: RunState, step: StepIn) -> int | Refused | Duplicated:
        """The index a step takes in a live run, or why it takes none."""
        if run.ended is not None:
            return self._refused(
                run.run_id, "run_ended", "a step came after the run's end; it was ignored"
            )
        index = step.index
        if index is None:  # no index: the next free position
            index = max(run.next_index, max(run.held, default=0) + 1)
        if index < run.next_index:
            if index in run.placeholders:
                return self._refused(
                    run.run_id,
                    "conflict",
                    f"step {index} came after it was given up for missing (--hold "
                    f"{self.limits.hold_s:g}s) and "
                    "scored as a placeholder; it was ignored",
                )
            k = (index - 1) * _CONTENT
            if run.contents[k : k + _CONTENT] != content_digest(step):
                return self._conflict(run.run_id, index)
            return Duplicated(run.run_id, "step")
        if index in run.held:
            if content_digest(run.held[index][0]) != content_digest(step):
                return self._conflict(run.run_id, index)
            return Duplicated(run.run_id, "step")
        if index - run.next_index >= self.limits.max_held_steps:
            return self._refused(
                run.run_id,
                "index_too_far",
                f"step index {index} is {index - run.next_index} ahead of the next expected "
                f"({run.next_index}); "
                f"at most {self.limits.max_held_steps} out-of-order steps are kept",
            )
        return index

    def _decide_end(
        self, run_id: str, end: RunEnd, now: float, d: Delivery | None
    ) -> Ended | Refused | Duplicated:
        run = self.live.get(run_id)
        if run is not None:
            return (
                Duplicated(run_id, "end", counted=False)
                if run.ended is not None
                else Ended(run_id, end, now, d)
            )
        if run_id in self.ended:
            return Duplicated(run_id, "end", counted=False)  # a re-delivered end
        orphan = self.orphans.get(run_id)
        if orphan is not None:
            return (
                Duplicated(run_id, "end", counted=False)
                if orphan.end is not None
                else Ended(run_id, end, now, d)
            )
        return self._refused(
            run_id,
            "unknown_run",
            "end for a run that never started (or has expired); it was ignored",
            kind="end",
        )

    def due(self, now: float) -> list[Record]:
        """The decisions time has made due: orphans that waited too long, gaps nobody filled,
        idle runs."""
        hold = self.limits.hold_s
        out: list[Record] = []
        for run_id, orphan in self.orphans.items():  # oldest first
            if now - orphan.first_seen < hold:
                break
            out.append(OrphansDropped(run_id, now))
        for run_id in sorted(self._gapped):
            run = self.live[run_id]
            if run.gap_since is not None and now - run.gap_since >= hold:
                out.append(GapFilled(run_id, min(run.held), now))
        for run_id, run in self.live.items():  # least recently active first
            if now - run.last_event < self.limits.idle_timeout_s:
                break
            out.append(Finished(run_id, "expired", now))
        return out

    def resends_due(self, now: float) -> list[tuple[str, int]]:
        """(run, first missing index) for each gap open half its hold: ask the harness to send again
        from there.

        Asked once per gap (a new first missing index asks again), half-way through `--hold`, so
        that steps re-sent in answer fill the gap before it is given up. A step published while no
        monitor was subscribed (a broker that restored sessions but not `$share` subscriptions)
        shows as a gap once a later step arrives; MonitorClient keeps a bounded buffer of its
        unacknowledged steps and answers.
        """
        half = self.limits.hold_s / 2
        out: list[tuple[str, int]] = []
        for run_id in sorted(self._gapped):
            run = self.live.get(run_id)
            if run is None or run.gap_since is None or now - run.gap_since < half:
                continue
            first = run.next_index
            if self._asked.get(run_id) != first:
                self._asked[run_id] = first
                out.append((run_id, first))
        for run_id in [r for r in self._asked if r not in self._gapped]:
            del self._asked[run_id]
        return out

    def forget(self, run_id: str) -> None:
        """Drop everything held about one run, without a record (cluster mode: the run moved to
        another replica)."""
        self.live.pop(run_id, None)
        self.orphans.pop(run_id, None)
        self.ended.pop(run_id, None)
        self._gapped.discard(run_id)

    def finish(self, run_id: str, outcome: str, now: float) -> Finished | None:
        """The record that takes a live run out (ended and scored, rejected); None when it is not
        live."""
        return Finished(run_id, outcome, now) if run_id in self.live else None

    # -- applying: the only way the state changes, live and on replay alike --

    def apply(self, record: Record, *, replaying: bool = False) -> list[Effect]:
        """Fold one record into the state; return what the daemon should do about it.

        On replay the recent deliveries come whole from the store (`remember_deliveries`), in their
        original order, finished runs' included; applying a record then leaves them alone.
        """
        if isinstance(record, _DELIVERED) and record.delivery is not None and not replaying:
            self._remember(record.delivery, record.run_id)
        effects: list[Effect] = []
        if isinstance(record, Started):
            self._start(record, effects)
        elif isinstance(record, Stepped):
            run = self.live.get(record.run_id)
            if run is not None:
                self._touch(run, record.at)
                self._step(run, record.step, record.at, effects)
        elif isinstance(record, Orphaned):
            self.orphans.setdefault(record.run_id, Orphan(first_seen=record.at)).steps.append(
                (record.step, record.at)
            )
        elif isinstance(record, Ended):
            self._end(record, effects)
        elif isinstance(record, GapFilled):
            run = self.live.get(record.run_id)
            if run is not None:
                self._fill_gap(run, record.upto, record.at, effects)
        elif isinstance(record, Amended):
            apply_amend(self, record, effects)
        elif isinstance(record, OrphansDropped):
            orphan = self.orphans.pop(record.run_id, None)
            if orphan is not None:
                n = len(orphan.steps)
                effects.append(
                    self._refused(
                        record.run_id,
                        "no_start",
                        f"{n} step(s) came but no start within {self.limits.hold_s:g}s; "
                        "publish the run's start "
                        "before its steps",
                        count=max(1, n),
                    )
                )
        else:
            self._close(record.run_id, record.outcome, record.at, effects)
        return effects

    def _remember(self, d: Delivery, run_id: str) -> None:
        key = d.key
        self._recent[key] = run_id
        self._recent.move_to_end(key)
        while len(self._recent) > self.limits.redelivery_window:
            self._recent.popitem(last=False)

    def _touch(self, run: RunState, at: float) -> None:
        run.last_event = max(run.last_event, at)
        self.live.move_to_end(run.run_id)

    def _start(self, record: Started, effects: list[Effect]) -> None:
        run_id = record.run_id
        if run_id in self.live:
            return  # decided against already; a journal never holds two starts of one live run
        while len(self.live) >= self.limits.max_runs:
            victim = next(iter(self.live))  # the least recently active
            effects.append(
                self._refused(
                    victim,
                    "evicted",
                    f"the monitor follows at most {self.limits.max_runs} runs; this one was "
                    "idle longest and was "
                    "dropped",
                    kind="start",
                    invalid=False,
                )
            )
            self._close(victim, "evicted", record.at, effects)
        self.ended.pop(run_id, None)
        run = RunState(run_id, record.start, started_at=record.at, last_event=record.at)
        self.live[run_id] = run
        effects.append(Opened(run_id, record.start, record.at))
        orphan = self.orphans.pop(run_id, None)
        if orphan is not None:
            for step, at in orphan.steps:
                verdict = self._place(run, step)
                if isinstance(verdict, int):
                    placed = (
                        step
                        if step.index == verdict
                        else step.model_copy(update={"index": verdict})
                    )
                    self._step(run, placed, at, effects)
                elif isinstance(verdict, Refused):
                    effects.append(verdict)
            if orphan.end is not None:
                self._end(Ended(run_id, orphan.end, record.at), effects)

    def _step(self, run: RunState, step: StepIn, at: float, effects: list[Effect]) -> None:
        assert step.index is not None
        run.held[step.index] = (step, at, False)
        self._flush(run, effects)
        self._gap(run, at)

    def _flush(self, run: RunState, effects: list[Effect]) -> None:
        """Append the held steps that are now in order."""
        added: list[AcceptedStep] = []
        while (nxt := run.held.pop(run.next_index, None)) is not None:
            step, at, is_placeholder = nxt
            added.append(AcceptedStep(run.next_index, step, at, placeholder=is_placeholder))
            run.contents += content_digest(step)
            if is_placeholder:
                run.placeholders.add(run.next_index)
            run.steps += 1
        if added:
            effects.append(Appended(run.run_id, tuple(added)))

    def _gap(self, run: RunState, at: float) -> None:
        if run.held:
            run.gap_since = run.gap_since if run.gap_since is not None else at
            self._gapped.add(run.run_id)
        else:
            run.gap_since = None
            self._gapped.discard(run.run_id)

    def _fill_gap(self, run: RunState, upto: int, at: float, effects: list[Effect]) -> None:
        missing = [i for i in range(run.next_index, upto) if i not in run.held]
        if missing:
            span = f"{missing[0]}" if len(missing) == 1 else f"{missing[0]}..{missing[-1]}"
            effects.append(
                self._refused(
                    run.run_id,
                    "step_gap",
                    f"step(s) {span} never arrived within {self.limits.hold_s:g}s; later "
                    "steps are scored without them",
                )
            )
        for i in missing:
            run.held[i] = (placeholder(i), at, True)
        self._flush(run, effects)
        run.gap_since = None
        self._gap(run, at)

    def _end(self, record: Ended, effects: list[Effect]) -> None:
        run = self.live.get(record.run_id)
        if run is None:
            orphan = self.orphans.get(record.run_id)
            if orphan is not None:
                orphan.end = record.end
            return
        self._touch(run, record.at)
        if run.ended is not None:
            return
        run.ended = record.end
        if run.held:
            self._fill_gap(run, max(run.held) + 1, record.at, effects)
        effects.append(Closing(run.run_id, outcome_of(record.end)))

    def _close(self, run_id: str, outcome: str, at: float, effects: list[Effect]) -> None:
        if self.live.pop(run_id, None) is None:
            return
        self._gapped.discard(run_id)
        self._remember_ended(run_id, at)
        effects.append(Closed(run_id, outcome, at))

    def _remember_ended(self, run_id: str, at: float) -> None:
        self.ended[run_id] = at
        self.ended.move_to_end(run_id)
        while len(self.ended) > self.limits.ended_memory:
            self.ended.popitem(last=False)

    def remember_deliveries(self, deliveries: list[tuple[int, str, str]]) -> None:
        """Take the recent deliveries (packet id, digest, run id; oldest first) from before a
        restart."""
        for mid, digest, run_id in deliveries[-self.limits.redelivery_window :]:
            self._remember(Delivery(mid, digest), run_id)

    def remember_ended(self, log: list[tuple[str, float | None]]) -> None:
        """Rebuild the memory of ended runs from before a restart, folding their log as it was
        folded live.

        `log` is, oldest first, each run id that ended (with when) or was used again for a new run
        (None).
        """
        for run_id, at in log:
            if at is None:
                self.ended.pop(run_id, None)
            else:
                self._remember_ended(run_id, at)

    # -- for tests and health checks --

    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain data (equal snapshots: equal states)."""
        return {
            "live": [
                {
                    "run_id": r.run_id,
                    "task": r.start.task,
                    "started_at": r.started_at,
                    "last_event": r.last_event,
                    "steps": r.steps,
                    "placeholders": sorted(r.placeholders),
                    "revised": sorted((i, d.hex()) for i, d in r.revised.items()),
                    "held": sorted(
                        (i, s.text, _digests(s), at, p) for i, (s, at, p) in r.held.items()
                    ),
                    "gap_since": r.gap_since,
                    "contents": r.contents.hex(),
                    "ended": None if r.ended is None else r.ended.model_dump(),
                }
                for r in self.live.values()
            ],
            "orphans": [
                (rid, o.first_seen, [(s.index, s.text, at) for s, at in o.steps], o.end is not None)
                for rid, o in self.orphans.items()
            ],
            "ended": list(self.ended.items()),
            "recent": list(self._recent.items()),
        }


_CONTENT = 8


def content_digest(step: StepIn) -> bytes:
    """What tells a re-sent step from a different one under the same index: its text and its number
    of images.

    Not the image bytes: frames the run store pruned come back from it as placeholders, and a
    redelivery after a restart must still read as the same step.
    """
    h = hashlib.blake2b(step.text.encode("utf-8", "surrogatepass"), digest_size=_CONTENT)
    h.update(len(step.images).to_bytes(4, "little"))
    return h.digest()


def _digests(step: StepIn) -> list[str]:
    return [hashlib.sha256(i.decoded()).hexdigest()[:16] for i in step.images]


def kind_of(event: RunStart | StepIn | RunEnd) -> str:
    """The topic kind of an input event: start, step or end."""
    return (
        "start" if isinstance(event, RunStart) else "step" if isinstance(event, StepIn) else "end"
    )


# -- amendments: a step's text replaced by index (the proxy's final answer, once the conversation
# went on) --

_DELIVERED = (Started, Stepped, Orphaned, Ended, Amended)
"""The records of an input event (a delivery to remember)."""


def decide_amend(
    book: RunBook, run_id: str, step: StepIn, now: float, d: Delivery | None
) -> Amended | Refused | Duplicated:
    """An amendment of an accepted step: the record, a duplicate (the step has that text already)
    or a refusal."""
    index = step.index
    assert index is not None  # StepIn checks that an amendment names its step
    run = book.live.get(run_id)
    if run is None:
        why = (
            "the run has ended"
            if run_id in book.ended
            else ("the run has not started (or has expired)")
        )
        return book._refused(
            run_id,
            "unknown_step",
            f"an amendment of step {index} came but {why}; only a "
            "step of a live run "
            "can be amended",
        )
    if run.ended is not None:
        return book._refused(
            run_id, "run_ended", f"an amendment of step {index} came after the run's end"
        )
    if index in run.placeholders:
        return book._refused(
            run_id,
            "conflict",
            f"step {index} was given up for missing and scored as a "
            "placeholder; send it as "
            "a step of its own only before --hold runs out, it cannot be amended",
        )
    if index < run.next_index:
        k = (index - 1) * _CONTENT
        current = run.revised.get(index, bytes(run.contents[k : k + _CONTENT]))
    elif index in run.held:
        current = content_digest(run.held[index][0].model_copy(update={"images": []}))
    else:
        return book._refused(
            run_id,
            "unknown_step",
            f"an amendment of step {index} came but no step {index} "
            "was accepted; send "
            "the step first (an amendment replaces the text of a step already sent)",
        )
    if content_digest(step) == current:
        return Duplicated(run_id, "step")
    return Amended(run_id, step, now, d)


def apply_amend(book: RunBook, record: Amended, effects: list[Effect]) -> None:
    """Replace an accepted step's text: a step waiting for earlier ones is replaced where it
    waits."""
    run = book.live.get(record.run_id)
    index = record.step.index
    if run is None or index is None:
        return
    run.last_event = max(run.last_event, record.at)  # as `RunBook._touch`: the run is active
    book.live.move_to_end(run.run_id)
    if index in run.held:
        held, at, is_placeholder = run.held[index]
        if not is_placeholder:  # the text replaced, its images and meta kept
            run.held[index] = (held.model_copy(update={"text": record.step.text}), at, False)
    elif index < run.next_index and index not in run.placeholders:
        run.revised[index] = content_digest(record.step)
        effects.append(Revised(run.run_id, index, record.step, record.at))
