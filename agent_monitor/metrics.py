"""Prometheus metrics, always on a registry the caller passes in (no global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
# Judge latencies run from tens of milliseconds (a warm local model) to a minute (a loaded hosted API).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class Metrics:
    """The monitor's metrics on one registry; trackers and the daemon that are given it count into it.

    Labelled counters are created for every known label value so their series exist at 0 before the first event.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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
