"""The front doors: each source hands a run's start, step and end events to ingest."""

from ._mqtt import BrokerUnavailable, LinkMetrics, MqttLink, Outgoing, Publishing
from ._protocol import (
    Host,
    Inbound,
    Ingest,
    Receive,
    RunsView,
    Source,
    SourceInput,
    statistics_json,
)

__all__ = [
    "BrokerUnavailable",
    "Host",
    "Inbound",
    "Ingest",
    "LinkMetrics",
    "MqttLink",
    "Outgoing",
    "Publishing",
    "Receive",
    "RunsView",
    "Source",
    "SourceInput",
    "statistics_json",
]
