"""Robot progress metrics over scored episodes: VOC and success-detection AUROC, with bootstrap
intervals.

VOC (value-order correlation, as GVL and TOPReward define it) is Spearman's rank correlation between
the predicted progress after each step and the step's order in time, averaged over the successful
episodes (a successful episode's progress should rise). Success-detection AUROC ranks episodes by
their score at the end against their outcome. Both come with a percentile bootstrap interval over
episodes (resampled with replacement, a seeded generator so a report is reproducible).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .evaluate import RunCurve, auroc, spearman

__all__ = [
    "Interval",
    "RobotMetrics",
    "end_auroc",
    "robot_json",
    "robot_metrics",
    "robot_summary",
    "voc",
]

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate with its bootstrap interval (None when there is too little data)."""

    value: float | None
    low: float | None
    high: float | None
    n: int
    """How many episodes the estimate uses."""


@dataclass(frozen=True, slots=True)
class RobotMetrics:
    """VOC over successful episodes and success-detection AUROC at the end of an episode."""

    voc: Interval
    end_auroc: Interval


def _episode_voc(curve: RunCurve) -> float | None:
    pts = [(i, s) for i, s in enumerate(curve.scores, 1) if s is not None]
    return spearman([float(i) for i, _ in pts], [s for _, s in pts])


def voc(curves: Sequence[RunCurve]) -> float | None:
    """Mean Spearman between progress and frame order over successful episodes (None: none has
    two scores)."""
    values = [v for c in curves if c.success and (v := _episode_voc(c)) is not None]
    return sum(values) / len(values) if values else None


def _last_score(curve: RunCurve) -> float | None:
    if len(curve.scores) < curve.steps:
        return None  # scored only up to --max-steps: its last score is not the run's end
    return next((s for s in reversed(curve.scores) if s is not None), None)


def end_auroc(curves: Sequence[RunCurve]) -> float | None:
    """AUROC of the last good score against success, over episodes with a known outcome (None:
    one class)."""
    pairs = [
        (s, bool(c.success))
        for c in curves
        if c.success is not None and (s := _last_score(c)) is not None
    ]
    return auroc([s for s, _ in pairs], [y for _, y in pairs])


def _bootstrap(
    curves: Sequence[RunCurve],
    stat: Callable[[Sequence[RunCurve]], float | None],
    resamples: int,
    level: float,
    seed: int,
) -> tuple[float | None, float | None]:
    if len(curves) < 2:
        return None, None
    rng = random.Random(seed)
    values = sorted(
        v
        for _ in range(resamples)
        if (v := stat([curves[rng.randrange(len(curves))] for _ in curves])) is not None
    )
    if not values:
        return None, None
    tail = (1 - level) / 2
    return values[int(tail * (len(values) - 1))], values[round((1 - tail) * (len(values) - 1))]


def robot_metrics(
    curves: Sequence[RunCurve],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> RobotMetrics:
    """VOC and end-of-episode AUROC over scored episodes, each with a `level` percentile
    bootstrap interval."""
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(
            f"resamples={resamples}, level={level}; use resamples >= 1 and 0 < level < 1"
        )
    successes = [c for c in curves if c.success]
    known = [c for c in curves if c.success is not None]
    return RobotMetrics(
        voc=Interval(
            voc(successes), *_bootstrap(successes, voc, resamples, level, seed), n=len(successes)
        ),
        end_auroc=Interval(
            end_auroc(known), *_bootstrap(known, end_auroc, resamples, level, seed), n=len(known)
        ),
    )


def _fmt(iv: Interval) -> str:
    if iv.value is None:
        return f"n/a (n={iv.n})"
    ci = "" if iv.low is None or iv.high is None else f" [{iv.low:.2f}, {iv.high:.2f}]"
    return f"{iv.value:.2f}{ci} (n={iv.n})"


def robot_summary(m: RobotMetrics) -> str:
    """One line: VOC over successful runs and AUROC at the end, with their 95% bootstrap
    intervals (over runs)."""
    return (
        "Progress metrics (robot episodes or agent runs; 95% bootstrap over runs): VOC "
        f"{_fmt(m.voc)}; success "
        f"AUROC at the run's end {_fmt(m.end_auroc)} (runs scored to their end only)"
    )


def robot_json(m: RobotMetrics) -> dict[str, Any]:
    """The metrics as JSON-ready data (eval.json's "robot")."""
    return {"voc": asdict(m.voc), "end_auroc": asdict(m.end_auroc)}
