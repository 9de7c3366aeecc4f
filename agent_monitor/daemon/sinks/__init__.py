"""The sinks: where the monitor's events go (MQTT out, metrics, OpenTelemetry, Phoenix, the
board)."""

from typing import TYPE_CHECKING, Any

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
from ._phoenix import PhoenixSink, PhoenixStatistics
from ._runpages import QueryError, RunPages
from ._site import BoardSite
from ._store import StoreSink

if TYPE_CHECKING:
    from ._otel import OtelSink


def __getattr__(name: str) -> Any:
    # OtelSink loads the OpenTelemetry SDK: only a monitor given an OTLP endpoint imports it.
    if name == "OtelSink":
        from ._otel import OtelSink

        return OtelSink
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
