"""The sinks: where the monitor's events go (MQTT out, metrics, OpenTelemetry, Phoenix, the board)."""

from ._board import Board, BoardClient, BoardSettings, sse
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
from ._otel import OtelSink
from ._phoenix import PhoenixSink, PhoenixStatistics
from ._runpages import QueryError, RunPages
from ._site import BoardSite

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
    "Metrics",
    "MetricsSink",
    "OtelSink",
    "PhoenixSink",
    "PhoenixStatistics",
    "QueryError",
    "RunCollector",
    "RunPages",
    "StatisticsCollector",
    "sse",
]
