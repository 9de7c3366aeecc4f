"""The monitor daemon: Monitor and its settings, the run store, metrics, sinks, the web board and the embedded broker.

`Monitor(config, judge=...)` follows every run on an MQTT broker (or fed with `handle()`),
scores each new prefix and publishes progress and signals. This package imports `wire/` and
the top level of `agent_monitor`, never `cli/`.
"""

from ._board import Board, BoardSettings
from ._broker import BrokerStartError, EmbeddedBroker
from ._cluster_store import ClusterJournal, ClusterUnavailable
from ._config import ClusterSettings, MetricsSettings, MonitorConfig, Protocol
from ._gc import DEFAULT_GC_THRESHOLD, tune_gc
from ._http import HttpServer
from ._monitor import Monitor
from ._mqtt import BrokerUnavailable
from ._sinks import (
    Accepted,
    Duplicated,
    MonitorEvent,
    Refused,
    RunClosed,
    RunOpened,
    Scored,
    SignalChanged,
    Sink,
)
from ._source import Inbound, Ingest, RunsView, Source
from ._state import RunLimits
from ._store import MemoryStore, Replay, RunStore, SqliteStore, StoreFormatError, default_state_dir
from ._views import RunView, StepView

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
    "HttpServer",
    "Inbound",
    "Ingest",
    "MemoryStore",
    "MetricsSettings",
    "Monitor",
    "MonitorConfig",
    "MonitorEvent",
    "Protocol",
    "Refused",
    "Replay",
    "RunClosed",
    "RunLimits",
    "RunOpened",
    "RunStore",
    "RunView",
    "RunsView",
    "Scored",
    "SignalChanged",
    "Sink",
    "Source",
    "SqliteStore",
    "StepView",
    "StoreFormatError",
    "default_state_dir",
    "tune_gc",
]
