"""The store sink: every published score and group ranking kept in the run store."""

from __future__ import annotations

from .._events import GroupRanked, MonitorEvent, RunClosed, Scored
from ..stores import RunStore

__all__ = ["StoreSink"]


class StoreSink:
    """Keep every published score and group ranking in the run store (a restart takes them up
    again)."""

    events = (Scored, GroupRanked, RunClosed)

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def __call__(self, event: MonitorEvent) -> None:
        """Record a score (a run's final one again, with its verdict) or a ranking."""
        if isinstance(event, Scored) and not event.republished:
            self.store.record_progress(event.run_id, event.progress.step, dict(event.data))
        elif isinstance(event, RunClosed) and event.final is not None:
            self.store.record_progress(event.run_id, int(event.final["step"]), dict(event.final))
        elif isinstance(event, GroupRanked) and not event.republished:
            self.store.record_ranking(event.group, event.ranking)
