"""The monitor daemon: the composition root that wires sources, runs and sinks and owns the one
TaskGroup.

A message's path: a source (the MQTT link, or another front door) hands it, with every message
that arrived meanwhile, to the ingest (`_ingest`: decode, decide, journal in one group commit,
apply once committed); the link acknowledges each message only after that. Steps now in order go
to the scoring part (`_scoring`: the run's tracker, the scheduler); a scorer scores the run's
newest prefix and hands the result to the sinks (MQTT, store, metrics, log). Groups (`_groups`)
rank sibling runs; a restart replays the journal through the same `apply` (`_restore`). How the
monitor is deployed (one monitor, or a replica of a cluster) is one object, its mode (`_mode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Self, cast

import structlog
from prometheus_client import CollectorRegistry

from ..calibration import Calibration, Caller, CallerStatistics
from ..criteria import CriteriaError, Rubric, load_criteria
from ..judges.base import Judge, require_summariser
from ..judges.circuit import CircuitJudge
from ..templates import TemplateError, load_template
from ..tracker import AsyncProgressTracker
from ..wire import Topics
from ._config import MonitorConfig
from ._events import Fanout, Sink
from ._mode import Mode, Standalone, mode_of
from .http import HttpServer, board_port
from .runs import (
    GroupBook,
    Groups,
    LiveRuns,
    Replays,
    Restore,
    RunBook,
    RunView,
    RunWriter,
    Scoring,
    ScoringStatistics,
    StepView,
    run_series,
)
from .sinks import (
    STORE_GAUGES,
    Board,
    BoardSite,
    CalibrationCollector,
    CostCollector,
    FlowCollector,
    GroupCollector,
    LogSink,
    Message,
    Metrics,
    MetricsSink,
    MqttSink,
    Outbox,
    PhoenixSink,
    PhoenixStatistics,
    RunCollector,
    RunPages,
    StatisticsCollector,
    StoreSink,
)
from .sources import MqttLink, Source, SourceInput, statistics_json
from .sources.otlp import OtlpReceiver
from .sources.reward import RewardSource
from .stores import Delivery, NoStore, Record, RunStore

if TYPE_CHECKING:
    from .cluster import Cluster
    from .http import HttpServerStatistics
    from .sinks import OtelSink
    from .sources.proxy import ProxySource

Spans = Callable[[str, int], tuple[str, str] | None]
"""Which span (trace id, span id) a run's step is, for runs fed by traces."""

__all__ = ["Monitor", "RunView", "StepView"]

log = structlog.get_logger("agent_monitor.daemon")

_EMPTIED_UNHEALTHY_S = 600.0
_MAX_SIGNED_JOINS = 50_000
"""Signed group joins remembered (with --group-secret): past it the oldest becomes the freshness
floor."""
"""How long /healthz says unhealthy after the cluster's Redis came back empty (the runs it lost do
not come back; the warning stays in the log and in agent_monitor_cluster_redis_emptied_total)."""

# How long leaving the monitor waits for queued OpenTelemetry events to reach the collector.
_OTLP_CLOSE_S = 5.0


@dataclass(frozen=True, slots=True)
class MonitorStatistics:
    """One pull for everything the monitor's parts count: its `status()` and each part's record."""

    status: Mapping[str, Any]
    """The `status()` snapshot (what /healthz shows)."""
    scoring: ScoringStatistics
    uniform: CallerStatistics | None
    """The early group calls' evidence sets (None when no group makes them)."""
    http: HttpServerStatistics | None
    """The HTTP server's (None without one)."""
    phoenix: PhoenixStatistics | None
    """The Phoenix sink's (None without one)."""


class Monitor:
    """Follow every run published under the topic prefix, score each new prefix, publish progress
    and signals.

    ```python
    config = MonitorConfig(broker=BrokerSettings.from_url("mqtt://127.0.0.1:1883"))
    async with Monitor(config, judge=judge, store=SqliteStore(path)) as monitor:
        await monitor.wait()  # serve until cancelled
    ```
    The config names the doors besides MQTT (`otlp_receiver`, `reward_api`, `proxy`) and the metrics
    port (`/metrics`, `/healthz`, the board): entering binds their ports (OSError naming the
    setting), rebuilds the live runs from the store, connects to the broker (`BrokerUnavailable`
    with a one-line reason) and starts the named tasks `mqtt`, `source-{name}` per door,
    `scorer-1..N`, `sweeper` (`http` with a metrics port or `http=`, `phoenix` with
    `config.phoenix.url`); leaving cancels and awaits them all. Without a broker nothing is
    received: feed events with `handle()`. Without a store nothing is journaled; `SqliteStore`
    survives restarts, `MemoryStore` keeps the journal in this process. `sinks` get every
    `MonitorEvent` after the monitor's own (MQTT, store, metrics, log). With `config.cluster.url`
    the monitor is one replica of a cluster (docs/cluster.md; tasks `cluster-*` beside the others);
    with `config.otlp_endpoint`, `otel` sends every score's `gen_ai.evaluation.result` events.
    `calibration` holds what ended runs taught (kept in the store): the evidence `abort_below:
    "auto"` thresholds come from.
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
        http: HttpServer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        c = self.config = config if config is not None else MonitorConfig()
        self.clock = clock
        self.criteria, self.template = _operator_rubric(c)
        """The rubric of runs whose start names none; the operator's prompt template (serve
        --prompt), "" = ours."""
        require_summariser(
            judge, c.digest
        )  # --digest judge|MODEL: a judge that cannot summarise fails now
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = m = Metrics(self.registry)
        # The circuit breaker counts the calls that reach the judge (not those it refuses while the
        # judge is down) and reports a hanging judge degraded after two of its timeouts of silence.
        self.circuit = CircuitJudge(
            judge,
            threshold=c.circuit_threshold,
            cooldown_s=c.circuit_cooldown_s,
            on_change=self._judge_state,
        )
        self.topics = Topics(c.prefix)
        fenced = m.cluster_fenced.labels("publish").inc
        self.outbox = Outbox(c.outbox_size, on_dropped=m.outbox_dropped.inc, on_fenced=fenced)
        m.outbox_depth.set_function(self.outbox.__len__)  # read at scrape time
        self._restore: Restore  # built below, once the parts it drives are
        learned = lambda sample: self._restore.learned(sample)  # noqa: E731
        self.calibration = Calibration(
            success_at=c.calibration_success_at,
            on_sample=learned,
            clock=clock,
            # length strata, per-family teaching rate
            strata=c.calibration_strata,
            max_rate=c.calibration_rate,
        )
        self._families = CalibrationCollector(
            self.calibration,
            c.policy,
            allow=c.metrics.families,
            max_families=c.metrics.max_families,
        )
        self.mode = mode_of(
            c, store, metrics=m, outbox=self.outbox, on_sample=lambda s: self._restore.shared(s)
        )
        """One monitor, or (`config.cluster.url`) a replica of a cluster: its store, gate, client
        id and loops."""
        self.outbox.gate = self.mode.gate
        self.store: RunStore = self.mode.store
        self._metrics_sink = MetricsSink(
            m, grace_s=c.metrics.grace_s, memory=c.limits.ended_memory, clock=clock
        )
        self._doors = d = _doors(
            c, judge, self.registry, self.store, self.calibration, self.health, http, sources
        )
        self.board, self.http, self.sources = d.board, d.http, d.sources
        """The board, the metrics port's server (task `http`) and the doors beside MQTT
        (`source-{name}` each)."""
        # a trace-fed run's events and annotations name its span (the receiver's)
        spans = _spans(self.sources)
        self.otel = _otel_sink(
            c.otlp_endpoint, self.registry, lambda r: self._scoring.criteria_of(r), spans
        )
        """The OpenTelemetry sink, with `config.otlp_endpoint` (opened on entering, flushed on
        leaving)."""
        self.phoenix = (
            PhoenixSink(c.phoenix, registry=self.registry, spans=spans) if c.phoenix.url else None
        )
        """The Arize Phoenix sink, with `config.phoenix.url`: its task `phoenix` sends, leaving
        flushes it, bounded."""
        mqtt = MqttSink(
            self.outbox,
            self.topics,
            on_signal_sent=self.mode.signal_sent,
            on_progress_sent=self.mode.progress_sent,
            compact=c.progress_form == "compact",
        )
        # no store: no scores kept
        kept = () if isinstance(self.store, NoStore) else (StoreSink(self.store),)
        own = (
            mqtt,
            *kept,
            self._metrics_sink,
            LogSink(log),
            *(s for s in (self.otel, self.phoenix) if s is not None),
        )
        doors = (
            *(s for s in (self.board,) if s is not None),
            *(s.sink for s in self.sources if s.sink is not None),
        )
        self.sinks = (*own, *sinks, *doors)
        self._emit = Fanout(self.sinks, log)  # every part's events go to these sinks, in this order
        self.book = RunBook(c.limits, self.topics)
        m.runs_active.set_function(self.book.live.__len__)  # read at scrape time
        lim = c.limits
        self.groups = GroupBook(
            max_groups=lim.max_groups,
            max_group_runs=lim.max_group_runs,
            grace_s=lim.group_grace_s,
            # who may join, on what terms
            secret=c.group_secret,
            policy=c.policy if c.group_policy_fixed else None,
            replays=Replays(c.signature_max_age_s, _MAX_SIGNED_JOINS, clock=clock)
            if c.group_secret
            else None,
        )
        """Sibling runs (`start.group`) ranked together; their rankings are retained on
        `{prefix}/_groups/{group}/ranking`."""
        self._groups = Groups(
            self.groups,
            emit=self._emit,
            trackers=self.tracker,
            judge=self.circuit,
            repeats=c.repeats,
            clock=clock,
            on_compared=lambda ok, calls: m.compare_calls.labels("ok" if ok else "failed").inc(
                calls
            ),
            on_majority=m.compare_calls_saved.inc,
            caller=Caller(self.calibration),
            on_uniform=lambda call, what: m.groups_uniform.labels(call, what).inc(),
            on_placed=lambda reason: (
                m.groups_refused if reason == "group_refused" else m.groups_split
            ).inc(),
        )
        self._comparing = self._groups.comparing
        self._scoring = Scoring(
            c,
            criteria=self.criteria,
            template=self.template,
            book=self.book,
            circuit=self.circuit,
            calibration=self.calibration,
            groups=self._groups,
            topics=self.topics,
            emit=self._emit,
            clock=clock,
            on_depth=m.queue_depth.set,
            on_outcome_refused=lambda reason: m.outcomes_refused.labels(reason).inc(),
        )
        self.scheduler = self._scoring.scheduler
        # Off by default: a network event must not make the monitor read local files or fetch URLs.
        self.image_dirs = tuple(str(Path(d).resolve()) for d in c.image_dirs)
        self._intake = RunWriter(
            c,
            book=self.book,
            store=self.store,
            groups=self.groups,
            topics=self.topics,
            image_dirs=self.image_dirs,
            emit=self._emit,
            clock=clock,
            act=self._scoring.act,
            prepare=self._scoring.prepare,
            unprepare=lambda run_id: self._scoring.prepared.pop(run_id, None),
            on_retained=lambda kind: m.retained_inputs.labels(kind).inc(),
        )
        self._scoring.finish = lambda run_id, outcome: self._intake.finish(
            run_id, outcome, self._scoring.teach
        )
        self._scoring.finish_many = lambda ends: self._intake.finish_many(ends, self._scoring.teach)
        self._restore = Restore(
            store=self.store,
            intake=self._intake,
            scoring=self._scoring,
            groups=self._groups,
            calibration=self.calibration,
            policy=c.policy,
            on_family=self._families.update,
        )
        series = partial(
            run_series, self.book.live, self._scoring.runs, self._metrics_sink.finished
        )
        collectors = [
            RunCollector(series, label_names=c.metrics.labels, max_series=c.metrics.max_series),
            FlowCollector(
                judge.name, intake=self._intake, scoring=self._scoring, circuit=self.circuit
            ),
            *((CostCollector(self.circuit, c.prices),) if c.prices is not None else ()),
            GroupCollector(
                self._groups.gauges, allow=c.metrics.groups, max_groups=c.metrics.max_group_series
            ),
            self._families,
            StatisticsCollector(self.store, STORE_GAUGES, prefix="agent_monitor_store_"),
        ]
        for collector in collectors:  # read at scrape time
            self.registry.register(collector)
        self.link = _link(c, self.topics, self.mode, m) if c.broker is not None else None
        if self.link is not None:
            # a retained input is a stored copy: ignored, told once
            self.link.on_retained = self._intake.retained
            # a run's scoring waits while its last score is still to be published
            self._scoring.unpublished = self.outbox.pending
            self.outbox.on_run_out = self._scoring.published
        self.restored: tuple[str, ...] = ()
        """The live runs rebuilt from the store on entering, least recently active first."""
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()

    # -- lifecycle --

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("the monitor is already running")
        stack = contextlib.AsyncExitStack()
        try:
            # First: a port the config names that is taken fails the start-up at once, in one line.
            await _open_doors(stack, self.config, self._doors)
            wait, began = self.config.broker_wait, time.monotonic()
            if self.link is not None and wait > 0:
                # A broker restarting with the monitor (a host restart, a cluster and its broker
                # together): waited for before joining, so a replica never counts as live while it
                # cannot receive.
                await self.link.wait_reachable(wait)
            # Joined before the broker is: a replica assigns the runs it receives to live replicas,
            # itself included.
            await self.mode.open(self, self.link)
            stack.push_async_callback(self.mode.aclose)
            # Rebuilt before connecting: steps the broker redelivers then meet the runs they belong
            # to.
            self.restored = await self._restore.restore()
            if self.restored:
                log.info("runs_restored", runs=len(self.restored), run_ids=list(self.restored[:20]))
            if self.board is not None:
                self.board.restore((self.run(r) for r in self.restored), live=len(self.book.live))
            left = max(0.0, wait - (time.monotonic() - began))
            first = await self.link.connect_within(left) if self.link is not None else None
            # before the scorers start; closed after they stopped
            _open_sinks(stack, self.otel, self.phoenix)
            tg = await stack.enter_async_context(asyncio.TaskGroup())
            receive = self.mode.receiver(self._intake.handle_batch)  # (no hop through handle_batch)
            loops = (
                [("mqtt", self.link.run(receive, self.outbox, first=first))]
                if self.link is not None
                else []
            )
            loops += self.mode.loops()
            # Every door hands its events to the same receive as MQTT: in cluster mode the runs'
            # shared inboxes.
            ingest, runs = (
                SourceInput(receive, self.topics),
                LiveRuns(self._scoring.runs, self.groups.uniform_of),
            )
            loops += [(f"source-{src.name}", src.run(ingest, runs)) for src in self.sources]
            loops += [
                (f"scorer-{i + 1}", self.scheduler.worker())
                for i in range(self.config.max_concurrency)
            ]
            loops += [("finisher", self._scoring.finisher()), ("sweeper", self._sweeper())]
            loops += [("http", self.http.serve())] if self.http is not None else []
            loops += [("phoenix", self.phoenix.run())] if self.phoenix is not None else []
            self._tasks = [tg.create_task(loop, name=name) for name, loop in loops]
            self._groups.tasks = tg
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
        if self._stack is not None:
            # Before the loops stop (a replica stops receiving, hands its runs to the others,
            # deregisters).
            await self.mode.leave()
        self._groups.tasks = None  # no tournaments once the monitor is leaving
        stack, tasks = self._stack, [*self._tasks, *self._comparing.values()]
        self._stack, self._tasks = None, []
        await _cancel(tasks)
        if stack is not None:
            # The loops run forever, so they end only by cancellation; the TaskGroup awaits each
            # one.
            with contextlib.suppress(asyncio.CancelledError):
                await stack.aclose()
        self._stopped.set()
        log.info("monitor_stopped", scorings=self.scorings, live_runs=len(self.book.live))

    async def wait(self) -> None:
        """Serve until the surrounding task is cancelled (or the monitor is left)."""
        await self._stopped.wait()

    async def drain(self) -> None:
        """Wait until every step received so far is scored (tests, shutdown; bound it with
        asyncio.timeout)."""
        await self.scheduler.drain()
        # runs whose last score is being published: scored once it is out
        while self._scoring.holding():
            await asyncio.sleep(0.005)
            await self.scheduler.drain()
        await self._scoring.ended()

    @property
    def cluster(self) -> Cluster | None:
        """Cluster mode's replica (its membership, leases and shared journal in Redis), else
        None."""
        return None if isinstance(self.mode, Standalone) else cast("Cluster", self.mode)

    @property
    def scorings(self) -> int:
        """Scorings made since the monitor was built."""
        return self._scoring.scorings

    def status(self) -> dict[str, Any]:
        """A snapshot for logs and health checks."""
        sources = {src.name: statistics_json(src.statistics()) for src in self.sources}
        return {
            "live_runs": len(self.book.live),
            "queued": len(self.outbox),
            "scorings": self.scorings,
            "degraded": self.circuit.degraded,
            "judge_rate": dataclasses.asdict(self._scoring.rate.statistics()),
            "connected": bool(self.link and self.link.connected.is_set()),
            **self.mode.status(),
            **({"sources": sources} if sources else {}),
        }

    def statistics(self) -> MonitorStatistics:
        """`status()` and every part's record (scoring, the early group calls, the HTTP server,
        Phoenix)."""
        caller = self._groups.caller
        return MonitorStatistics(
            status=self.status(),
            scoring=self._scoring.statistics(),
            uniform=caller.statistics() if caller is not None else None,
            http=self.http.statistics() if self.http is not None else None,
            phoenix=self.phoenix.statistics() if self.phoenix is not None else None,
        )

    def health(self) -> tuple[bool, dict[str, Any]]:
        """What /healthz answers: unhealthy (503) while the monitor cannot do its job, with each
        problem named."""
        return health_of(self.status(), broker=self.config.broker is not None)

    def run(self, run_id: str) -> RunView | None:
        """A copy of a live run's state and scores, or None when the run is not live."""
        state, s = self.book.live.get(run_id), self._scoring.runs.get(run_id)
        return RunView.of(run_id, state, s) if state is not None and s is not None else None

    def tracker(self, run_id: str) -> AsyncProgressTracker | None:
        """The tracker scoring a live run (its steps, curve and policy state), or None."""
        return self._scoring.tracker(run_id)

    def is_live(self, run_id: str) -> bool:
        """Whether the run is live here or holds steps waiting for their start."""
        return run_id in self.book.live or run_id in self.book.orphans

    # -- input --

    async def handle(self, topic: str, payload: bytes, delivery: Delivery | None = None) -> None:
        """Decode one message, journal what it means, fold it into its run; bad input is reported,
        never raised.

        Raises only when the run store cannot write: the message is then not acknowledged, and the
        broker delivers it again. The monitor's own outputs (progress, signal, error, `_errors`),
        which its subscription `{prefix}/+/+` also matches, are ignored: acknowledged, not reported.
        """
        (error,) = await self.handle_batch([(topic, payload, delivery)])
        if error is not None:
            raise error

    async def handle_batch(
        self, messages: Sequence[tuple[str, bytes, Delivery | None]]
    ) -> list[BaseException | None]:
        """Handle messages in arrival order, journaling what they mean in group commits; per
        message, None or why not.

        None means handled (accepted, refused or ignored) and safe to acknowledge; an error means
        the record did not commit and the message must be delivered again (see
        `RunWriter.handle_batch`).
        """
        return await self._intake.handle_batch(messages)

    async def adopt(
        self,
        run_id: str,
        records: Sequence[Record],
        progress: Sequence[Mapping[str, Any]],
        **sent: int | None,
    ) -> None:
        """Take over one run from its shared journal (cluster mode: this replica became its owner).

        `sent`: `signal_sent` and `progress_sent`, the steps of the run's last signal and progress
        out.
        """
        await self._restore.adopt(run_id, records, progress, **sent)

    async def release(self, run_id: str) -> None:
        """Forget one run without ending it (cluster mode: another replica owns it now); nothing
        is published."""
        await self._restore.release(run_id)

    # -- what the parts report --

    def _judge_state(self, degraded: bool) -> None:
        self.metrics.judge_degraded.set(1 if degraded else 0)
        if not degraded:
            self._scoring.judge_back()

    # -- time --

    async def sweep(self) -> None:
        """Act on what time made due: steps with no start, gaps nobody fills, idle runs; forget
        old series."""
        await self._intake.sweep()
        self._scoring.due()  # deferred scorings whose minute has room again
        # a gap open half its --hold: ask for a resend
        for run_id, first in self.book.resends_due(self.clock()):
            payload = json.dumps({"from": first}).encode()
            self.outbox.put(Message(self.topics.of(run_id, "resend"), payload, run_id=run_id))
        self._groups.due(self.clock())
        self._metrics_sink.prune()

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep_failed")  # e.g. the store cannot write: try again next time


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel tasks and wait until each one ended."""
    for task in tasks:
        task.cancel()
    pending = {t for t in tasks if not t.done()}
    while pending:
        # On Python 3.11, asyncio.wait_for (inside aiomqtt's publish, and the circuit's wait) can
        # swallow a cancel that lands as its inner future completes; a loop that goes on is
        # cancelled again.
        _, pending = await asyncio.wait(pending, timeout=0.5)
        for task in pending:
            task.cancel()


def _operator_rubric(c: MonitorConfig) -> tuple[Rubric, str]:
    """The default rubric and the operator's prompt template, read once: a bad name or file fails
    the start-up.

    The operator's files, never an event's.
    """
    try:
        rubric = load_criteria(c.criteria)
    except CriteriaError as e:
        raise CriteriaError(f"default criteria {c.criteria!r} (serve --criteria): {e}") from None
    if c.prompt is None:
        return rubric, ""
    try:
        t = load_template(Path(c.prompt))
        t.check_for("progress")
    except TemplateError as e:
        raise TemplateError(f"serve --prompt: {e}") from None
    return dataclasses.replace(rubric, template=t.text), t.text


def health_of(status: Mapping[str, Any], *, broker: bool) -> tuple[bool, dict[str, Any]]:
    """Healthy or not from a monitor's `status()`, each problem named (what /healthz answers, 200
    or 503)."""
    problems = []
    if broker and not status["connected"]:
        problems.append(
            "not connected to the MQTT broker: inputs wait there, nothing is scored or published"
        )
    if (
        emptied := status.get("redis_emptied_at")
    ) is not None and time.time() - emptied < _EMPTIED_UNHEALTHY_S:
        problems.append(
            "the cluster's Redis came back without the cluster's data: the live runs' "
            "journals were lost "
            "(run Redis with appendonly yes; docs/cluster.md)"
        )
    warnings = (
        ["the judge is failing: scorings wait for its next probe"] if status["degraded"] else []
    )
    return not problems, {
        "status": "unhealthy" if problems else "ok",
        "problems": problems,
        "warnings": warnings,
        **status,
    }


def _otel_sink(
    endpoint: str | None,
    registry: CollectorRegistry,
    criteria: Callable[[str], Sequence[str]],
    spans: Spans | None,
) -> OtelSink | None:
    """The OpenTelemetry sink, with an endpoint; imported here: without one no OpenTelemetry
    package is loaded."""
    if endpoint is None:
        return None
    from .sinks import OtelSink  # ImportError names the extra

    return OtelSink(endpoint, registry=registry, criteria=criteria, spans=spans)


def _open_sinks(
    stack: contextlib.AsyncExitStack, otel: OtelSink | None, phoenix: PhoenixSink | None
) -> None:
    """Open the sinks that send elsewhere and push their bounded flush onto `stack` (run once the
    scorers stopped)."""
    if otel is not None:
        otel.open()  # its first events come with the scorers' first scores
        # blocks: off the loop
        stack.push_async_callback(asyncio.to_thread, otel.close, _OTLP_CLOSE_S)
    if phoenix is not None:
        stack.push_async_callback(phoenix.close, _OTLP_CLOSE_S)  # what is still queued gets one try


def _spans(sources: Sequence[Source]) -> Spans | None:
    """Which span a trace-fed run's step is: the first source that knows (the OTLP receiver's
    `span_of`)."""
    return next((f for src in sources if callable(f := getattr(src, "span_of", None))), None)


class _Doors(NamedTuple):
    """What the config names beside the MQTT link: the board, the metrics port's server and the
    doors."""

    board: Board | None
    http: HttpServer | None
    sources: tuple[Source, ...]
    receiver: OtlpReceiver | None
    proxy: ProxySource | None


def _doors(
    c: MonitorConfig,
    judge: Judge,
    registry: CollectorRegistry,
    store: RunStore,
    calibration: Calibration,
    health: Callable[[], tuple[bool, dict[str, Any]]],
    http: HttpServer | None,
    sources: Sequence[Source],
) -> _Doors:
    """Build the doors the config names, each given its routes and what it reads (none is patched on
    later).

    `config.metrics_port`: the server of /metrics, /healthz and (unless `board.no_board`) the board
    and the run pages; a caller's own `http` is served as given. `otlp_receiver.address`,
    `reward_api.reward_api` (its routes on that server; calibrated rewards read `calibration`) and
    `proxy.upstream` open the other doors, before the caller's `sources`. ImportError names a
    missing extra; ValueError a door without what it needs.
    """
    board = None
    if http is None and c.metrics_port:
        board = None if c.board.no_board else Board(c.board, registry=registry)
        http = _http_server(
            c, registry, board, RunPages(store, board) if board is not None else None, health
        )
    elif http is not None:
        http.health = health  # a server the caller built: its /healthz answers for this monitor
    receiver = (
        OtlpReceiver(c.otlp_receiver, registry=registry)
        if c.otlp_receiver.address is not None
        else None
    )
    if receiver is not None:
        receiver.check_installed()
    reward = None
    if c.reward_api.reward_api:
        if http is None:
            raise ValueError(
                "--reward-api serves the reward endpoints on the metrics port: "
                "pass --metrics-port N"
            )
        reward = RewardSource(http, c.reward_api, registry=registry, calibration=calibration)
    proxy = None
    if c.proxy.upstream is not None:
        from .sources.proxy import ProxySource  # ImportError names the extra (h11, httpx2)

        proxy = ProxySource(c.proxy, judge=judge, criteria=c.criteria, registry=registry)
    doors = (*(d for d in (receiver, reward, proxy) if d is not None), *sources)
    if len(names := [d.name for d in doors]) != len(set(names)):
        raise ValueError(f"sources need distinct names, got {names}")
    return _Doors(board, http, doors, receiver, proxy)


def _http_server(
    c: MonitorConfig,
    registry: CollectorRegistry,
    board: Board | None,
    pages: RunPages | None,
    health: Callable[[], tuple[bool, dict[str, Any]]],
) -> HttpServer:
    """The metrics port's server, with every route it answers itself (the one place it is built)."""
    site = BoardSite(board, pages) if board is not None else None
    return HttpServer(
        registry,
        host=c.metrics_host,
        port=c.metrics_port,
        settings=board_port(c.reward_api),
        site=site,
        health=health,
    )


async def _open_doors(stack: contextlib.AsyncExitStack, c: MonitorConfig, doors: _Doors) -> None:
    """Bind each door's port (closed by `stack`), served later by its task; OSError names the
    setting to change."""
    if doors.receiver is not None:
        try:
            await doors.receiver.open()
        except OSError as e:
            raise OSError(
                f"cannot receive OTLP traces on {c.otlp_receiver.address}: {e}; "
                "pass --otlp-receiver"
            ) from e
        stack.push_async_callback(doors.receiver.http.close)
    if doors.proxy is not None:
        try:
            await stack.enter_async_context(doors.proxy)
        except OSError as e:
            raise OSError(f"the proxy cannot listen on {c.proxy.listen}: {e}; pass --listen") from e
    if doors.http is not None:
        try:
            await doors.http.bind()
        except OSError as e:
            raise OSError(
                f"cannot serve /metrics on {c.metrics_host}:{c.metrics_port}: {e}; pass "
                "--metrics-port"
            ) from e
        stack.push_async_callback(doors.http.aclose)
        log.info(
            "metrics_serving",
            url=f"{doors.http.url}metrics",
            board=doors.http.url if doors.board else None,
        )


def _link(c: MonitorConfig, topics: Topics, mode: Mode, m: Metrics) -> MqttLink:
    """The monitor's MQTT link: its client id and shared subscription are the mode's (a replica's
    are its own)."""
    assert c.broker is not None
    return MqttLink(
        c.broker,
        topics=topics,
        client_id=mode.client_id(c.client_id),
        share=mode.share,
        protocol=c.protocol,
        session_expiry_s=c.session_expiry_s,
        receive_window=c.receive_window,
        metrics=m,
    )
