"""The front doors: each source hands a run's start, step and end events to ingest."""

from ._mqtt import BrokerUnavailable, Message, MqttLink, MqttSink, Outbox
from ._protocol import Host, Inbound, Ingest, Receive, RunsView, Source, statistics_json

__all__ = [
    "BrokerUnavailable",
    "Host",
    "Inbound",
    "Ingest",
    "Message",
    "MqttLink",
    "MqttSink",
    "Outbox",
    "Receive",
    "RunsView",
    "Source",
    "statistics_json",
]
