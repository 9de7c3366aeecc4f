"""The sinks: where the monitor's events go (MQTT out, metrics, OpenTelemetry, Phoenix, the
board)."""

from ._board import Board, BoardClient, BoardSettings, sse
from ._log import LogSink
from ._metrics import (
    STORE_GAUGES,
    CalibrationCollector,
    CostCollector,
    FlowCollector,
    GroupCollector,
    Metrics,
    MetricsSink,
    RunCollector,
    StatisticsCollector,
)
from ._mqtt import Message, MqttSink, Outbox, OutboxStatistics, compact_form
from ._otel import OtelSink
from ._phoenix import PhoenixSink, PhoenixStatistics
from ._runpages import QueryError, RunPages
from ._site import BoardSite
from ._store import StoreSink

__all__ = [
    "STORE_GAUGES",
    "Board",
    "BoardClient",
    "BoardSettings",
    "BoardSite",
    "CalibrationCollector",
    "CostCollector",
    "FlowCollector",
    "GroupCollector",
    "LogSink",
    "Message",
    "Metrics",
    "MetricsSink",
    "MqttSink",
    "OtelSink",
    "Outbox",
    "OutboxStatistics",
    "PhoenixSink",
    "PhoenixStatistics",
    "QueryError",
    "RunCollector",
    "RunPages",
    "StatisticsCollector",
    "StoreSink",
    "compact_form",
    "sse",
]
