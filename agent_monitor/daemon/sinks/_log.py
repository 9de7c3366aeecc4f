"""The log sink: one structured log line per thing worth a line."""

from __future__ import annotations

from typing import Any

import structlog

from .._events import MonitorEvent, Refused, RunClosed, RunOpened, SignalChanged

__all__ = ["LogSink"]


class LogSink:
    """One structured log line per thing worth a line: runs opened and closed, signals, refusals.

    (A failed score is logged by the run's tracker, with the run id bound.)
    """

    events = (SignalChanged, Refused, RunOpened, RunClosed)

    def __init__(self, logger: Any = None) -> None:
        self.log = logger if logger is not None else structlog.get_logger("agent_monitor.daemon")

    def __call__(self, event: MonitorEvent) -> None:
        """Log one event."""
        log = self.log
        if isinstance(event, SignalChanged):
            d = event.decision
            log.info(
                "signal",
                run_id=event.run_id,
                signal=d.signal,
                reason=d.reason,
                step=d.step,
                score=d.score,
                best_step=d.best_step,
            )
        elif isinstance(event, Refused):
            log.warning(
                "event_refused",
                run_id=event.run_id,
                reason=event.reason,
                error=event.message,
                topic=event.topic,
            )
        elif isinstance(event, RunOpened):
            s = event.start
            log.info("run_started", run_id=event.run_id, task=s.task[:200], labels=s.labels)
        elif isinstance(event, RunClosed):
            log.info(
                "run_finished",
                run_id=event.run_id,
                outcome=event.outcome,
                steps=event.steps,
                score=event.latest.score if event.latest else None,
                signal=event.signal,
            )
