"""The monitor daemon: an async context manager whose loops (MQTT link, scorers, sweeper) run in one TaskGroup.

A message's path: the MQTT link hands it, with every message that arrived meanwhile, to
`handle_batch`, which decodes each (`agent_monitor.wire`), asks the run state what it means
(`RunBook.decide`), journals the batch's records in one transaction (a group commit) and applies
them once it committed; the link acknowledges each message only after that (`handle` is the same
for one message). Steps now in order go to the run's
tracker and wake the scheduler; a scorer scores the run's newest prefix and hands the result to
the sinks (MQTT, store, metrics, log). A restart replays the journal through the same `apply`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import structlog
from prometheus_client import CollectorRegistry

from ..calibration import Calibration, Sample, outcome_authentic
from ..criteria import CriteriaError, Rubric, load_criteria
from ..groups import GroupState
from ..judges.base import Judge
from ..judges.circuit import CircuitJudge
from ..policy import Policy, with_levels
from ..progress import OUTAGE_REASONS, Decision, Progress, Signal, run_totals
from ..scheduler import Scheduler
from ..selection import Comparison, compare, tournament
from ..tracker import AsyncProgressTracker
from ..wire import EventError, RunStart, StepIn, Topics, decode_event
from ._config import MonitorConfig
from ._groups import GroupBook, GroupLimitError, GroupSeries, Joiner
from ._metrics import (
    CalibrationCollector,
    CostCollector,
    GroupCollector,
    MeteredJudge,
    Metrics,
    MetricsSink,
    RunCollector,
    RunSeries,
    series_of,
)
from ._mqtt import MqttLink
from ._outbox import Message, Outbox
from ._sinks import (
    Accepted,
    Duplicated,
    GroupRanked,
    LogSink,
    MonitorEvent,
    MqttSink,
    Refused,
    RunClosed,
    RunOpened,
    Scored,
    SignalChanged,
    Sink,
    StoreSink,
)
from ._source import Ingest, Source
from ._sources import fetch_images
from ._state import (
    AcceptedStep,
    Appended,
    Closed,
    Closing,
    Delivery,
    Duplicate,
    Ended,
    Finished,
    Notice,
    Opened,
    Orphaned,
    Record,
    Refusal,
    RunBook,
    Started,
    Stepped,
)
from ._store import NoStore, RunStore, SqliteStore
from ._work import CallRate, calls_per_scoring, check_start

if TYPE_CHECKING:
    from ._cluster import Cluster
    from ._otel import OtelSink

log = structlog.get_logger("agent_monitor.daemon")

# Decoding a payload this big (base64 images) in a worker thread keeps the event loop, and so the
# MQTT keep-alive, responsive; smaller ones decode faster inline than a thread hop costs.
_INLINE_DECODE_BYTES = 64 * 1024
_KINDS: dict[type, str] = {Started: "start", Stepped: "step", Orphaned: "step", Ended: "end"}
# How long leaving the monitor waits for queued OpenTelemetry events to reach the collector.
_OTLP_CLOSE_S = 5.0


@dataclass(eq=False, slots=True)
class _Scoring:
    """The scoring side of one live run: its tracker (steps, curve, policy state) and what was published."""

    tracker: AsyncProgressTracker
    policy: Policy
    labels: dict[str, str]
    scored: int = 0
    signal: Signal = "continue"
    last_ok: Progress | None = None
    arrived: dict[int, float] = field(default_factory=dict)
    group: str | None = None
    """The run's group (`start.group`), while it is in one."""
    closing: str | None = None
    """The outcome to finish with once the newest prefix is scored (set when the end is accepted)."""

    @property
    def wants_scoring(self) -> bool:
        """Steps wait to be scored, and the run was not told to abort (abort is final)."""
        return len(self.tracker.steps) > self.scored and self.signal != "abort"


@dataclass(eq=False, slots=True)
class _Batch:
    """Records decided against the state before the batch, waiting for their group commit.

    Deciding a record reads its own run's state, except for two kinds: a start at --max-runs evicts the
    run idle longest, and a step for a run not live counts the runs with orphan steps (which starts
    adopt). So a batch holds at most one record per run; a start that evicts joins only with its victim
    named in advance (the least recently active live run no earlier record of the batch touches, exactly
    the one applying it will evict), and a message for a victim waits for the next batch; a step for a
    run not live is decided after the batch, and an orphan step commits alone.
    """

    records: list[tuple[int, Record]] = field(default_factory=list)
    runs: set[str] = field(default_factory=set)
    victims: set[str] = field(default_factory=set)
    starts: int = 0
    order: Iterator[str] | None = None
    """The live runs as the batch began, least recently active first (unchanged until the batch commits)."""

    def take(self, verdict: Record, book: RunBook) -> bool:
        """Whether the record may join the batch (a start that evicts takes its victim); False: it goes alone."""
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
            # A run touched earlier in the batch moves to the back when applied: not this start's victim.
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


def joiner_of(start: RunStart, scoring: _Scoring) -> Joiner:
    """What a start brings to its group (harden hook: membership by family, rubric and group settings)."""
    family = scoring.tracker.family
    return Joiner(family.name, family.rubric, scoring.policy, start.started_at, start.auth)


@dataclass(frozen=True, slots=True)
class _Runs:
    """The `RunsView` a source reads: a live run's signal and newest result."""

    monitor: Monitor

    def is_live(self, run_id: str) -> bool:
        return run_id in self.monitor._scoring

    def signal(self, run_id: str) -> Signal | None:
        s = self.monitor._scoring.get(run_id)
        return s.signal if s is not None else None

    def latest(self, run_id: str) -> Progress | None:
        s = self.monitor._scoring.get(run_id)
        return s.tracker.latest if s is not None else None


@dataclass(frozen=True, slots=True)
class StepView:
    """One step of a live run as scored: its text after the rubric's extractors, and how many frames it has."""

    index: int
    text: str
    placeholder: bool
    frames: int


@dataclass(frozen=True, slots=True)
class RunView:
    """A live run as the monitor has it now (for health checks, tests and boards): a copy, safe to keep."""

    run_id: str
    task: str
    steps: tuple[StepView, ...]
    """The run's steps in order, placeholders for missing ones included."""
    held: tuple[int, ...]
    """Indexes of steps waiting for earlier ones."""
    scored: int
    """Steps covered by the newest score."""
    signal: Signal
    latest: Progress | None
    last_ok: Progress | None
    curve: tuple[Progress, ...]
    """The newest results (the tracker's `curve_window`); the run store keeps every one."""
    ended: bool
    last_event: float
    labels: Mapping[str, str] = field(default_factory=dict)
    """The start's labels (a copy)."""


class Monitor:
    """Follow every run published under the topic prefix, score each new prefix, publish progress and signals.

    ```python
    config = MonitorConfig(broker=BrokerSettings.from_url("mqtt://127.0.0.1:1883"))
    async with Monitor(config, judge=judge, store=SqliteStore(path)) as monitor:
        await monitor.wait()  # serve until cancelled
    ```
    Entering rebuilds the live runs from the store, connects to the broker (raising
    `BrokerUnavailable` with a one-line reason) and starts the named tasks `mqtt`,
    `scorer-1..N`, `sweeper` (and `retention` for a SQLite store); leaving cancels and awaits
    them all. Without a broker (`config.broker=None`) nothing is received: feed events with
    `handle()` (tests, embedding). Without a store nothing is journaled (a restart forgets the
    runs); `SqliteStore` survives restarts, `MemoryStore` keeps the journal in this process. `sinks` are called with every `MonitorEvent`, after the
    monitor's own (MQTT, store, metrics, log).

    With `config.cluster.url` (cluster mode, docs/cluster.md) the monitor is one replica of several sharing
    runs through Redis: it journals what it receives into the runs' shared inboxes (before acknowledging),
    owns the runs the cluster places on it (a lease with a fencing token each), and scores and publishes
    only those; the named tasks `cluster-heartbeat`, `cluster-notes`, `cluster-feed`, `cluster-writer` and
    `cluster-sessions` run beside the others. Leaving hands its runs to the other replicas.

    With `config.otlp_endpoint`, `otel` (an `OtelSink`) sends every score's OpenTelemetry
    `gen_ai.evaluation.result` events to that collector: opened on entering, flushed on leaving.

    `calibration` holds what every run that ended with a success or failure outcome taught (kept in the
    store, loaded on entering): the evidence `abort_below: "auto"` thresholds come from, per family,
    judge model and rubric.
    """

    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        judge: Judge,
        store: RunStore | None = None,
        registry: CollectorRegistry | None = None,
        sinks: Sequence[Sink] = (),
        sources: Sequence[Source] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        c = self.config = config if config is not None else MonitorConfig()
        self.clock = clock
        # Read once, here: a bad name or file fails the start-up, not each run. The operator's file, never an event's.
        try:
            self.criteria: Rubric = load_criteria(c.criteria)
        except CriteriaError as e:
            raise CriteriaError(f"default criteria {c.criteria!r} (serve --criteria): {e}") from None
        """The rubric of runs whose start names none."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        # Every judge call is counted on its way through; the circuit breaker sits in front, so the calls
        # it refuses while the judge is down are not counted as judge calls. It reads the judge's timeout
        # through MeteredJudge and reports a hanging judge degraded after two timeouts of silence.
        metered = MeteredJudge(judge, self.metrics)
        self.circuit = CircuitJudge(
            metered,
            threshold=c.circuit_threshold,
            cooldown_s=c.circuit_cooldown_s,
            on_change=self._judge_state,
        )
        self.topics = Topics(c.prefix)
        self.prices = c.prices
        self.outbox = Outbox(c.outbox_size, metrics=self.metrics)
        self.cluster: Cluster | None = None
        """Cluster mode (`config.cluster.url`): the replica's membership, leases and shared journal in Redis."""
        if c.cluster.url is not None:
            if store is not None:
                raise ValueError("a Monitor in cluster mode keeps its journal in Redis: pass no store")
            # Imported here: without a cluster nothing loads redis (ImportError names the extra).
            from ._cluster import Cluster

            self.cluster = Cluster(c.cluster, monitor=self, metrics=self.metrics, retention_s=c.retention_s)
            store = self.cluster.store
            # Only the run's owner publishes: what a replica queued for a run it no longer owns is dropped.
            self.outbox.gate = self.cluster.may_publish
        self.store: RunStore = store if store is not None else NoStore()
        self.book = RunBook(c.limits)
        self.scheduler: Scheduler[str] = Scheduler(self._score, on_depth=self.metrics.queue_depth.set)
        self._metrics_sink = MetricsSink(
            self.metrics, grace_s=c.metrics.grace_s, memory=c.limits.ended_memory, clock=clock
        )
        self.otel: OtelSink | None = None
        """The OpenTelemetry sink, with `config.otlp_endpoint` (opened on entering, flushed on leaving)."""
        if c.otlp_endpoint is not None:
            # Imported here: without an endpoint no OpenTelemetry package is loaded (ImportError names the extra).
            from ._otel import OtelSink

            self.otel = OtelSink(c.otlp_endpoint, registry=self.registry, criteria=self._criteria_of)
        self.sinks: tuple[Sink, ...] = (
            MqttSink(self.outbox, self.topics, on_signal_sent=self.cluster.signal_sent if self.cluster else None),
            StoreSink(self.store),
            self._metrics_sink,
            LogSink(log),
            *((self.otel,) if self.otel is not None else ()),
            *sinks,
            *(src.sink for src in sources if src.sink is not None),
        )
        names = [src.name for src in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"sources need distinct names, got {names}")
        self.sources: tuple[Source, ...] = tuple(sources)
        """Front doors besides MQTT (the OTLP receiver, the proxy, the reward API): each a task `source-{name}`."""
        # Off by default: a network event must not make the monitor read local files or fetch URLs.
        self.image_dirs = tuple(str(Path(d).resolve()) for d in c.image_dirs)
        self._decode_args: dict[str, Any] = {
            "prefix": c.prefix,
            "max_payload": c.max_payload_bytes,
            "max_image_bytes": c.max_image_bytes,
            "image_dirs": self.image_dirs,
            "image_hosts": c.image_hosts,
            "rubric_bounds": c.work.rubric,  # harden hook: bounded work per start
        }
        # harden hook: judge calls per run per minute (a run past it waits; its steps coalesce).
        self._rate = CallRate(c.work.max_judge_calls_per_run_minute, clock=clock)
        self.registry.register(
            RunCollector(self._series, label_names=c.metrics.labels, max_series=c.metrics.max_series)
        )
        if self.prices is not None:
            self.registry.register(CostCollector(metered, self.prices))
        lim = c.limits
        self.groups = GroupBook(
            max_groups=lim.max_groups,
            max_group_runs=lim.max_group_runs,
            grace_s=lim.group_grace_s,
            secret=c.group_secret,  # harden hook: group membership rules
            policy=c.policy if c.group_policy_fixed else None,
        )
        """Sibling runs (`start.group`) ranked together; their rankings are retained on `{prefix}/_groups/{group}/ranking`."""
        # Kept current one group at a time on the event loop; the scrape thread reads a copy, most recent first.
        self._group_series: dict[str, GroupSeries] = {}
        self.registry.register(
            GroupCollector(
                lambda: sorted(dict(self._group_series).values(), key=lambda s: s.last_at, reverse=True),
                allow=c.metrics.groups,
                max_groups=c.metrics.max_group_series,
            )
        )
        self.calibration = Calibration(
            success_at=c.calibration_success_at,
            on_sample=self._learned,
            clock=clock,
            strata=c.calibration_strata,  # harden hook: length strata, per-family teaching rate
            max_rate=c.calibration_rate,
        )
        self._families = CalibrationCollector(
            self.calibration, c.policy, allow=c.metrics.families, max_families=c.metrics.max_families
        )
        self.registry.register(self._families)
        self.link = (
            MqttLink(
                c.broker,
                topics=self.topics,
                client_id=self.cluster.client_id(c.client_id) if self.cluster else c.client_id,
                share=c.cluster.name if self.cluster else None,
                protocol=c.protocol,
                session_expiry_s=c.session_expiry_s,
                receive_window=c.receive_window,
                metrics=self.metrics,
            )
            if c.broker is not None
            else None
        )
        self.scorings = 0
        self.restored: tuple[str, ...] = ()
        """The live runs rebuilt from the store on entering, least recently active first."""
        self._scoring: dict[str, _Scoring] = {}
        self._prepared: dict[str, _Scoring] = {}
        self._default_policy: tuple[Policy, dict[str, Any]] | None = None
        self._evicted: list[Record] | None = None
        """While a batch is applied: the evictions it made, journaled together after it."""
        self._routes: dict[type, list[Sink]] = {}
        # One writer of the run state at a time: decide, journal and apply happen as one step, so the
        # journal's order is the order the state saw (the MQTT loop and the sweeper both write).
        self._lock = asyncio.Lock()
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        # policy.compare: one pivot tournament in flight per group; what it last compared; groups to compare again.
        self._comparing: dict[str, asyncio.Task[None]] = {}
        self._compared: dict[str, tuple[tuple[str, int], ...]] = {}
        self._compare_again: set[str] = set()

    # -- lifecycle --

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("the monitor is already running")
        if self.cluster is not None:
            # Joined before the broker is: a replica assigns the runs it receives to live replicas, itself included.
            await self.cluster.open()
        # Rebuilt before connecting: steps the broker redelivers then meet the runs they belong to.
        await self._restore()
        if self.restored:
            log.info("runs_restored", runs=len(self.restored), run_ids=list(self.restored[:20]))
        try:
            first = await self.link.connect() if self.link is not None else None
        except BaseException:
            if self.cluster is not None:
                await self.cluster.aclose()
            raise
        stack = contextlib.AsyncExitStack()
        if self.cluster is not None:
            stack.push_async_callback(self.cluster.aclose)
        if self.otel is not None:
            # Opened before the scorers start (their first scores are sent); closed after they stopped, off the loop.
            self.otel.open()
            stack.push_async_callback(asyncio.to_thread, self.otel.close, _OTLP_CLOSE_S)
        try:
            tg = await stack.enter_async_context(asyncio.TaskGroup())
            if self.link is not None:
                # In cluster mode a replica journals what it receives into the runs' shared inboxes; each run's
                # owner reads its inbox and hands the events to handle_batch.
                receive = self.cluster.receive if self.cluster is not None else self.handle_batch
                self._tasks.append(tg.create_task(self.link.run(receive, self.outbox, first=first), name="mqtt"))
            if self.cluster is not None:
                for name, loop in self.cluster.loops():
                    self._tasks.append(tg.create_task(loop, name=name))
            # Every door hands its events to the same receive as MQTT: in cluster mode the runs' shared inboxes.
            ingest = Ingest(self.cluster.receive if self.cluster is not None else self.handle_batch, self.topics)
            for src in self.sources:
                self._tasks.append(tg.create_task(src.run(ingest, _Runs(self)), name=f"source-{src.name}"))
            for i in range(self.config.max_concurrency):
                self._tasks.append(tg.create_task(self.scheduler.worker(), name=f"scorer-{i + 1}"))
            self._tasks.append(tg.create_task(self._sweeper(), name="sweeper"))
            if isinstance(self.store, SqliteStore):
                self._tasks.append(tg.create_task(self._retention(self.store), name="retention"))
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        log.info(
            "monitor_started",
            prefix=self.config.prefix,
            judge=self.circuit.name,
            max_concurrency=self.config.max_concurrency,
            broker=self.link.broker.url if self.link else None,
            protocol=self.link.negotiated if self.link else None,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.cluster is not None and self._stack is not None:
            # Before the loops stop: stop receiving, hand the runs to the other replicas, deregister.
            await self.cluster.leave(self.link)
        stack, tasks = self._stack, self._tasks
        self._stack, self._tasks = None, []
        tasks = [*tasks, *self._comparing.values()]
        for task in tasks:
            task.cancel()
        pending = {t for t in tasks if not t.done()}
        while pending:
            # On Python 3.11, asyncio.wait_for (inside aiomqtt's publish, and the circuit's wait) can swallow a
            # cancel that lands as its inner future completes; a loop that goes on is cancelled again.
            _, pending = await asyncio.wait(pending, timeout=0.5)
            for task in pending:
                task.cancel()
        if stack is not None:
            # The loops run forever, so they end only by cancellation; the TaskGroup awaits each one.
            with contextlib.suppress(asyncio.CancelledError):
                await stack.aclose()
        self._stopped.set()
        log.info("monitor_stopped", scorings=self.scorings, live_runs=len(self.book.live))

    async def wait(self) -> None:
        """Serve until the surrounding task is cancelled (or the monitor is left)."""
        await self._stopped.wait()

    async def drain(self) -> None:
        """Wait until every step received so far is scored (tests, shutdown; bound it with asyncio.timeout)."""
        await self.scheduler.drain()

    def status(self) -> dict[str, Any]:
        """A snapshot for logs and health checks."""
        return {
            "live_runs": len(self.book.live),
            "queued": len(self.outbox),
            "scorings": self.scorings,
            "degraded": self.circuit.degraded,
            "judge_rate": self._rate.statistics(),
            "connected": bool(self.link and self.link.connected.is_set()),
            **(self.cluster.status() if self.cluster is not None else {}),
            **({"sources": {src.name: dict(src.statistics()) for src in self.sources}} if self.sources else {}),
        }

    def run(self, run_id: str) -> RunView | None:
        """A copy of a live run's state and scores, or None when the run is not live."""
        state, s = self.book.live.get(run_id), self._scoring.get(run_id)
        if state is None or s is None:
            return None
        return RunView(
            run_id=run_id,
            task=state.start.task,
            steps=tuple(
                StepView(t.index, t.text, t.index in state.placeholders, len(t.frames)) for t in s.tracker.steps
            ),
            held=tuple(sorted(state.held)),
            scored=s.scored,
            signal=s.signal,
            latest=s.tracker.latest,
            last_ok=s.last_ok,
            curve=tuple(s.tracker.curve),
            ended=state.ended is not None,
            last_event=state.last_event,
            labels=dict(s.labels),
        )

    def _criteria_of(self, run_id: str) -> tuple[str, ...]:
        """The names of a live run's criteria (a failed score's evaluation events are one per criterion)."""
        s = self._scoring.get(run_id)
        return tuple(c.name for c in s.tracker.rubric.criteria) if s else ()

    def tracker(self, run_id: str) -> AsyncProgressTracker | None:
        """The tracker scoring a live run (its steps, curve and policy state), or None."""
        s = self._scoring.get(run_id)
        return s.tracker if s else None

    # -- input --

    async def handle(self, topic: str, payload: bytes, delivery: Delivery | None = None) -> None:
        """Decode one message, journal what it means, fold it into its run; bad input is reported, never raised.

        Raises only when the run store cannot write: the message is then not acknowledged, and the
        broker delivers it again. The monitor's own outputs (progress, signal, error, `_errors`), which its
        subscription `{prefix}/+/+` also matches, are ignored: acknowledged, not reported.
        """
        (error,) = await self.handle_batch([(topic, payload, delivery)])
        if error is not None:
            raise error

    async def handle_batch(self, messages: Sequence[tuple[str, bytes, Delivery | None]]) -> list[BaseException | None]:
        """Handle messages in arrival order, journaling what they mean in group commits; per message, None or why not.

            A message whose record failed to commit gets its error (it must not be acknowledged: the broker
            delivers it again); None means handled (accepted, refused or ignored) and safe to acknowledge.
            Each record is applied only after its transaction commits, so the state never runs ahead of the
            journal. A batch is decided against the state before it, so it holds at most one record per run
            and none for a run a start of the batch evicts; a step for a run not live (an orphan) is decided after
        the batch and commits alone (see `_Batch`).
        """
        decoded = [await self._decode(topic, payload) for topic, payload, _ in messages]
        errors: list[BaseException | None] = [None] * len(messages)
        b = _Batch()

        async def flush() -> None:
            await self._commit(b.records, errors)
            b.clear()

        async with self._lock:
            for i, d in enumerate(decoded):
                if d is None:
                    continue
                run_id, event = d
                topic, delivery = messages[i][0], messages[i][2]
                # A step for a run that is not live is decided on the number of runs with orphan steps, which
                # the batch's starts change (they adopt theirs): decided on the state after the batch.
                orphan = isinstance(event, StepIn) and run_id not in self.book.live
                # A start joining a group is checked against the group's size, which the batch's other starts
                # change: decided on the state now, and committed alone.
                grouped = isinstance(event, RunStart) and event.group is not None
                if run_id in b.runs or run_id in b.victims or ((orphan or grouped) and b.records):
                    await flush()
                verdict = self.book.decide(run_id, event, self.clock(), delivery)
                if isinstance(verdict, Refusal):
                    self._emit(Refused(run_id, verdict.reason, verdict.message, topic, verdict.count))
                    continue
                if isinstance(verdict, Duplicate):
                    self._emit(Duplicated(run_id, verdict.kind, verdict.counted))
                    continue
                joins = b.take(verdict, self.book)
                if not joins and b.records:
                    await flush()
                    verdict = self.book.decide(run_id, event, self.clock(), delivery)  # against the state now
                    if isinstance(verdict, Refusal):
                        self._emit(Refused(run_id, verdict.reason, verdict.message, topic, verdict.count))
                        continue
                    if isinstance(verdict, Duplicate):
                        self._emit(Duplicated(run_id, verdict.kind, verdict.counted))
                        continue
                    joins = b.take(verdict, self.book)
                if isinstance(verdict, Started):
                    try:
                        self._prepared[run_id] = prepared = self._new_scoring(run_id, verdict.start)
                    except Exception as e:  # validated on decode; still the run's problem, never the daemon's
                        self._emit(
                            Refused(run_id, "run_rejected", f"start cannot be used: {type(e).__name__}: {e}", topic)
                        )
                        continue
                    if verdict.start.group is not None:
                        try:  # harden hook: checked with what the run is graded on (after its scoring is built)
                            self.groups.check(run_id, verdict.start.group, joiner_of(verdict.start, prepared))
                        except GroupLimitError as e:
                            self._prepared.pop(run_id, None)
                            self.metrics.groups_refused.inc()
                            self._emit(Refused(run_id, "run_rejected", str(e), topic))
                            continue
                b.records.append((i, verdict))
                b.runs.add(run_id)
                if not joins or grouped:  # it reads state beyond its run: alone, decided on the state now
                    await flush()
            await flush()
        return errors

    async def _decode(self, topic: str, payload: bytes) -> tuple[str, Any] | None:
        """The run id and event of one input message; None for the monitor's own outputs and refused input."""
        if self.topics.is_output(topic):
            return None
        try:
            if len(payload) > _INLINE_DECODE_BYTES:
                run_id, event = await asyncio.to_thread(decode_event, topic, payload, **self._decode_args)
            else:
                run_id, event = decode_event(topic, payload, **self._decode_args)
            if any(i.remote for i in getattr(event, "images", ())):
                await asyncio.to_thread(
                    fetch_images, run_id, event, image_dirs=self.image_dirs, max_bytes=self.config.max_image_bytes
                )
        except EventError as e:
            self._emit(Refused(e.run_id, e.reason, e.message, topic))
            return None
        return run_id, event

    async def _commit(self, batch: list[tuple[int, Record]], errors: list[BaseException | None]) -> None:
        """Journal a batch's records in one transaction, then apply them; on a failure mark them unacknowledgeable."""
        if not batch:
            return
        records = [r for _, r in batch]
        committed = 0
        try:
            # Journaled before they count, and before the broker is told they arrived (the link acks once the
            # batch is handled): a crash in between makes the broker redeliver them.
            group = getattr(self.store, "journal_batch", None)
            if group is not None:
                await group(records)
                committed = len(records)
            else:  # a store of the user's without group commits: one by one, the committed ones count
                for r in records:
                    await self.store.journal(r)
                    committed += 1
        except Exception as e:
            log.warning("journal_failed", records=len(batch) - committed, error=f"{type(e).__name__}: {e}")
            for i, r in batch[committed:]:
                errors[i] = e
                if isinstance(r, Started):
                    self._prepared.pop(r.run_id, None)
        self._evicted = []
        try:
            for _, r in batch[:committed]:
                self._emit(Accepted(r.run_id, _KINDS[type(r)]))
                await self._apply(r)
            evicted, self._evicted = self._evicted, None
            if evicted:
                # The store learns the evicted runs are over in one commit (a crash before it: replaying the starts
                # evicts them again, and journals this again).
                await self._journal_records(evicted)
        except Exception:
            log.exception("eviction_not_journaled", runs=len(self._evicted or ()))
        finally:
            self._evicted = None
        batch.clear()

    async def _journal_records(self, records: list[Record]) -> None:
        group = getattr(self.store, "journal_batch", None)
        if group is not None:
            await group(records)
        else:
            for r in records:
                await self.store.journal(r)

    async def _apply(self, record: Record, *, replaying: bool = False) -> None:
        """Apply a journaled record to the run state and act on what it changed."""
        for effect in self.book.apply(record, replaying=replaying):
            try:
                if isinstance(effect, Appended):
                    await self._append(effect.run_id, effect.steps, replaying)
                elif isinstance(effect, Opened):
                    self._open(effect.run_id, effect.start, replaying)
                elif isinstance(effect, Closing):
                    scoring = self._scoring.get(effect.run_id)
                    if scoring is not None:
                        scoring.closing = effect.outcome
                        if not replaying:
                            self.scheduler.wake(effect.run_id)  # finishes the run once its newest prefix is scored
                elif isinstance(effect, Closed):
                    await self._closed(effect, replaying)
                elif isinstance(effect, Notice) and not replaying:
                    where = self.topics.of(effect.run_id, effect.kind) if effect.run_id else self.topics.errors
                    self._emit(
                        Refused(effect.run_id, effect.reason, effect.message, where, effect.count, effect.invalid)
                    )
            except Exception:
                # A bug in acting on one record must not stop the daemon or the other runs.
                log.exception("record_handling_failed", run_id=record.run_id, record=type(record).__name__)

    def _new_scoring(self, run_id: str, start: RunStart) -> _Scoring:
        c = self.config
        rubric = start.rubric() if start.criteria is not None else self.criteria
        check_start(rubric, c.repeats, c.work.max_judge_calls_per_step)  # harden hook: WorkRefused names the bound
        # Precedence: start.policy, then the policy flags given (or not at their default), then the rubric's
        # thresholds, then the defaults. A start naming neither criteria nor policy (most) gets the same one:
        # resolved once (dataclasses.asdict per start was a third of a start's cost in a burst).
        if start.criteria is None and not start.policy:
            if self._default_policy is None:
                resolved = with_levels(c.policy, dict(rubric.thresholds), keep=c.policy_given)
                self._default_policy = (resolved, resolved.as_dict())
            policy, settings = self._default_policy
        else:
            policy = start.resolved_policy(with_levels(c.policy, dict(rubric.thresholds), keep=c.policy_given))
            settings = policy.as_dict()
        tracker = AsyncProgressTracker(
            start.task,
            judge=self.circuit,
            criteria=rubric,
            repeats=c.repeats,
            min_mass=c.min_mass,
            images=[i.decoded() for i in start.images],
            frame_budget=c.frame_budget,
            allow_files=False,  # network events never name local files
            expected=start.expected,
            run_id=run_id,
            # Every setting named: resolved above, so the tracker must not fill any from the rubric again.
            policy=settings,
            extract_budget_s=c.extract_budget_s,
            calibration=self.calibration,
            family=start.family,
            prices=self.prices,
        )
        return _Scoring(tracker, policy, dict(start.labels), group=start.group)

    def _open(self, run_id: str, start: RunStart, replaying: bool) -> None:
        scoring = self._prepared.pop(run_id, None) or self._new_scoring(run_id, start)
        self._scoring[run_id] = scoring
        if not replaying:
            self._emit(RunOpened(run_id, start, len(self.book.live)))
        if start.group is not None:
            try:
                update = self.groups.join(
                    run_id, start.group, scoring.policy, self.clock(), joiner_of(start, scoring)
                )  # harden hook: the group's first run is what later ones must match
            except GroupLimitError:
                # Checked before the start was journaled; a replay under lower limits runs it ungrouped.
                log.warning("group_refused_on_replay", run_id=run_id, group=start.group)
                scoring.group = None
                return
            scoring.tracker.on_group = partial(self._group_verdict, run_id)
            self._group_changed(start.group, update.changed and not replaying)

    def _group_verdict(self, run_id: str, p: Progress) -> Decision | None:
        """A grouped run's result through its group: the prune decision, if the group policy prunes it now."""
        update = self.groups.observe(run_id, p, self.clock())
        if update is None:
            return None
        group = self.groups.of_run[run_id]
        self._group_changed(group, update.changed)
        self._maybe_compare(group)
        if not update.prunes:
            return None
        return update.prunes[0].decision(p)

    def _maybe_compare(self, group: str) -> None:
        """With `policy.compare`: order the leaders pointwise scores cannot separate by a pivot tournament.

        Asked again only when the tied leaders or their steps changed since the last tournament, one
        tournament per group at a time (a change meanwhile asks once more after it). A failed tournament
        leaves the pointwise order (fail-open); pairwise verdicts order the ranking, they never prune.
        """
        g = self.groups.groups.get(group)
        if g is None or not g.policy.compare or self._stack is None:
            return  # (no tournaments once the monitor is leaving)
        tied = [r for r in g.tied_leaders() if r in self._scoring]
        if len(tied) < 2:
            self._compared.pop(group, None)
            return
        key = tuple((r, len(self._scoring[r].tracker.steps)) for r in sorted(tied))
        if self._compared.get(group) == key:
            return
        if group in self._comparing:
            self._compare_again.add(group)
            return
        self._compared[group] = key
        self._comparing[group] = asyncio.create_task(self._compare(group, tied), name=f"compare:{group}")

    async def _compare(self, group: str, tied: list[str]) -> None:
        try:
            trackers = {r: self._scoring[r].tracker for r in tied if r in self._scoring}
            first = trackers[tied[0]]

            async def pair(a: str, b: str) -> Comparison:
                c = await compare(
                    first.task,
                    list(trackers[a].steps),
                    list(trackers[b].steps),
                    judge=self.circuit,
                    criteria=first.rubric,
                    repeats=self.config.repeats,
                    min_mass=first.min_mass,
                )
                self.metrics.compare_calls.labels("ok" if c.ok else "failed").inc(c.calls)
                return c

            result = await tournament(list(trackers), pair)
            g = self.groups.groups.get(group)
            if g is not None:
                update = g.set_order(result.ranking if result.ok else ())
                self._group_changed(group, update.changed)
                log.info(
                    "group_compared", group=group, leaders=tied, winner=result.winner,
                    comparisons=result.comparisons, failed=result.failed,
                )  # fmt: skip
        except Exception:
            log.exception("group_compare_failed", group=group)  # the pointwise ranking stands
        finally:
            self._comparing.pop(group, None)
            if group in self._compare_again:
                self._compare_again.discard(group)
                self._maybe_compare(group)

    def _group_changed(self, group: str, publish: bool, *, republished: bool = False) -> None:
        """Refresh the group gauges; publish the group's ranking (retained) when asked."""
        series = self.groups.series_of(group)
        if series is None:
            self._group_series.pop(group, None)
        else:
            self._group_series[group] = series
        g = self.groups.groups.get(group)
        if publish and g is not None:
            self._emit(GroupRanked(group, g.ranking(), republished=republished))

    async def _append(self, run_id: str, steps: tuple[AcceptedStep, ...], replaying: bool) -> None:
        scoring = self._scoring.get(run_id)
        if scoring is None:
            return
        for s in steps:
            step = s.step
            try:
                await scoring.tracker.add(step.text, images=[im.decoded() for im in step.images], meta=step.meta)
            except Exception as e:
                # The images passed the sniff but not the decoder: keep the step's text, report the images.
                if not replaying:
                    self._emit(
                        Refused(
                            run_id,
                            "bad_image",
                            f"step {s.index}: an image could not be decoded ({e}); scored without",
                            self.topics.of(run_id, "step"),
                        )
                    )
                text = step.text or f"(step {s.index}: its images could not be decoded)"
                await scoring.tracker.add(text, meta=step.meta)
            scoring.arrived[s.index] = s.at
        if not replaying:
            self.scheduler.wake(run_id)

    async def _closed(self, effect: Closed, replaying: bool) -> None:
        run_id = effect.run_id
        scoring = self._scoring.pop(run_id, None)
        self.scheduler.discard(run_id)
        self._rate.forget(run_id)  # harden hook
        group = self.groups.of_run.get(run_id)
        update = self.groups.end(run_id, effect.outcome, effect.at)
        if group is not None and update is not None:
            self._group_changed(group, update.changed and not replaying)
        if effect.outcome == "evicted":
            # Derived from a start, not journaled by itself: the store learns the run is over here (with the
            # other evictions of a batch, after it).
            finished = Finished(run_id, effect.outcome, effect.at)
            if self._evicted is not None:
                self._evicted.append(finished)
            else:
                await self.store.journal(finished)
        elif replaying:
            return
        latest = scoring.tracker.latest if scoring else None
        self._emit(
            RunClosed(
                run_id,
                effect.outcome,
                len(scoring.tracker.steps) if scoring else 0,
                latest,
                scoring.last_ok if scoring else None,
                scoring.signal if scoring else "continue",
                scoring.labels if scoring else {},
                effect.at,
                len(self.book.live),
            )
        )

    async def _finish(self, run_id: str, outcome: str) -> None:
        async with self._lock:
            record = self.book.finish(run_id, outcome, self.clock())
            if record is not None:
                # Learnt before the run's end is journaled: the sample's write is queued first, so a crash in
                # between replays a run that teaches again, and the calibration keeps the sample once.
                self._teach(run_id)
                await self.store.journal(record)
                await self._apply(record)

    def _teach(self, run_id: str) -> None:
        """Teach the calibration a run that ended and is scored: its outcome and its curve (no outcome: nothing)."""
        state, scoring = self.book.live.get(run_id), self._scoring.get(run_id)
        if state is None or state.ended is None or scoring is None:
            return
        tracker = scoring.tracker
        # A run id may be used again for a new run once its run ended: the start time tells the two apart.
        key = f"{run_id}@{state.started_at!r}"
        secret = self.config.outcome_secret
        outcome = state.ended.outcome
        # harden hook: with --outcome-secret, an outcome teaches only when its end carries the run's HMAC.
        if (
            secret
            and outcome is not None
            and not outcome_authentic(secret, run_id, state.start.started_at, outcome, state.ended.auth)
        ):
            self.metrics.outcomes_refused.labels("unauthenticated").inc()
            log.warning("outcome_unauthenticated", run_id=run_id, hint="end.auth missing or wrong; it teaches nothing")
            return
        try:
            exposed = tracker.policy_state is not None and tracker.policy_state.exposed
            limited = self.calibration.rate_limited
            self.calibration.record(tracker.family, key, outcome, tracker.points, exposed=exposed)
            if self.calibration.rate_limited > limited:  # harden hook
                self.metrics.outcomes_refused.labels("rate").inc()
        except Exception:
            log.exception("calibration_failed", run_id=run_id)  # one run's evidence lost, never the daemon

    def _learned(self, sample: Sample) -> None:
        """A new calibration sample: store it, update its family's gauges."""
        self.store.record_sample(sample, self.calibration.max_samples, self.calibration.max_total)
        now = self._families.update(sample.family, sample.at)
        log.info(
            "calibration_sample",
            run_id=sample.run_id,
            family=sample.family.name,
            success=sample.success,
            successes=now.successes,
            threshold=now.threshold,
        )

    # -- scoring (the scheduler's callback) --

    async def _score(self, run_id: str) -> None:
        scoring = self._scoring.get(run_id)
        if scoring is None:
            return
        if scoring.wants_scoring:
            # harden hook: a run that spent its judge calls for the minute waits (its steps coalesce meanwhile).
            calls = calls_per_scoring(scoring.tracker.rubric, self.config.repeats)
            wait = self._rate.wait(run_id, calls)
            if wait > 0:
                self._rate.defer(run_id, wait)
                return
            self._rate.spend(run_id, calls)
            # While the judge is down, wait for its next probe instead of spending this run's steps on certain
            # failures; steps arriving meanwhile fold into the one scoring made when it is back.
            async with self.circuit.ready():
                n = len(scoring.tracker.steps)
                first = scoring.scored + 1
                try:
                    p: Progress | None = await scoring.tracker.score(n, coalesced=n - scoring.scored)
                except Exception as e:
                    # The tracker turns judge failures into results; anything else is a bug, reported, never a score.
                    log.exception("scoring_crashed", run_id=run_id, step=n)
                    where = self.topics.of(run_id, "step")
                    self._emit(Refused(run_id, "scoring_failed", f"scoring step {n} failed: {e}", where, invalid=False))
                    p = None
            scoring.scored = max(scoring.scored, n)
            self.scorings += 1
            if self._scoring.get(run_id) is not scoring:
                return  # the run moved to another replica meanwhile (cluster mode): its owner publishes, not this one
            if p is not None:
                self._scored(run_id, scoring, p, first)
        if scoring.closing is not None and not scoring.wants_scoring and self._scoring.get(run_id) is scoring:
            await self._finish(run_id, scoring.closing)

    def _scored(self, run_id: str, scoring: _Scoring, p: Progress, first: int) -> None:
        degraded = self.circuit.degraded
        if degraded:
            p = dataclasses.replace(p, degraded=True)
        if p.ok:
            scoring.last_ok = p
        arrived = tuple(t for i in range(first, p.step + 1) if (t := scoring.arrived.pop(i, None)) is not None)
        self._emit(Scored(run_id, p, p.to_json(), arrived, self.clock()))
        d = p.signal
        if d is not None and d.changed:
            scoring.signal = d.signal
            self._emit(SignalChanged(run_id, d, scoring.policy))
        if not p.ok and p.reason in OUTAGE_REASONS and degraded:
            # Scored again at the judge's next probe: woken now (it is in flight, so it goes to the back of the
            # queue when this scoring ends) and it waits in `circuit.ready()` until the probe is due.
            self._rewind(scoring)
            self.scheduler.wake(run_id)

    def _rewind(self, scoring: _Scoring) -> None:
        """Mark steps whose scoring was lost to an outage as unscored: the next scoring covers them again."""
        last_ok = scoring.tracker.summary.last_ok
        scoring.scored = last_ok.step if last_ok is not None else 0

    def _judge_state(self, degraded: bool) -> None:
        self.metrics.judge_degraded.set(1 if degraded else 0)
        if degraded:
            return
        for run_id, scoring in list(self._scoring.items()):
            latest = scoring.tracker.latest
            if latest is not None and not latest.ok and latest.reason in OUTAGE_REASONS:
                self._rewind(scoring)
                self.scheduler.wake(run_id)

    # -- publishing --

    def _emit(self, event: MonitorEvent) -> None:
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
                log.exception("sink_failed", sink=getattr(sink, "__qualname__", type(sink).__name__))

    def _series(self) -> list[RunSeries]:
        """What the per-run gauges show (called from the scrape thread: reads copies)."""
        live = dict(self.book.live)
        out = [
            series_of(rid, s.labels, s.tracker.latest, s.last_ok, s.signal, live[rid].last_event)
            for rid, s in list(self._scoring.items())
            if rid in live
        ]
        shown = {r.run_id for r in out}
        return out + [r for r in self._metrics_sink.finished() if r.run_id not in shown]

    # -- time --

    async def sweep(self) -> None:
        """Act on what time made due: steps with no start, gaps nobody fills, idle runs; forget old series."""
        async with self._lock:
            for record in self.book.due(self.clock()):
                await self.store.journal(record)
                await self._apply(record)
            for run_id in self._rate.due():  # harden hook: deferred scorings whose minute has room again
                self.scheduler.wake(run_id)
            for run_id, first in self.book.resends_due(self.clock()):  # harden hook: ask the harness to resend
                self.outbox.put(
                    Message(self.topics.of(run_id, "resend"), json.dumps({"from": first}).encode(), run_id=run_id)
                )
            cleared = self.groups.due(self.clock())
            for group in cleared:
                self._group_series.pop(group, None)
                self._emit(GroupRanked(group, None))  # an empty retained payload clears the ranking
        self._metrics_sink.prune()

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep_failed")  # e.g. the store cannot write: try again next time

    async def _retention(self, store: SqliteStore) -> None:
        """Delete ended runs older than the retention (hourly)."""
        while True:
            try:
                deleted = await store.prune(self.config.retention_s)
                if deleted:
                    log.info("runs_pruned", runs=deleted)
            except Exception:
                log.exception("prune_failed")
            await asyncio.sleep(3600)

    # -- restart --

    def _restore_groups(self, stored: Mapping[str, Mapping[str, Any]]) -> None:
        """Rebuild each group from its runs' restored scores, keep the prunes decided before, publish its ranking.

        The journal replay made the groups and their members (in start order); the runs' stored results fold
        in step by step across siblings (their order in time is not kept), counting streaks but deciding no
        prune: a prune is a decision taken live once and restored from the run's stored abort. Siblings that
        ended before the restart come from the group's last stored ranking; a group whose runs had all ended
        is published again and cleared after the grace period, as it would have been.
        """
        now = self.clock()
        for name, ranking in stored.items():
            if name not in self.groups.groups:
                if len(self.groups.groups) >= self.groups.max_groups:
                    break
                self.groups.groups[name] = GroupState(name, self.config.policy, max_runs=self.groups.max_group_runs)
                self.groups.done_at[name] = now
            g = self.groups.groups[name]
            for run in ranking.get("runs") or ():
                if isinstance(run, Mapping) and len(g.members) < self.groups.max_group_runs:
                    g.restore(run)
        for name, g in self.groups.groups.items():
            curves = {r: self._scoring[r].tracker.curve for r in g.members if r in self._scoring}
            depth = max((len(c) for c in curves.values()), default=0)
            for i in range(depth):
                for run_id, curve in curves.items():
                    if i < len(curve):
                        p = curve[i]
                        g.observe_progress(run_id, p, decide=False)
                        if p.signal is not None and p.signal.pruned:
                            g.prune(run_id)
            self._group_changed(name, True, republished=True)

    def _restore_scores(
        self, run_id: str, scoring: _Scoring, progress: Sequence[Mapping[str, Any]], *, republish: bool = True
    ) -> None:
        """Give a replayed run its stored scores; schedule what is left to score (or to finish); republish its signal."""
        stored = [Progress.from_json(dict(d)) for d in progress]
        results = [] if self.config.rescore else stored
        tracker = scoring.tracker
        # The tokens were spent whatever is kept of the scores: the totals go on from where they were.
        tracker.restore((r for r in results if r.step <= len(tracker.steps)), usage=run_totals(stored))
        scoring.last_ok = tracker.summary.last_ok
        scoring.scored = tracker.latest.step if tracker.latest else 0
        for i in range(1, scoring.scored + 1):
            scoring.arrived.pop(i, None)
        latest = tracker.latest
        if latest is not None and latest.signal is not None:
            scoring.signal = latest.signal.signal
            if tracker.summary.signal_changes and republish:
                self._emit(SignalChanged(run_id, latest.signal, scoring.policy, republished=True))
        if scoring.wants_scoring or scoring.closing is not None:
            self.scheduler.wake(run_id)

    # -- cluster mode: runs arrive and leave while the monitor runs --

    async def adopt(
        self,
        run_id: str,
        records: Sequence[Record],
        progress: Sequence[Mapping[str, Any]],
        *,
        signal_sent: int | None = None,
    ) -> None:
        """Take over one run from its shared journal: replay its records, take its stored scores, score what is left.

        Cluster mode: this replica became the run's owner (a failover, or the run was moved here). As on a
        restart, nothing is judged again that was scored. The run's signal is published again only when the
        previous owner may not have got it out: `signal_sent` is the step of the last signal the broker
        acknowledged, and a harness sees each abort once.
        """
        async with self._lock:
            self._forget(run_id)
            for record in records:
                await self._apply(record, replaying=True)
            scoring = self._scoring.get(run_id)
            if scoring is not None:
                changes = [d["step"] for d in progress if (d.get("decision") or {}).get("changed")]
                lost = bool(changes) and changes[-1] != signal_sent
                self._restore_scores(run_id, scoring, progress, republish=lost)
                if scoring.group is not None:
                    self._group_changed(scoring.group, False)
            self.metrics.runs_active.set(len(self.book.live))

    async def release(self, run_id: str) -> None:
        """Forget one run without ending it (cluster mode: another replica owns it now); nothing is published."""
        async with self._lock:
            self._forget(run_id)
            self.metrics.runs_active.set(len(self.book.live))

    def _forget(self, run_id: str) -> None:
        self.book.forget(run_id)
        self._scoring.pop(run_id, None)
        self._prepared.pop(run_id, None)
        self.scheduler.discard(run_id)
        group = self.groups.forget(run_id)
        if group is not None and group not in self.groups.groups:
            self._group_series.pop(group, None)

    async def _restore(self) -> int:
        """Rebuild the live runs by replaying the journal; take their stored scores; return the runs live.

        Nothing is published or judged while replaying; afterwards each run's unscored steps (only those)
        are scheduled, a run that had ended but not finished scoring finishes, and each run's current
        signal is published again (it may have been decided but not yet published before the crash).
        With `rescore`, stored scores are ignored and each run's newest prefix is scored afresh.
        """
        # Samples first: the runs replayed below are scored against the calibration they had before.
        for sample in await self.store.samples():
            self.calibration.add(sample)
        for f in self.calibration.families():
            self._families.update(f.family, f.last_at)
        replay = await self.store.replay()
        self.book.remember_ended(replay.ended)
        self.book.remember_deliveries(replay.deliveries)
        async with self._lock:
            for record in replay.records:
                await self._apply(record, replaying=True)
        for run_id, scoring in self._scoring.items():
            self._restore_scores(run_id, scoring, replay.progress.get(run_id, ()))
        self._restore_groups(await self.store.rankings())
        self.metrics.runs_active.set(len(self.book.live))
        self.restored = tuple(self.book.live)
        return len(self.book.live)
