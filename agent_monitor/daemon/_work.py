"""Bounded work per event: the judge calls one start may ask for per step, and one run may make per minute.

A start's rubric is bounded on decode (`criteria.check_bounds`: criteria, bytes per criterion, rubric
bytes). What it costs the judge is bounded here: one scoring of a run makes at most
`judged criteria x repeats` calls (a start over `max_judge_calls_per_step` is refused), and a run
makes at most `max_judge_calls_per_run_minute` calls in any 60 s; past it the run waits, and the
steps arriving meanwhile fold into its next scoring (newest prefix wins), so a chatty or hostile run
costs a bounded judge budget however fast it publishes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..criteria import Rubric

WINDOW_S = 60.0

MAX_JUDGE_CALLS_PER_STEP = 64
"""Judge calls one scoring of one run may make (judged criteria x repeats); a start over it is refused."""
MAX_JUDGE_CALLS_PER_RUN_MINUTE = 600
"""Judge calls one run may make in any 60 s; past it the run's newest prefix waits (steps coalesce)."""


class WorkRefused(ValueError):
    """A start whose judge work per step is over the monitor's bound; the message names the bound."""


def calls_per_scoring(rubric: Rubric, repeats: int) -> int:
    """Judge calls one scoring of a run with `rubric` makes at most (rules may answer some of them)."""
    return len(rubric.judged) * repeats


def check_start(rubric: Rubric, repeats: int, max_calls_per_step: int) -> int:
    """The calls one scoring makes; WorkRefused when that is over `max_calls_per_step`."""
    calls = calls_per_scoring(rubric, repeats)
    if calls > max_calls_per_step:
        raise WorkRefused(
            f"{len(rubric.judged)} judged criteria x {repeats} repeats = {calls} judge calls per step, over the "
            f"limit of {max_calls_per_step} (max_judge_calls_per_step); use fewer criteria"
        )
    return calls


class CallRate:
    """Judge calls per run in any `window_s` seconds, at most `limit`: a sliding window of spent calls.

    Memory is bounded by the live runs times the scorings that fit in a window (each entry spends
    at least one call, so at most `limit` entries per run); `forget` drops an ended run's window.
    """

    def __init__(self, limit: int, *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        if limit < 1:
            raise ValueError(f"limit={limit}; use 1 or more judge calls per window")
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self._spent: dict[str, deque[tuple[float, int]]] = {}
        self._sums: dict[str, int] = {}
        self.delayed = 0
        """Scorings put off because their run had spent its calls for the window."""
        self._due: dict[str, float] = {}

    def _trim(self, run_id: str, now: float) -> deque[tuple[float, int]] | None:
        q = self._spent.get(run_id)
        if q is None:
            return None
        while q and q[0][0] <= now - self.window_s:
            _, n = q.popleft()
            self._sums[run_id] -= n
        if not q:
            del self._spent[run_id], self._sums[run_id]
            return None
        return q

    def wait(self, run_id: str, calls: int) -> float:
        """Seconds until `calls` more fit in the run's window (0: now); counts a delay when not 0."""
        now = self.clock()
        q = self._trim(run_id, now)
        if q is None:
            return 0.0
        spent = self._sums[run_id]
        if spent + calls <= self.limit:
            return 0.0
        # The oldest entries leave the window first: wait until enough of them have.
        free = self.limit - calls
        for at, n in q:
            spent -= n
            if spent <= free:
                self.delayed += 1
                return max(at + self.window_s - now, 0.001)
        self.delayed += 1
        return self.window_s  # unreachable while calls <= limit (checked at start)

    def defer(self, run_id: str, wait_s: float) -> None:
        """Remember that the run's scoring waits `wait_s`; `due` hands it back when that passed."""
        self._due[run_id] = self.clock() + wait_s

    def due(self) -> list[str]:
        """Runs whose deferred scoring may go now (each handed back once)."""
        now = self.clock()
        ready = [r for r, at in self._due.items() if at <= now]
        for r in ready:
            del self._due[r]
        return ready

    def spend(self, run_id: str, calls: int) -> None:
        """Count `calls` judge calls made for the run now."""
        if calls <= 0:
            return
        self._spent.setdefault(run_id, deque()).append((self.clock(), calls))
        self._sums[run_id] = self._sums.get(run_id, 0) + calls

    def forget(self, run_id: str) -> None:
        """Drop an ended run's window."""
        self._spent.pop(run_id, None)
        self._sums.pop(run_id, None)
        self._due.pop(run_id, None)

    def statistics(self) -> dict[str, Any]:
        """Runs with calls in their window, and scorings delayed so far."""
        return {
            "runs": len(self._spent),
            "waiting": len(self._due),
            "delayed": self.delayed,
            "limit_per_window": self.limit,
        }


__all__ = [
    "MAX_JUDGE_CALLS_PER_RUN_MINUTE",
    "MAX_JUDGE_CALLS_PER_STEP",
    "WINDOW_S",
    "CallRate",
    "WorkRefused",
    "calls_per_scoring",
    "check_start",
]
