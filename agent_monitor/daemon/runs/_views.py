"""What the monitor shows of its live runs: copies for health checks, tests and boards, and the
sources' view."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...calibration import Family, Point
from ...groups import UniformJSON
from ...progress import Progress, Signal, Usage
from ._book import RunState
from ._scoring import RunScoring


@dataclass(frozen=True, slots=True)
class StepView:
    """One step of a live run as scored: its text after the rubric's extractors, and how many
    frames it has."""

    index: int
    text: str
    placeholder: bool
    frames: int


@dataclass(frozen=True, slots=True)
class RunView:
    """A live run as the monitor has it now (for health checks, tests and boards): a copy, safe
    to keep."""

    run_id: str
    task: str
    steps: tuple[StepView, ...]
    """The run's steps in order, placeholders for missing ones included."""
    held: tuple[int, ...]
    """Indexes of steps waiting for earlier ones."""
    scored: int
    """Steps covered by the newest score."""
    signal: Signal
    latest: Progress | None
    last_ok: Progress | None
    curve: tuple[Progress, ...]
    """The newest results (the tracker's `curve_window`); the run store keeps every one."""
    ended: bool
    last_event: float
    labels: Mapping[str, str] = field(default_factory=dict)
    """The start's labels (a copy)."""

    @classmethod
    def of(cls, run_id: str, state: RunState, s: RunScoring) -> RunView:
        """A copy of one live run's state and scores."""
        return cls(
            run_id=run_id,
            task=state.start.task,
            steps=tuple(
                StepView(t.index, t.text, t.index in state.placeholders, len(t.frames))
                for t in s.tracker.steps
            ),
            held=tuple(sorted(state.held)),
            scored=s.scored,
            signal=s.signal,
            latest=s.tracker.latest,
            last_ok=s.last_ok,
            curve=tuple(s.tracker.curve),
            ended=state.ended is not None,
            last_event=state.last_event,
            labels=dict(s.labels),
        )


@dataclass(frozen=True, slots=True)
class LiveRuns:
    """The `RunsView` a source reads: a live run's signal and newest result."""

    runs: Mapping[str, RunScoring]
    uniform_of: Callable[[str], UniformJSON | None] = lambda run_id: None
    """The early call of a run's group (the group book's `uniform_of`)."""

    def uniform(self, run_id: str) -> UniformJSON | None:
        """The early all_fail / all_pass call of a live run's group, or None (ungrouped, or no
        call)."""
        return self.uniform_of(run_id)

    def is_live(self, run_id: str) -> bool:
        """Whether the run is live here."""
        return run_id in self.runs

    def signal(self, run_id: str) -> Signal | None:
        """The run's current signal, or None."""
        s = self.runs.get(run_id)
        return s.signal if s is not None else None

    def latest(self, run_id: str) -> Progress | None:
        """The run's newest result, or None."""
        s = self.runs.get(run_id)
        return s.tracker.latest if s is not None else None

    def step_meta(self, run_id: str) -> tuple[Mapping[str, Any], ...] | None:
        """The `meta` of each step of the run, in order (a source recovering what it sent), or
        None."""
        s = self.runs.get(run_id)
        return tuple(t.meta for t in s.tracker.steps) if s is not None else None

    def step_texts(self, run_id: str) -> tuple[str, ...] | None:
        """The text of each step of the run, in order (a source moving its steps to another run),
        or None."""
        s = self.runs.get(run_id)
        return tuple(t.text for t in s.tracker.steps) if s is not None else None

    def points(self, run_id: str) -> tuple[Point, ...] | None:
        """Every result of the run as (step, score, uncertainty), in step order, or None when not
        live."""
        s = self.runs.get(run_id)
        return s.tracker.points if s is not None else None

    def family(self, run_id: str) -> Family | None:
        """The run's calibration key (family, judge model, rubric hash), or None when not live."""
        s = self.runs.get(run_id)
        return s.tracker.family if s is not None else None


def run_series(
    live: Mapping[str, RunState],
    runs: Mapping[str, RunScoring],
    finished: Callable[[], Iterable[RunSeries]],
) -> list[RunSeries]:
    """What the per-run gauges show: the live runs, then the runs ended within the grace period
    (reads copies)."""
    now = dict(live)
    out = [
        series_of(rid, s.labels, s.tracker.latest, s.last_ok, s.signal, now[rid].last_event)
        for rid, s in list(runs.items())
        if rid in now
    ]
    shown = {r.run_id for r in out}
    return out + [r for r in finished() if r.run_id not in shown]


@dataclass(frozen=True, slots=True)
class RunSeries:
    """What the per-run gauges show of one run: its latest score, step and signal."""

    run_id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    progress: float | None = None
    uncertainty: float | None = None
    spread: float | None = None
    step: int = 0
    signal: str = "continue"
    last_event: float = 0.0
    tokens: Usage = field(default_factory=Usage)
    """The run's judge tokens over every scoring so far."""
    cost: float | None = None
    """What they cost in USD (None without prices)."""


def series_of(
    run_id: str,
    labels: Mapping[str, str],
    latest: Progress | None,
    last_ok: Progress | None,
    signal: str,
    at: float,
) -> RunSeries:
    """A run's per-run gauges; the curve keeps the last good score through a failed scoring (no
    false gap)."""
    return RunSeries(
        run_id=run_id,
        labels=labels,
        progress=last_ok.score if last_ok else None,
        uncertainty=last_ok.uncertainty if last_ok else None,
        spread=last_ok.spread if last_ok else None,
        step=latest.step if latest else 0,
        signal=signal,
        last_event=at,
        tokens=latest.totals if latest else Usage(),
        cost=latest.cost if latest else None,
    )


@dataclass(frozen=True, slots=True)
class FamilySeries:
    """What the calibration gauges show of one family (with its judge model and rubric)."""

    family: Family
    successes: int
    threshold: float | None
    """Under the monitor's default policy and alpha; None until the family is calibrated."""
    last_at: float
