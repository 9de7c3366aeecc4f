"""Prometheus metrics, always on a registry the caller passes in (no global registry), and the
sink that counts."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ...calibration import Calibration, Family, min_successes
from ...judges.circuit import CircuitJudgeStatistics
from ...policy import FAR, Policy
from ...progress import FAILURES, REFUSALS, SIGNALS, Prices, Usage
from ...wire import INPUT_KINDS
from .._events import (
    Duplicated,
    MonitorEvent,
    Refused,
    RunClosed,
    RunOpened,
    SignalChanged,
    Skipped,
)
from ..runs import (
    TOKEN_BUCKETS,
    FamilySeries,
    GroupSeries,
    RunSeries,
    RunWriterStatistics,
    ScoringStatistics,
    series_of,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RUN_OUTCOMES = ("success", "failure", "scored", "unknown", "expired", "evicted", "rejected")
TOKEN_KINDS = ("input", "cached_input", "output")
CLUSTER_OPS = ("heartbeat", "receive", "notes", "take", "feed", "journal", "progress")
"""The Redis operations cluster mode counts failures of (agent_monitor_cluster_errors_total{op})."""


class Metrics:
    """The monitor's metrics on one registry; trackers and the daemon that are given it count into
    it.

    Labelled counters are created for every known label value so their series exist at 0 before the
    first event.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        Info("agent_monitor_build", "The monitor's version.", registry=registry).info(
            {"version": _version()}
        )
        self.judge_degraded = Gauge(
            "agent_monitor_judge_degraded",
            "1 while the judge's circuit breaker is open (the judge keeps failing; scoring "
            "waits, never aborts).",
            registry=registry,
        )
        self.invalid_events = Counter(
            "agent_monitor_invalid_events",
            "Input events refused, by reason.",
            ["reason"],
            registry=registry,
        )
        self.duplicate_steps = Counter(
            "agent_monitor_duplicate_steps",
            "Steps ignored because a step with their index was already received (MQTT "
            "re-delivery).",
            registry=registry,
        )
        self.runs_active = Gauge(
            "agent_monitor_runs_active", "Runs being followed now.", registry=registry
        )
        self.runs = Counter(
            "agent_monitor_runs",
            "Runs that ended, expired or were evicted, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.signals = Counter(
            "agent_monitor_signals",
            "Signal changes published, by signal.",
            ["signal"],
            registry=registry,
        )
        self.pruned = Counter(
            "agent_monitor_pruned",
            "Runs pruned by the group policy (aborted with pruned: true: behind their siblings).",
            registry=registry,
        )
        self.compare_calls = Counter(
            "agent_monitor_compare_calls",
            "Pairwise judge comparisons made to rank group leaders pointwise scores could "
            "not separate "
            "(policy compare: true), by result.",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("ok", "failed"):
            self.compare_calls.labels(outcome)
        self.compare_calls_saved = Counter(
            "agent_monitor_compare_calls_saved",
            "Pairwise judge calls not made because most tied group leaders gave the same "
            "answer (the majority "
            "shortcut ordered them): the most the skipped tournament could have made.",
            registry=registry,
        )
        self.groups_uniform = Counter(
            "agent_monitor_groups_uniform",
            "Groups flagged early as all_fail or all_pass (no outcome variance: an RL "
            "trainer may cancel them), "
            "by call and event: flagged; withdrawn (a run joined, or a call lost its "
            "confidence); contradicted "
            "(an outcome proved the call wrong: a wrong early call).",
            ["call", "event"],
            registry=registry,
        )
        for call in ("all_fail", "all_pass"):
            for event in ("flagged", "withdrawn", "contradicted"):
                self.groups_uniform.labels(call, event)
        self.groups_refused = Counter(
            "agent_monitor_groups_refused",
            "Starts that named a group they may not join (the group was full, the monitor "
            "had --max-groups groups, "
            "no valid start.auth where groups are signed, other settings than "
            "--group-policy-fixed's): each scored as "
            "a run of its own, in no group.",
            registry=registry,
        )
        self.groups_split = Counter(
            "agent_monitor_groups_split",
            "Starts ranked in a group split off the one they named ({group}~{key}), because "
            "runs of another task, "
            "rubric or group settings held the name: they rank only with the runs like them.",
            registry=registry,
        )
        self.retained_inputs = Counter(
            "agent_monitor_retained_inputs",
            "Input messages (start, step, end; other: a bad topic) that came with the MQTT "
            "retain flag, by kind: "
            "a stored copy the broker replays on every subscription, ignored (the run is "
            "told once on its error topic).",
            ["kind"],
            registry=registry,
        )
        for kind in ("start", "step", "end", "other"):
            self.retained_inputs.labels(kind)
        self.outcomes_refused = Counter(
            "agent_monitor_outcomes_refused",
            "Run outcomes that taught the calibration nothing although they said success or "
            "failure, by reason "
            "(unauthenticated: no valid HMAC while outcomes must be signed; replayed: a "
            "signed (run id, started_at) "
            "already taught; stale: its started_at outside --signature-max-age, or none; "
            "rate: the family's "
            "teaching rate was spent).",
            ["reason"],
            registry=registry,
        )
        for reason in ("unauthenticated", "replayed", "stale", "rate"):
            self.outcomes_refused.labels(reason)
        self.scorings_skipped = Counter(
            "agent_monitor_scorings_skipped",
            'Steps the adaptive schedule did not score alone, by reason ("far from '
            'thresholds"); each folds into '
            "the run's next scoring.",
            ["reason"],
            registry=registry,
        )
        self.scorings_skipped.labels(FAR)
        self.run_judge_tokens = Histogram(
            "agent_monitor_run_judge_tokens",
            "Judge tokens (input and output) a run's scorings spent over its life, observed "
            "when it closes.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "agent_monitor_queue_depth",
            "Runs waiting for a scorer (each run at most once).",
            registry=registry,
        )
        self.outbox_depth = Gauge(
            "agent_monitor_outbox_depth",
            "Messages waiting to be published to the broker.",
            registry=registry,
        )
        self.outbox_dropped = Counter(
            "agent_monitor_outbox_dropped",
            "Progress messages dropped because the outbox was full (oldest first; signals "
            "are never dropped).",
            registry=registry,
        )
        self.broker_connected = Gauge(
            "agent_monitor_broker_connected",
            "1 while connected to the MQTT broker.",
            registry=registry,
        )
        self.broker_dropped = Gauge(
            "agent_monitor_broker_dropped_messages",
            "The broker's own count of messages it dropped (Mosquitto's "
            "$SYS/broker/publish/messages/dropped: "
            "queues full), since the broker started; stays 0 where the broker publishes no "
            "such count.",
            registry=registry,
        )
        self.broker_reconnects = Counter(
            "agent_monitor_broker_reconnects",
            "Connections to the broker after the first.",
            registry=registry,
        )
        # Cluster mode (serve --cluster): each replica exports its own; sums over replicas are the
        # cluster's.
        self.cluster_replicas = Gauge(
            "agent_monitor_cluster_replicas",
            "Live replicas of the cluster this replica sees (heartbeats within the lease); 0 "
            "outside cluster mode.",
            registry=registry,
        )
        self.runs_owned = Gauge(
            "agent_monitor_runs_owned",
            "Runs this replica owns now (holds the lease of): it alone scores them and "
            "exports their gauges.",
            registry=registry,
        )
        self.run_takeovers = Counter(
            "agent_monitor_run_takeovers",
            "Runs this replica took over from another owner (one that died, left, or handed "
            "the run over).",
            registry=registry,
        )
        self.sessions_adopted = Counter(
            "agent_monitor_cluster_sessions_adopted",
            "MQTT sessions of departed replicas this replica took over (and emptied, then "
            "deleted).",
            registry=registry,
        )
        self.cluster_redis_emptied = Counter(
            "agent_monitor_cluster_redis_emptied",
            "Times the cluster's Redis came back without the cluster's data (restarted "
            "without persistence, or "
            "flushed): the live runs' journals, inboxes and calibration samples were lost.",
            registry=registry,
        )
        self.cluster_fenced = Counter(
            "agent_monitor_cluster_fenced",
            "Writes and publications refused because this replica no longer owned the run "
            "(fencing), by what.",
            ["what"],
            registry=registry,
        )
        for what in ("write", "publish"):
            self.cluster_fenced.labels(what)
        self.cluster_errors = Counter(
            "agent_monitor_cluster_errors",
            "Cluster operations on Redis that failed (retried; messages stay "
            "unacknowledged), by operation.",
            ["op"],
            registry=registry,
        )
        # At 0 from start-up like every labelled counter: a panel's increase() has data, and the
        # first failure counts as a rise (a series born at 1 shows none).
        for op in CLUSTER_OPS:
            self.cluster_errors.labels(op)
        for s in SIGNALS:
            self.signals.labels(s)
        for o in RUN_OUTCOMES:
            self.runs.labels(o)
        for r in REFUSALS:
            self.invalid_events.labels(r)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-monitor")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


class MetricsSink:
    """Count the monitor's rarer events (refusals, duplicates, signals, runs ending); keep ended
    runs' series a while.

    A step's own path is not counted here: the ingest, the scoring part and the judge's circuit keep
    those counts themselves, and `FlowCollector` reads them at scrape time.
    """

    events = (Duplicated, Refused, Skipped, SignalChanged, RunOpened, RunClosed)

    def __init__(
        self,
        metrics: Metrics,
        *,
        grace_s: float = 60.0,
        memory: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.grace_s = grace_s
        self.memory = memory
        self.clock = clock
        self._finished: OrderedDict[str, tuple[float, RunSeries]] = OrderedDict()

    def __call__(self, event: MonitorEvent) -> None:
        """Count one event."""
        m = self.metrics
        if isinstance(event, Skipped):
            m.scorings_skipped.labels(event.reason).inc()
        elif isinstance(event, SignalChanged):
            if event.decision.changed and not event.republished:
                m.signals.labels(event.decision.signal).inc()
                if event.decision.pruned:
                    m.pruned.inc()
        elif isinstance(event, Refused):
            if event.invalid:
                m.invalid_events.labels(event.reason).inc(event.count)
        elif isinstance(event, Duplicated):
            if event.counted:
                m.duplicate_steps.inc()
        elif isinstance(event, RunOpened):
            self._finished.pop(event.run_id, None)
        elif isinstance(event, RunClosed):
            m.runs.labels(event.outcome).inc()
            if event.latest is not None:
                m.run_judge_tokens.observe(
                    event.latest.totals.input_tokens + event.latest.totals.output_tokens
                )
            if self.grace_s > 0:
                series = series_of(
                    event.run_id, event.labels, event.latest, event.last_ok, event.signal, event.at
                )
                self._finished.pop(event.run_id, None)
                self._finished[event.run_id] = (self.clock(), series)
                while len(self._finished) > self.memory:
                    self._finished.popitem(last=False)

    def finished(self) -> list[RunSeries]:
        """Ended runs' last series within the grace period (called from the scrape thread: reads
        a copy)."""
        now = self.clock()
        return [s for t, s in list(self._finished.values()) if now - t < self.grace_s]

    def prune(self) -> None:
        """Forget ended runs' series past the grace period (on the event loop)."""
        now = self.clock()
        while self._finished:
            rid, (t, _) = next(iter(self._finished.items()))
            if now - t < self.grace_s:
                break
            del self._finished[rid]


class RunCollector(Collector):
    """Per-run gauges computed at scrape time from live run state, so an ended run leaves no series
    behind.

    At most `max_series` runs are exported (the most recently active first); the rest are counted in
    `agent_monitor_run_series_capped`, so a flood of run ids cannot blow up Prometheus. Only the
    `start.labels` named in `label_names` become labels (missing ones are empty).
    """

    def __init__(
        self,
        snapshot: Callable[[], Iterable[RunSeries]],
        *,
        label_names: Sequence[str] = ("group", "model"),
        max_series: int = 1000,
    ) -> None:
        bad = [
            n
            for n in label_names
            if not n.isidentifier() or n.startswith("__") or n in ("run_id", "signal")
        ]
        if bad:
            raise ValueError(
                f"metric label names {bad} are not allowed; use identifiers "
                "other than run_id and signal"
            )
        if max_series < 0:
            raise ValueError("max_series must be >= 0")
        self.snapshot = snapshot
        self.label_names = tuple(label_names)
        self.max_series = max_series

    def collect(self) -> Iterator[Metric]:
        """The per-run gauge families (called by the registry on every scrape)."""
        runs = sorted(self.snapshot(), key=lambda r: r.last_event, reverse=True)
        shown, capped = runs[: self.max_series], max(0, len(runs) - self.max_series)
        names = ["run_id", *self.label_names]
        progress = GaugeMetricFamily(
            "agent_monitor_run_progress",
            "Latest progress score of each run, 0..1. Labels besides run_id are "
            "--metric-labels read from the run's "
            "start.labels (model: the agent's model, as the harness names it); empty when "
            "the start names none.",
            labels=names,
        )
        uncertainty = GaugeMetricFamily(
            "agent_monitor_run_uncertainty",
            "Uncertainty (std) of each run's latest score.",
            labels=names,
        )
        spread = GaugeMetricFamily(
            "agent_monitor_run_spread",
            "Disagreement between the judge's repeats on each run's latest score (std of the "
            "repeats' "
            "expectations, weighted over criteria; 0 with one repeat).",
            labels=names,
        )
        step = GaugeMetricFamily(
            "agent_monitor_run_step", "Latest scored step of each run.", labels=names
        )
        signal = GaugeMetricFamily(
            "agent_monitor_run_signal",
            "1 for each run's current signal.",
            labels=[*names, "signal"],
        )
        tokens = GaugeMetricFamily(
            "agent_monitor_run_tokens",
            "Judge tokens each run's scorings spent so far, by kind (input includes cached_input).",
            labels=[*names, "kind"],
        )
        cost = GaugeMetricFamily(
            "agent_monitor_run_cost_usd",
            "What each run's judge tokens cost so far, in USD at the --price-* flags (no "
            "series without prices).",
            labels=names,
        )
        for r in shown:
            values = [r.run_id, *(r.labels.get(n, "") for n in self.label_names)]
            if r.progress is not None:
                progress.add_metric(values, r.progress)
            if r.uncertainty is not None:
                uncertainty.add_metric(values, r.uncertainty)
            if r.spread is not None:
                spread.add_metric(values, r.spread)
            step.add_metric(values, r.step)
            signal.add_metric([*values, r.signal], 1.0)
            t = r.tokens
            for kind, n in zip(
                TOKEN_KINDS, (t.input_tokens, t.cached_input_tokens, t.output_tokens), strict=True
            ):
                tokens.add_metric([*values, kind], n)
            if r.cost is not None:
                cost.add_metric(values, r.cost)
        yield from (progress, uncertainty, spread, step, signal, tokens, cost)
        yield GaugeMetricFamily(
            "agent_monitor_run_series_capped",
            "Live runs not exported per run because of the series cap.",
            value=capped,
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the families are built at scrape time (avoids a collect() at
        registration)."""
        return iter(())


S_co = TypeVar("S_co", covariant=True)


class Counted(Protocol[S_co]):
    """A part that keeps its own counts (`statistics()`, a record), read at scrape time."""

    def statistics(self) -> S_co:
        """The part's counts now."""
        ...


def _histogram(
    name: str,
    doc: str,
    bounds: Sequence[float],
    counts: Sequence[int],
    total: float,
    labels: Sequence[str] = (),
    values: Sequence[str] = (),
) -> HistogramMetricFamily:
    """A histogram family from a part's bucket counts: one per bound in `bounds`, then the ones
    over the last."""
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    cumulative, buckets = 0, []
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    family.add_metric(list(values), buckets, sum_value=total)
    return family


class FlowCollector(Collector):
    """A step's path in numbers, read at scrape time from the parts that count it: ingest, scoring,
    the judge.

    Nothing on that path calls into the metrics: the ingest counts what it accepted, the scoring
    part what its scorings gave, the circuit in front of the judge the calls that reached it
    (refused calls while the judge is down are not judge calls), each as plain numbers in its
    `statistics()`.
    """

    def __init__(
        self,
        judge: str,
        *,
        intake: Counted[RunWriterStatistics],
        scoring: Counted[ScoringStatistics],
        circuit: Counted[CircuitJudgeStatistics],
    ) -> None:
        self.judge = judge
        self.intake = intake
        self.scoring = scoring
        self.circuit = circuit

    def collect(self) -> Iterator[Metric]:
        """The counters and histograms of the step path (called by the registry on every scrape)."""
        accepted, s, c = (
            self.intake.statistics().accepted,
            self.scoring.statistics(),
            self.circuit.statistics(),
        )
        events = CounterMetricFamily(
            "agent_monitor_events", "Input events accepted, by type.", labels=["type"]
        )
        # amend: a step's text replaced by index (`step.amend`)
        for kind in (*INPUT_KINDS, "amend"):
            events.add_metric([kind], accepted.get(kind, 0))
        calls = CounterMetricFamily(
            "agent_monitor_judge_calls",
            "Judge calls, by backend and outcome.",
            labels=["judge", "outcome"],
        )
        calls.add_metric([self.judge, "ok"], c.calls_ok)
        calls.add_metric([self.judge, "error"], c.calls_failed)
        tokens = CounterMetricFamily(
            "agent_monitor_judge_tokens",
            "Tokens the judge read and wrote, by kind.",
            labels=["kind"],
        )
        for kind, n in (
            ("input", c.input_tokens),
            ("cached_input", c.cached_input_tokens),
            ("output", c.output_tokens),
        ):
            tokens.add_metric([kind], n)
        scorings = CounterMetricFamily(
            "agent_monitor_scorings", "Prefix scorings, by result.", labels=["outcome"]
        )
        scorings.add_metric(["ok"], s.scored_ok)
        scorings.add_metric(["failed"], s.scored_failed)
        failures = CounterMetricFamily(
            "agent_monitor_scoring_failures",
            "Prefix scorings that gave no score, by reason (judge failures, "
            "extractor_timeout, ...).",
            labels=["reason"],
        )
        seen = dict(s.failures)
        for reason in (*FAILURES, *sorted(set(seen) - set(FAILURES))):
            failures.add_metric([reason], seen.get(reason, 0))
        yield from (events, calls, tokens, scorings, failures)
        yield _histogram(
            "agent_monitor_judge_latency_seconds",
            "Wall time of one judge call, retries included.",
            c.latency_buckets,
            c.latency_counts,
            c.latency_sum,
            ["judge"],
            [self.judge],
        )
        yield CounterMetricFamily(
            "agent_monitor_judge_calls_saved",
            "Judge calls not made because confident rules answered the criterion.",
            value=s.calls_saved,
        )
        yield CounterMetricFamily(
            "agent_monitor_images_dropped",
            "Image parts the judge got as text placeholders instead of pixels (a text-only "
            "judge, or a model "
            "that refused images; the log's judge_refuses_images says which).",
            value=s.images_dropped,
        )
        yield CounterMetricFamily(
            "agent_monitor_coalesced_steps",
            "Steps folded into a later step's scoring instead of being scored alone.",
            value=s.coalesced,
        )
        yield CounterMetricFamily(
            "agent_monitor_scorings_superseded",
            "Scorings whose run got newer steps while they were in flight: published, then "
            "replaced by the next one "
            "(a scoring is never started for a prefix a newer one already replaced: "
            "agent_monitor_coalesced_steps).",
            value=s.superseded,
        )
        yield CounterMetricFamily(
            "agent_monitor_scorings_held",
            "Scorings not started while their run's last score still waited to be published "
            "(it would have queued "
            "behind it, unread); each starts once that message is out, with the steps that "
            "came meanwhile.",
            value=s.held,
        )
        yield _histogram(
            "agent_monitor_step_to_score_seconds",
            "Time from a step's arrival to the publication of the score that includes it.",
            s.step_to_score_buckets,
            s.step_to_score_counts,
            s.step_to_score_sum,
        )
        yield _histogram(
            "agent_monitor_decision_judge_tokens",
            "Judge tokens (input and output) a run spent up to each change of its signal "
            "(abort, resample, back to "
            "continue): what a decision cost.",
            s.decision_tokens_buckets,
            s.decision_tokens_counts,
            s.decision_tokens_sum,
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the families are built at scrape time."""
        return iter(())


class CostCollector(Collector):
    """`agent_monitor_judge_cost_usd`: what every judge token so far cost, priced once from the
    integer totals."""

    def __init__(self, circuit: Counted[CircuitJudgeStatistics], prices: Prices) -> None:
        self.circuit = circuit
        self.prices = prices

    def collect(self) -> Iterator[Metric]:
        """The cost counter (called by the registry on every scrape)."""
        c = self.circuit.statistics()
        usage = Usage(c.input_tokens, c.cached_input_tokens, c.output_tokens)
        yield CounterMetricFamily(
            "agent_monitor_judge_cost_usd",
            "What the judge's tokens (agent_monitor_judge_tokens_total) cost, in USD at the "
            "--price-* flags.",
            value=self.prices.cost(usage),
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the value is computed at scrape time."""
        return iter(())


class StatisticsCollector(Collector):
    """Gauges read from a component's `statistics()` record at scrape time: `{prefix}{field}` for
    each in `gauges`."""

    def __init__(
        self, component: object, gauges: Mapping[str, str], *, prefix: str = "agent_monitor_"
    ) -> None:
        self.statistics: Callable[[], DataclassInstance] | None = getattr(
            component, "statistics", None
        )
        self.gauges = dict(gauges)
        """Each statistic exported, with its help text."""
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        """The component's gauges now (none when it has no `statistics()`)."""
        if self.statistics is None:
            return
        record = self.statistics()
        now = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
        for key, help_text in self.gauges.items():
            if key in now:
                yield GaugeMetricFamily(f"{self.prefix}{key}", help_text, value=float(now[key]))

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the values are read at scrape time."""
        return iter(())


STORE_GAUGES = {
    "queue_depth": "Writes waiting for the run store's writer thread (bounded: beyond its "
    "bound, writers wait).",
    "queue_max": "The bound of the run store's writer queue.",
}
"""What the run store's `statistics()` (a `SqliteStoreStatistics`) exports (as
agent_monitor_store_*)."""


class GroupCollector(Collector):
    """Per-group gauges: live runs and the leader's score, for groups on `allow` (all when empty),
    at most `max_groups`.

    Group names come from runs' starts: the most recently active groups are exported, the rest are
    counted in `agent_monitor_group_series_capped`; a group's series go when the group is cleared.
    """

    def __init__(
        self,
        series: Callable[[], Sequence[GroupSeries]],
        *,
        allow: Sequence[str] = (),
        max_groups: int = 100,
    ) -> None:
        if max_groups < 0:
            raise ValueError("max_groups must be >= 0")
        self.series = series
        self.allow = tuple(allow)
        self.max_groups = max_groups

    def collect(self) -> Iterator[Metric]:
        """The group gauge families (called by the registry on every scrape)."""
        every = list(self.series())
        allowed = [g for g in every if not self.allow or g.group in self.allow]
        shown = allowed[: self.max_groups]
        live = GaugeMetricFamily(
            "agent_monitor_group_live_runs",
            "Live runs in each group (start.group), pruned ones excluded.",
            labels=["group"],
        )
        leader = GaugeMetricFamily(
            "agent_monitor_group_leader_score",
            "The score of each group's leading run (rank 1); no series until one is scored.",
            labels=["group"],
        )
        for g in shown:
            live.add_metric([g.group], g.live)
            if g.leader_score is not None:
                leader.add_metric([g.group], g.leader_score)
        yield from (live, leader)
        yield GaugeMetricFamily(
            "agent_monitor_group_series_capped",
            "Groups not exported: not on --metric-groups, or past --max-group-series.",
            value=len(every) - len(shown),
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the families are built at scrape time."""
        return iter(())


class CalibrationCollector(Collector):
    """Per-family calibration gauges: successful runs seen, and the abort threshold they give now.

    Kept current on the event loop (`update` after a family gains a sample) and read at scrape time
    from a copy, so a scrape never computes margins on the scrape thread. Family names come from
    runs' starts (or their task texts): only those on `allow` (all when empty) are exported, at most
    `max_families` of them, the most recently ended first; the rest are counted in
    `agent_monitor_calibration_series_capped`.
    """

    def __init__(
        self,
        calibration: Calibration,
        policy: Policy,
        *,
        allow: Sequence[str] = (),
        max_families: int = 100,
    ) -> None:
        if max_families < 0:
            raise ValueError("max_families must be >= 0")
        self.calibration = calibration
        self.policy = policy
        self.allow = frozenset(allow)
        self.max_families = max_families
        self._series: dict[Family, FamilySeries] = {}

    def update(self, family: Family, at: float) -> FamilySeries:
        """Recompute one family's gauges (on the event loop), `at` its newest sample's time."""
        th = self.calibration.threshold(family, self.policy)
        series = self._series[family] = FamilySeries(family, th.successes, th.value, at)
        # The calibration forgets families past its bound (their names come from the network): so
        # does this table.
        self._series = {f: s for f, s in self._series.items() if f in self.calibration}
        return series

    def collect(self) -> Iterator[Metric]:
        """The calibration gauge families (called by the registry on every scrape)."""
        every = sorted(list(self._series.values()), key=lambda f: f.last_at, reverse=True)
        allowed = [f for f in every if not self.allow or f.family.name in self.allow]
        shown = allowed[: self.max_families]
        names = ["family", "model", "rubric"]
        successes = GaugeMetricFamily(
            "agent_monitor_calibration_successes",
            "Successful finished runs each family's abort_below auto threshold is learnt "
            "from (by judge model "
            "and rubric hash).",
            labels=names,
        )
        threshold = GaugeMetricFamily(
            "agent_monitor_calibrated_threshold",
            "The abort_below auto threshold of each family under the monitor's default "
            "policy and alpha; no "
            f"series until the family has {min_successes(self.policy.alpha)} successful runs "
            "(at alpha "
            f"{self.policy.alpha:g}): until then it never aborts.",
            labels=names,
        )
        for f in shown:
            values = [f.family.name, f.family.model, f.family.rubric]
            successes.add_metric(values, f.successes)
            if f.threshold is not None:
                threshold.add_metric(values, f.threshold)
        yield from (successes, threshold)
        yield GaugeMetricFamily(
            "agent_monitor_calibration_series_capped",
            "Calibration families not exported: not on --metric-families, or past --max-families.",
            value=len(every) - len(shown),
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the families are built at scrape time."""
        return iter(())
