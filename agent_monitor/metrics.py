"""Prometheus metrics, always on a registry the caller passes in (no global registry)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .judges.base import Judge, JudgeRequest, JudgeResponse

SIGNALS = ("continue", "abort", "resample")
RUN_OUTCOMES = ("success", "failure", "scored", "unknown", "expired", "evicted")
EVENT_TYPES = ("start", "step", "end")
INVALID_REASONS = (
    "payload_too_large",
    "bad_json",
    "bad_topic",
    "invalid",
    "bad_image",
    "no_start",
    "duplicate_start",
    "run_ended",
    "unknown_run",
    "step_gap",
    "index_too_far",
    "too_many_held",
    "run_rejected",
)
TOKEN_KINDS = ("input", "cached_input", "output")
# Judge latencies run from tens of milliseconds (a warm local model) to a minute (a loaded hosted API).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class Metrics:
    """The monitor's metrics on one registry; trackers and the daemon that are given it count into it.

    Labelled counters are created for every known label value so their series exist at 0 before the first event.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        Info("agent_monitor_build", "The monitor's version.", registry=registry).info({"version": _version()})
        self.judge_calls = Counter(
            "agent_monitor_judge_calls", "Judge calls, by backend and outcome.", ["judge", "outcome"], registry=registry
        )
        self.judge_latency = Histogram(
            "agent_monitor_judge_latency_seconds",
            "Wall time of one judge call, retries included.",
            ["judge"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.judge_degraded = Gauge(
            "agent_monitor_judge_degraded",
            "1 while the judge's circuit breaker is open (the judge keeps failing; scoring waits, never aborts).",
            registry=registry,
        )
        self.judge_tokens = Counter(
            "agent_monitor_judge_tokens", "Tokens the judge read and wrote, by kind.", ["kind"], registry=registry
        )
        for kind in TOKEN_KINDS:
            self.judge_tokens.labels(kind)
        self.judge_calls_saved = Counter(
            "agent_monitor_judge_calls_saved",
            "Judge calls not made because confident rules answered the criterion.",
            registry=registry,
        )
        self.events = Counter("agent_monitor_events", "Input events accepted, by type.", ["type"], registry=registry)
        self.invalid_events = Counter(
            "agent_monitor_invalid_events", "Input events refused, by reason.", ["reason"], registry=registry
        )
        self.duplicate_steps = Counter(
            "agent_monitor_duplicate_steps",
            "Steps ignored because a step with their index was already received (MQTT re-delivery).",
            registry=registry,
        )
        self.runs_active = Gauge("agent_monitor_runs_active", "Runs being followed now.", registry=registry)
        self.runs = Counter(
            "agent_monitor_runs",
            "Runs that ended, expired or were evicted, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.signals = Counter(
            "agent_monitor_signals", "Signal changes published, by signal.", ["signal"], registry=registry
        )
        self.scorings = Counter("agent_monitor_scorings", "Prefix scorings, by result.", ["outcome"], registry=registry)
        self.coalesced_steps = Counter(
            "agent_monitor_coalesced_steps",
            "Steps folded into a later step's scoring instead of being scored alone.",
            registry=registry,
        )
        self.step_to_score = Histogram(
            "agent_monitor_step_to_score_seconds",
            "Time from a step's arrival to the publication of the score that includes it.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "agent_monitor_queue_depth", "Runs waiting for a scorer (each run at most once).", registry=registry
        )
        self.outbox_depth = Gauge(
            "agent_monitor_outbox_depth", "Messages waiting to be published to the broker.", registry=registry
        )
        self.outbox_dropped = Counter(
            "agent_monitor_outbox_dropped",
            "Progress messages dropped because the outbox was full (oldest first; signals are never dropped).",
            registry=registry,
        )
        self.broker_connected = Gauge(
            "agent_monitor_broker_connected", "1 while connected to the MQTT broker.", registry=registry
        )
        self.broker_reconnects = Counter(
            "agent_monitor_broker_reconnects", "Connections to the broker after the first.", registry=registry
        )
        for s in SIGNALS:
            self.signals.labels(s)
        for o in RUN_OUTCOMES:
            self.runs.labels(o)
        for t in EVENT_TYPES:
            self.events.labels(t)
        for r in INVALID_REASONS:
            self.invalid_events.labels(r)
        for o in ("ok", "failed"):
            self.scorings.labels(o)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-monitor")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


class MeteredJudge:
    """A judge whose calls, latency and tokens are counted into Metrics; everything else is the wrapped judge's."""

    def __init__(self, judge: Judge, metrics: Metrics) -> None:
        self.inner = judge
        self.name = judge.name
        self.metrics = metrics
        for outcome in ("ok", "error"):
            metrics.judge_calls.labels(judge.name, outcome)
        metrics.judge_latency.labels(judge.name)  # so rate() sees the first call

    @property
    def model(self) -> str:
        """The wrapped judge's model id."""
        return str(getattr(self.inner, "model", "") or "")

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        """Grade through the wrapped judge, counting the call."""
        m = self.metrics
        start = time.perf_counter()
        try:
            response = await self.inner.grade(request)
        except Exception:  # JudgeError or a backend's bug: either way a failed call
            m.judge_calls.labels(self.name, "error").inc()
            m.judge_latency.labels(self.name).observe(time.perf_counter() - start)
            raise
        m.judge_calls.labels(self.name, "ok").inc()
        m.judge_latency.labels(self.name).observe(time.perf_counter() - start)
        u = response.usage
        m.judge_tokens.labels("input").inc(u.input_tokens)
        m.judge_tokens.labels("cached_input").inc(u.cached_input_tokens)
        m.judge_tokens.labels("output").inc(u.output_tokens)
        return response

    async def aclose(self) -> None:
        """Close the wrapped judge."""
        await self.inner.aclose()


@dataclass(frozen=True, slots=True)
class RunSeries:
    """What the per-run gauges show of one run: its latest score, step and signal."""

    run_id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    progress: float | None = None
    uncertainty: float | None = None
    step: int = 0
    signal: str = "continue"
    last_event: float = 0.0


class RunCollector(Collector):
    """Per-run gauges computed at scrape time from live run state, so an ended run leaves no series behind.

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
        bad = [n for n in label_names if not n.isidentifier() or n.startswith("__") or n in ("run_id", "signal")]
        if bad:
            raise ValueError(f"metric label names {bad} are not allowed; use identifiers other than run_id and signal")
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
            "agent_monitor_run_progress", "Latest progress score of each run, 0..1.", labels=names
        )
        uncertainty = GaugeMetricFamily(
            "agent_monitor_run_uncertainty", "Uncertainty (std) of each run's latest score.", labels=names
        )
        step = GaugeMetricFamily("agent_monitor_run_step", "Latest scored step of each run.", labels=names)
        signal = GaugeMetricFamily(
            "agent_monitor_run_signal", "1 for each run's current signal.", labels=[*names, "signal"]
        )
        for r in shown:
            values = [r.run_id, *(r.labels.get(n, "") for n in self.label_names)]
            if r.progress is not None:
                progress.add_metric(values, r.progress)
            if r.uncertainty is not None:
                uncertainty.add_metric(values, r.uncertainty)
            step.add_metric(values, r.step)
            signal.add_metric([*values, r.signal], 1.0)
        yield from (progress, uncertainty, step, signal)
        yield GaugeMetricFamily(
            "agent_monitor_run_series_capped", "Live runs not exported per run because of the series cap.", value=capped
        )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the families are built at scrape time (avoids a collect() at registration)."""
        return iter(())
