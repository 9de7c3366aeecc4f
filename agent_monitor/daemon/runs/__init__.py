"""The run parts: ingest, scoring, groups, restore; what happens to a run between its doors and
its sinks."""

from ._book import (
    AcceptedStep,
    Appended,
    Closed,
    Closing,
    Effect,
    Opened,
    Revised,
    RunBook,
    RunState,
)
from ._groups import GroupBook, Groups, GroupSeries
from ._ingest import RunWriter, RunWriterStatistics
from ._replay import Replays
from ._restore import Restore
from ._scoring import TOKEN_BUCKETS, CallRateStatistics, Scoring, ScoringStatistics
from ._views import FamilySeries, LiveRuns, RunSeries, RunView, StepView, run_series, series_of

__all__ = [
    "TOKEN_BUCKETS",
    "AcceptedStep",
    "Appended",
    "CallRateStatistics",
    "Closed",
    "Closing",
    "Effect",
    "FamilySeries",
    "GroupBook",
    "GroupSeries",
    "Groups",
    "LiveRuns",
    "Opened",
    "Replays",
    "Restore",
    "Revised",
    "RunBook",
    "RunSeries",
    "RunState",
    "RunView",
    "RunWriter",
    "RunWriterStatistics",
    "Scoring",
    "ScoringStatistics",
    "StepView",
    "run_series",
    "series_of",
]
