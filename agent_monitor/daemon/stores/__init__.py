"""The run stores: the journal of what each run accepted, and its scores."""

from ._store import (
    PLACEHOLDER_PNG,
    HistoryQuery,
    MemoryStore,
    NoStore,
    Replay,
    RunStore,
    SqliteStore,
    StoreFormatError,
    StoreSink,
    _event_of,
    _event_record,
    _totals,
    _totals_row,
    default_state_dir,
)

__all__ = [
    "PLACEHOLDER_PNG",
    "HistoryQuery",
    "MemoryStore",
    "NoStore",
    "Replay",
    "RunStore",
    "SqliteStore",
    "StoreFormatError",
    "StoreSink",
    "_event_of",
    "_event_record",
    "_totals",
    "_totals_row",
    "default_state_dir",
]
