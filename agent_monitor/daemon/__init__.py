"""The monitor daemon: Monitor and its settings, the run store, metrics, sinks, the web board and
the embedded broker.

`Monitor(config, judge=...)` follows every run on an MQTT broker (or fed with `handle()`),
scores each new prefix and publishes progress and signals. This package imports `wire/` and
the top level of `agent_monitor`, never `cli/`.
"""

from typing import TYPE_CHECKING, Any

from ._broker import BrokerStartError, EmbeddedBroker
from ._config import (
    BoardSettings,
    ClusterSettings,
    MetricsSettings,
    MonitorConfig,
    OtlpReceiverSettings,
    PhoenixSettings,
    Protocol,
    ProxySettings,
    RewardApiSettings,
    RewardShape,
    RunLimits,
)
from ._events import (
    Accepted,
    Duplicated,
    MonitorEvent,
    Refused,
    RunClosed,
    RunOpened,
    Scored,
    SignalChanged,
    Sink,
    Skipped,
)
from ._gc import DEFAULT_GC_THRESHOLD, tune_gc
from ._monitor import Monitor
from .cluster import ClusterJournal, ClusterUnavailable
from .http import HttpRequest, HttpResponse, HttpServer, Route
from .judge_server import JudgeServer, JudgeServerSettings
from .runs import RunView, StepView
from .sinks import Board, PhoenixSink, PhoenixStatistics, RunPages
from .sources import BrokerUnavailable, Inbound, Ingest, RunsView, Source
from .sources.otlp import OtlpReceiver
from .sources.reward import RewardSource
from .stores import (
    HistoryQuery,
    MemoryStore,
    Replay,
    RunStore,
    SqliteStore,
    StoreFormatError,
    default_state_dir,
)

if TYPE_CHECKING:
    from .sources.proxy import ProxySource


def __getattr__(name: str) -> Any:
    # Loaded on first use: without the proxy nothing imports h11 or httpx2 (ImportError names the
    # extra).
    if name == "ProxySource":
        from .sources.proxy import ProxySource

        return ProxySource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_GC_THRESHOLD",
    "Accepted",
    "Board",
    "BoardSettings",
    "BrokerStartError",
    "BrokerUnavailable",
    "ClusterJournal",
    "ClusterSettings",
    "ClusterUnavailable",
    "Duplicated",
    "EmbeddedBroker",
    "HistoryQuery",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "Inbound",
    "Ingest",
    "JudgeServer",
    "JudgeServerSettings",
    "MemoryStore",
    "MetricsSettings",
    "Monitor",
    "MonitorConfig",
    "MonitorEvent",
    "OtlpReceiver",
    "OtlpReceiverSettings",
    "PhoenixSettings",
    "PhoenixSink",
    "PhoenixStatistics",
    "Protocol",
    "ProxySettings",
    "ProxySource",
    "Refused",
    "Replay",
    "RewardApiSettings",
    "RewardShape",
    "RewardSource",
    "Route",
    "RunClosed",
    "RunLimits",
    "RunOpened",
    "RunPages",
    "RunStore",
    "RunView",
    "RunsView",
    "Scored",
    "SignalChanged",
    "Sink",
    "Skipped",
    "Source",
    "SqliteStore",
    "StepView",
    "StoreFormatError",
    "default_state_dir",
    "tune_gc",
]
