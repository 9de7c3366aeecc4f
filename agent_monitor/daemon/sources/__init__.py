"""The front doors: each source hands a run's start, step and end events to ingest."""

from ._mqtt import BrokerUnavailable, LinkMetrics, MqttLink
from ._protocol import Host, Inbound, Ingest, Receive, RunsView, Source, SourceInput

__all__ = [
    "BrokerUnavailable",
    "Host",
    "Inbound",
    "Ingest",
    "LinkMetrics",
    "MqttLink",
    "Receive",
    "RunsView",
    "Source",
    "SourceInput",
]
