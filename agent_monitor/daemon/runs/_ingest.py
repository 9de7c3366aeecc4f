"""The monitor's ingest part: decode each message, decide what it means, journal it, then apply what
committed.

A batch of wire-form messages (from MQTT, another source or a cluster inbox) is decoded
(`agent_monitor.wire`), decided against the run state (`RunBook.decide`), journaled in group commits
and only then applied: the state never runs ahead of the journal. Handed what it needs, never the
monitor: the run state, the store, the group book (a start is checked against its limits), the sink
to `emit` to, and `act`, which takes each effect of an applied record (the scoring part's).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from ...wire import Decoder, EventError, RunStart, StepIn, TopicError, Topics, parse_topic
from .._config import MonitorConfig
from .._events import Accepted, Duplicated, Fanout, Refused
from ..stores import (
    Amended,
    Delivery,
    Ended,
    Finished,
    NoStore,
    Orphaned,
    Record,
    RunStore,
    Started,
    Stepped,
)
from ._book import Closed, Effect, RunBook
from ._groups import GroupBook, Joiner
from ._images import fetch_images

log = structlog.get_logger("agent_monitor.daemon")

# Decoding a payload this big (base64 images) in a worker thread keeps the event loop, and so the
# MQTT keep-alive, responsive; smaller ones decode faster inline than a thread hop costs.
_INLINE_DECODE_BYTES = 64 * 1024
_KINDS: dict[type, str] = {
    Started: "start",
    Stepped: "step",
    Orphaned: "step",
    Ended: "end",
    Amended: "amend",
}

Message = tuple[str, bytes, Delivery | None]


@dataclass(eq=False, slots=True)
class _Batch:
    """Records decided against the state before the batch, waiting for their group commit.

    Deciding a record reads its own run's state, except for two kinds: a start at --max-runs evicts
    the run idle longest, and a step for a run not live counts the runs with orphan steps (which
    starts adopt). So a batch holds at most one record per run; a start that evicts joins only with
    its victim named in advance (the least recently active live run no earlier record of the batch
    touches, exactly the one applying it will evict), and a message for a victim waits for the next
    batch; a step for a run not live is decided after the batch, and an orphan step commits alone.
    """

    records: list[tuple[int, Record]] = field(default_factory=list)
    runs: set[str] = field(default_factory=set)
    victims: set[str] = field(default_factory=set)
    starts: int = 0
    order: Iterator[str] | None = None
    """The live runs as the batch began, least recently active first (unchanged until the batch
    commits)."""

    def take(self, verdict: Record, book: RunBook) -> bool:
        """Whether the record may join the batch (a start that evicts takes its victim); False:
        it goes alone."""
        if isinstance(verdict, Orphaned):
            return False
        if not isinstance(verdict, Started):
            return True
        live = len(book.live) + self.starts - len(self.victims)
        if live < book.limits.max_runs:
            self.starts += 1
            return True
        if live > book.limits.max_runs:
            return False  # over the limit already (lowered since a restart): it evicts several
        if self.order is None:
            self.order = iter(book.live)
        for run_id in self.order:
            # A run touched earlier in the batch moves to the back when applied: not this start's
            # victim.
            if run_id not in self.runs:
                self.victims.add(run_id)
                self.starts += 1
                return True
        return False

    def clear(self) -> None:
        """Start the next batch (after a commit: the live runs may have changed)."""
        self.records.clear()
        self.runs.clear()
        self.victims.clear()
        self.starts = 0
        self.order = None


@dataclass(frozen=True, slots=True)
class RunWriterStatistics:
    """What the ingest took in."""

    accepted: Mapping[str, int]
    """Input events journaled and applied, by kind (start, step, end):
    agent_monitor_events_total."""


class RunWriter:
    """Decide, journal and apply input: the one writer of the run state (under `lock`)."""

    def __init__(
        self,
        config: MonitorConfig,
        *,
        book: RunBook,
        store: RunStore,
        groups: GroupBook,
        topics: Topics,
        image_dirs: tuple[str, ...],
        emit: Fanout,
        clock: Callable[[], float],
        act: Callable[[Effect, bool], Awaitable[None]],
        prepare: Callable[[str, RunStart], Joiner],
        unprepare: Callable[[str], object],
        on_retained: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.book = book
        self.store = store
        self.keeps = not isinstance(store, NoStore)
        """Whether the store keeps records (without a store, a record commits as it is decided:
        nothing to call)."""
        self.groups = groups
        self.emit = emit
        self.clock = clock
        self.act = act
        self.prepare = prepare
        self.unprepare = unprepare
        self.topics = topics
        self.on_retained = on_retained
        """Told the kind (start, step, end, other) of each retained input message ignored (the
        counter)."""
        self.retained_told: OrderedDict[str, None] = OrderedDict()
        """Runs told their input came retained (once each; the `ended_memory` most recent)."""
        self.retained_memory = config.limits.ended_memory
        self.image_dirs = image_dirs
        self.max_image_bytes = config.max_image_bytes
        self.decoder = Decoder(
            topics,
            max_payload=config.max_payload_bytes,
            max_image_bytes=config.max_image_bytes,
            # bounded work per start
            image_dirs=image_dirs,
            image_hosts=config.image_hosts,
            rubric_bounds=config.work.rubric,
        )
        # One writer of the run state at a time: decide, journal and apply happen as one step, so
        # the journal's order is the order the state saw (the sources and the sweeper both write).
        self.lock = asyncio.Lock()
        self._evicted: list[Record] | None = None
        """While a batch is applied: the evictions it made, journaled together after it."""
        self.accepted = {kind: 0 for kind in _KINDS.values()}
        """Input events journaled and applied, by kind (read at scrape time:
        agent_monitor_events_total)."""

    def statistics(self) -> RunWriterStatistics:
        """Input events accepted so far, by kind."""
        return RunWriterStatistics(accepted=dict(self.accepted))

    async def handle_batch(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Handle messages in arrival order, journaling what they mean in group commits; per
        message, None or why not.

        A message whose record failed to commit gets its error (it must not be acknowledged: the
        broker delivers it again); None means handled (accepted, refused or ignored) and safe to
        acknowledge. Each record is applied only after its transaction commits, so the state never
        runs ahead of the journal. A batch is decided against the state before it, so it holds at
        most one record per run and none for a run a start of the batch evicts; a step for a run not
        live (an orphan) is decided after the batch and commits alone (see `_Batch`).
        """
        decoded = [await self._decode(topic, payload) for topic, payload, _ in messages]
        errors: list[BaseException | None] = [None] * len(messages)
        b = _Batch()

        async def flush() -> None:
            await self._commit(b.records, errors)
            b.clear()

        async with self.lock:
            for i, d in enumerate(decoded):
                if d is None:
                    continue
                run_id, event = d
                topic, delivery = messages[i][0], messages[i][2]
                # A step for a run that is not live is decided on the number of runs with orphan
                # steps, which the batch's starts change (they adopt theirs): decided on the state
                # after the batch.
                orphan = isinstance(event, StepIn) and run_id not in self.book.live
                # A start joining a group is checked against the group's size, which the batch's
                # other starts change: decided on the state now, and committed alone.
                grouped = isinstance(event, RunStart) and event.group is not None
                if run_id in b.runs or run_id in b.victims or ((orphan or grouped) and b.records):
                    await flush()
                verdict = self._decide(run_id, event, delivery)
                if verdict is None:
                    continue
                joins = b.take(verdict, self.book)
                if not joins and b.records:
                    await flush()
                    verdict = self._decide(run_id, event, delivery)  # against the state now
                    if verdict is None:
                        continue
                    joins = b.take(verdict, self.book)
                if isinstance(verdict, Started) and not self._prepare(run_id, verdict.start, topic):
                    continue
                b.records.append((i, verdict))
                b.runs.add(run_id)
                # it reads state beyond its run: alone, decided on the state now
                if not joins or grouped:
                    await flush()
            await flush()
        return errors

    def retained(self, topic: str) -> None:
        """An input message came with the retain flag: ignore it, count it, tell its run once.

        A retained input is a stored copy the broker sends again on every subscription, so on every
        restart: handled, it would start an ended run again, score it again and teach its outcome
        again. The monitor does not clear it (publishing an empty retained message on an input
        topic): its broker account need not be allowed to write there, the empty message would reach
        every other subscriber of the inputs, and the harness that sets the flag would only set it
        again.
        """
        if self.topics.is_output(topic):
            # the monitor's own retained outputs (signal, state, ranking), back on MQTT 3.1.1
            return
        try:
            run_id, kind = parse_topic(topic, self.topics.prefix)
        except TopicError:
            self.on_retained("other")
            return
        self.on_retained(kind)
        if run_id in self.retained_told:
            return
        self.retained_told[run_id] = None
        while len(self.retained_told) > self.retained_memory:
            self.retained_told.popitem(last=False)
        self.emit(
            Refused(
                run_id,
                "retained",
                f"a {kind} came with the MQTT retain flag: the broker replays a retained "
                "message on every "
                "subscription (so on every monitor restart), so retained inputs are ignored; "
                "publish start, step "
                "and end without retain, and clear this one (an empty retained message on "
                "the topic)",
                topic,
            )
        )

    def _decide(self, run_id: str, event: Any, delivery: Delivery | None) -> Record | None:
        """The record an event makes, or None (refused or a duplicate: reported here)."""
        verdict = self.book.decide(run_id, event, self.clock(), delivery)
        if isinstance(verdict, (Refused, Duplicated)):
            self.emit(verdict)  # what deciding says is the sinks' event itself
            return None
        if isinstance(verdict, Orphaned) and run_id not in self.book.orphans:
            # Said at once, not after --hold: the run's first step that came before its start (once
            # per run id).
            log.warning(
                "step_before_start",
                run_id=run_id,
                hold_s=self.book.limits.hold_s,
                what="the step waits for the run's start; publish the start first (it is "
                "refused as no_start if "
                "none comes within hold_s)",
            )
        return verdict

    def _prepare(self, run_id: str, start: RunStart, topic: str) -> bool:
        """Build a start's tracker, then check it against its group; False: refused (reported,
        nothing kept)."""
        try:
            self.prepare(run_id, start)
        except Exception as e:  # validated on decode; still the run's problem, never the daemon's
            self.emit(
                Refused(
                    run_id, "run_rejected", f"start cannot be used: {type(e).__name__}: {e}", topic
                )
            )
            return False
        # A start naming a group it may not join is still a run: it is placed when applied
        # (`Groups.join`).
        return True

    async def _decode(self, topic: str, payload: bytes) -> tuple[str, Any] | None:
        """The run id and event of one input message; None for the monitor's own outputs and
        refused input."""
        try:
            big = len(payload) > _INLINE_DECODE_BYTES
            decoded = (
                await asyncio.to_thread(self.decoder, topic, payload)
                if big
                else self.decoder(topic, payload)
            )
            if decoded is None:
                return None  # one of the monitor's own outputs
            run_id, event = decoded
            if any(i.remote for i in getattr(event, "images", ())):
                await asyncio.to_thread(
                    fetch_images,
                    run_id,
                    event,
                    image_dirs=self.image_dirs,
                    max_bytes=self.max_image_bytes,
                )
        except EventError as e:
            self.emit(Refused(e.run_id, e.reason, e.message, topic))
            return None
        return run_id, event

    async def _commit(
        self, batch: list[tuple[int, Record]], errors: list[BaseException | None]
    ) -> None:
        """Journal a batch's records in one transaction, then apply them; on a failure mark them
        unacknowledgeable."""
        if not batch:
            return
        records = [r for _, r in batch]
        committed = 0
        try:
            # Journaled before they count, and before the broker is told they arrived (the link acks
            # once the batch is handled): a crash in between makes the broker redeliver them.
            if not self.keeps:
                committed = len(records)
            elif (group := getattr(self.store, "journal_batch", None)) is not None:
                await group(records)
                committed = len(records)
            # a store of the user's without group commits: one by one, the committed ones count
            else:
                for r in records:
                    await self.store.journal(r)
                    committed += 1
        except Exception as e:
            log.warning(
                "journal_failed", records=len(batch) - committed, error=f"{type(e).__name__}: {e}"
            )
            for i, r in batch[committed:]:
                errors[i] = e
                if isinstance(r, Started):
                    self.unprepare(r.run_id)
        self._evicted = []
        try:
            for _, r in batch[:committed]:
                kind = _KINDS[type(r)]
                self.accepted[kind] += 1
                # no sink of the monitor's own takes it: a user's may
                if Accepted in self.emit.taken:
                    self.emit(Accepted(r.run_id, kind))
                await self.apply(r)
            evicted, self._evicted = self._evicted, None
            if evicted:
                # The store learns the evicted runs are over in one commit (a crash before it:
                # replaying the starts evicts them again, and journals this again).
                await self._journal(evicted)
        except Exception:
            log.exception("eviction_not_journaled", runs=len(self._evicted or ()))
        finally:
            self._evicted = None
        batch.clear()

    async def _journal(self, records: list[Record]) -> None:
        """Journal records in one commit (one by one for a store without group commits; without a
        store, nothing)."""
        if not self.keeps:
            return
        group = getattr(self.store, "journal_batch", None)
        if group is not None:
            await group(records)
        else:
            for r in records:
                await self.store.journal(r)

    async def apply(self, record: Record, *, replaying: bool = False) -> None:
        """Apply a journaled record to the run state and act on what it changed (the caller holds
        `lock`)."""
        for effect in self.book.apply(record, replaying=replaying):
            try:
                if isinstance(effect, Refused):
                    if not replaying:
                        self.emit(effect)
                    continue
                if isinstance(effect, Closed) and effect.outcome == "evicted":
                    # Derived from a start, not journaled by itself: the store learns the run is
                    # over here (with the other evictions of a batch, after it).
                    finished = Finished(effect.run_id, effect.outcome, effect.at)
                    if self._evicted is not None:
                        self._evicted.append(finished)
                    else:
                        await self.store.journal(finished)
                await self.act(effect, replaying)
            except Exception:
                # A bug in acting on one record must not stop the daemon or the other runs.
                log.exception(
                    "record_handling_failed", run_id=record.run_id, record=type(record).__name__
                )

    async def finish(self, run_id: str, outcome: str, teach: Callable[[str], None]) -> None:
        """Journal a run's end once its newest prefix is scored; `teach` learns from it first."""
        await self.finish_many([(run_id, outcome)], teach)

    async def finish_many(
        self, ends: Sequence[tuple[str, str]], teach: Callable[[str], None]
    ) -> None:
        """Journal runs' ends in one commit once their newest prefixes are scored; `teach` learns
        from each first."""
        async with self.lock:
            records = [
                r
                for run_id, outcome in ends
                if (r := self.book.finish(run_id, outcome, self.clock()))
            ]
            if not records:
                return
            # Learnt before the runs' ends are journaled: the samples' writes are queued first, so a
            # crash in between replays runs that teach again, and the calibration keeps each sample
            # once.
            for record in records:
                teach(record.run_id)
            await self._journal(list(records))
            for record in records:
                await self.apply(record)

    async def sweep(self) -> None:
        """Act on what time made due: steps with no start, gaps nobody fills, idle runs."""
        async with self.lock:
            for record in self.book.due(self.clock()):
                await self.store.journal(record)
                await self.apply(record)
