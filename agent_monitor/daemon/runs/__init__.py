"""The run parts: ingest, scoring, groups, restore; what happens to a run between its doors and its sinks."""

from ._groups import GroupBook, Groups, GroupSeries
from ._ingest import Intake, IntakeStatistics
from ._replay import Replays
from ._restore import Restore
from ._scoring import TOKEN_BUCKETS, CallRateStatistics, Scoring, ScoringStatistics
from ._views import FamilySeries, LiveRuns, RunSeries, RunView, StepView, run_series, series_of

__all__ = [
    "TOKEN_BUCKETS",
    "CallRateStatistics",
    "FamilySeries",
    "GroupBook",
    "GroupSeries",
    "Groups",
    "Intake",
    "IntakeStatistics",
    "LiveRuns",
    "Replays",
    "Restore",
    "RunSeries",
    "RunView",
    "Scoring",
    "ScoringStatistics",
    "StepView",
    "run_series",
    "series_of",
]
