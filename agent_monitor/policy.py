"""Run policy: turn a run's scores into continue / abort / resample, edge-triggered and fail-open."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .progress import Decision, Progress, Signal


class PolicyError(ValueError):
    """A policy setting that is unknown or out of range."""


@dataclass(frozen=True, slots=True)
class Policy:
    """Thresholds for one run's signals (None turns a signal off).

    - abort: the score stayed below `abort_below` for `patience` scored steps in
      a row, after `min_steps`. Abort is final for the run.
    - resample: the score is below `resample_below`, or has fallen by at least
      `regression` from the run's best; back to continue when neither holds.
    - A score with `uncertainty` above `max_uncertainty` neither counts toward
      nor breaks a streak: a low but very uncertain score must not abort a run.
    - A failed judge call changes nothing (fail-open): no abort from an outage.
    """

    abort_below: float | None = field(default=None, metadata={"help": "abort when the score stays below this"})
    resample_below: float | None = field(default=None, metadata={"help": "resample when the score is below this"})
    min_steps: int = field(default=3, metadata={"help": "no abort or resample before this step"})
    patience: int = field(default=3, metadata={"help": "scored steps in a row below abort-below before abort"})
    regression: float | None = field(
        default=None, metadata={"help": "resample on a fall this large from the run's best score"}
    )
    max_uncertainty: float = field(
        default=0.35, metadata={"help": "scores more uncertain than this neither count toward nor break a streak"}
    )

    def __post_init__(self) -> None:
        for name in ("abort_below", "resample_below", "regression"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0):
                raise PolicyError(f"policy {name}={v!r}: use a number in [0, 1], or leave it out")
        if not (isinstance(self.min_steps, int) and self.min_steps >= 0):
            raise PolicyError(f"policy min_steps={self.min_steps!r}: use an integer >= 0")
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise PolicyError(f"policy patience={self.patience!r}: use an integer >= 1")
        if not (isinstance(self.max_uncertainty, (int, float)) and 0.0 <= self.max_uncertainty <= 1.0):
            raise PolicyError(f"policy max_uncertainty={self.max_uncertainty!r}: use a number in [0, 1]")

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> Policy:
        """This policy with some settings replaced (e.g. a run's `start.policy`); unknown keys are an error."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise PolicyError(f"unknown policy setting(s) {unknown}; known: {sorted(known)}")
        values = dict(overrides)
        for key in ("min_steps", "patience"):
            if isinstance(values.get(key), float) and values[key].is_integer():
                values[key] = int(values[key])
        return dataclasses.replace(self, **values)

    def as_dict(self) -> dict[str, Any]:
        """The settings, for signal messages."""
        return dataclasses.asdict(self)


class PolicyState:
    """One run's policy memory: best score so far, the low-score streak, the current signal."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.signal: Signal = "continue"
        self.reason = "start"
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.low_streak = 0

    def observe(self, p: Progress) -> Decision:
        """Fold one result (in step order) into the state and decide."""
        before = self.signal
        pol = self.policy
        if self.signal == "abort":
            pass  # final: the harness has been told to stop
        elif not p.ok or p.score is None:
            self.reason = f"judge failed ({p.reason}); keeping {self.signal}"
        else:
            score = p.score
            if self.best_score is None or score > self.best_score:
                self.best_score, self.best_step = score, p.step
            certain = p.uncertainty is None or p.uncertainty <= pol.max_uncertainty
            if p.step < pol.min_steps:
                self.signal, self.reason = "continue", f"step {p.step} < min_steps {pol.min_steps}"
            elif not certain:
                self.reason = f"score {score:.2f} too uncertain (±{p.uncertainty:.2f}); keeping {self.signal}"
            else:
                if pol.abort_below is not None and score < pol.abort_below:
                    self.low_streak += 1
                else:
                    self.low_streak = 0
                self.signal, self.reason = self._decide(score)
        return Decision(
            signal=self.signal,
            reason=self.reason,
            step=p.step,
            score=p.score,
            best_step=self.best_step,
            best_score=self.best_score,
            changed=self.signal != before,
        )

    def _decide(self, score: float) -> tuple[Signal, str]:
        pol = self.policy
        if pol.abort_below is not None and self.low_streak >= pol.patience:
            return "abort", f"score below {pol.abort_below} for {self.low_streak} scored steps"
        if pol.resample_below is not None and score < pol.resample_below:
            return "resample", f"score {score:.2f} below {pol.resample_below}"
        if pol.regression is not None and self.best_score is not None and self.best_score - score >= pol.regression:
            return "resample", f"score fell {self.best_score - score:.2f} from its best at step {self.best_step}"
        return "continue", "on track"
