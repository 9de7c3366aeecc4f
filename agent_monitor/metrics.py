"""Prometheus metrics, always on a registry the caller passes in (no global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class Metrics:
    """The monitor's counters on one registry; trackers that are given it count into it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.judge_calls_saved = Counter(
            "agent_monitor_judge_calls_saved",
            "Judge calls not made because confident rules answered the criterion.",
            registry=registry,
        )
