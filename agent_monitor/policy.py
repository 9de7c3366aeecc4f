"""Run policy: turn a run's scores into continue / abort / resample, edge-triggered and
fail-open."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from .progress import Decision, Progress, Signal

AUTO: Literal["auto"] = "auto"
"""`abort_below="auto"`: the threshold comes from calibration on the family's finished runs."""
DEFAULT_ALPHA = 0.05
"""The default bound on the share of successful runs an "auto" threshold may abort."""
DEFAULT_HOLDOUT = 0.1
"""The default share of "auto" runs never aborted by the calibrated rule, so that they keep
teaching it."""
Schedule = Literal["every", "adaptive"]
"""When a run's steps are scored: every step (coalescing aside), or where a decision could change
(see `plan`)."""
SCHEDULES: tuple[Schedule, ...] = ("every", "adaptive")
DEFAULT_MAX_GAP = 4
"""Under the adaptive schedule: the most steps a run goes without a scoring."""
DEFAULT_MARGIN = 2.0
"""Under the adaptive schedule: how near a threshold (in units of the last score's uncertainty) a
run is scored."""
MIN_UNCERTAINTY = 0.05
"""The least uncertainty the margin is measured in: a judge sure of this step's letter is not
sure of the next."""
STEP_BUDGET = "step_budget"
"""How an abort by the step budget (`max_steps`) begins its reason."""
DONE = "done"
"""How a `done` signal begins its reason."""
FAR = "far from thresholds"
"""Why the adaptive schedule skipped a step (the one reason: a decision could not change there)."""


class PolicyError(ValueError):
    """A policy setting that is unknown or out of range."""


class AbortThreshold(Protocol):
    """What a run's policy reads of a calibrated abort threshold (`calibration.Threshold` is one).

    A protocol, not an import: calibration learns from policies, so it imports this module, never
    the reverse.
    """

    @property
    def value(self) -> float | None:
        """The threshold (None: the rule aborts nothing)."""

    @property
    def reason(self) -> str:
        """Where the threshold comes from, for signals and logs."""


@dataclass(frozen=True, slots=True)
class Policy:
    """Thresholds for one run's signals (None turns a signal off).

    - abort: the score stayed below `abort_below` for `patience` scored steps in
      a row, after `min_steps`. Abort is final for the run. `abort_below="auto"`
      takes the threshold from calibration (`agent_monitor.calibration`): the
      highest one that aborts at most a share `alpha` of the family's successful
      runs, and none until enough of them have ended.
    - resample: the score is below `resample_below`, or has fallen by at least
      `regression` from the run's best; back to continue when neither holds.
    - A score with `uncertainty` above `max_uncertainty` neither counts toward
      nor breaks a streak: a low but very uncertain score must not abort a run.
    - group (a run started with `start.group`, or a `GroupTracker`'s): prune a live run whose
      score stays more than `prune_margin` below the `keep_top`-th best live sibling for
      `patience` scored steps after `min_steps` (beyond both runs' uncertainty); never below
      `keep_top` live runs. `compare` orders leaders pointwise scores cannot separate by pairwise
      judge calls. A group whose runs' calibrated calls all say fail (or all say pass) with
      `uniform_confidence` is flagged on its ranking (`agent_monitor.calibration`, docs/groups.md).
    - A failed judge call changes nothing (fail-open): no abort from an outage.
    - schedule: "every" scores each step (coalescing aside); "adaptive" only where a decision could
      change (`plan`: within `margin` uncertainties of a threshold in force, or below an abort
      threshold; every `max_gap` steps; at the end), the other steps folding into the next scoring;
      with `repeats_near`, the repeats only near a threshold. See docs/schedule.md.
    """

    abort_below: float | Literal["auto"] | None = field(
        default=None,
        metadata={
            "help": "abort when the score stays below this; 'auto': the calibrated "
            "threshold (see alpha)"
        },
    )
    resample_below: float | None = field(
        default=None, metadata={"help": "resample when the score is below this"}
    )
    min_steps: int = field(default=3, metadata={"help": "no abort or resample before this step"})
    patience: int = field(
        default=3, metadata={"help": "scored steps in a row below abort-below before abort"}
    )
    regression: float | None = field(
        default=None, metadata={"help": "resample on a fall this large from the run's best score"}
    )
    max_uncertainty: float = field(
        default=0.35,
        metadata={
            "help": "scores more uncertain than this neither count toward nor break a streak"
        },
    )
    alpha: float = field(
        default=DEFAULT_ALPHA,
        metadata={
            "help": "with abort-below auto: the most successful runs of a family it "
            "may abort (a share)"
        },
    )

    max_steps: int | Literal["auto"] | None = field(
        default=None,
        metadata={
            "flag": "--step-budget",
            "help": "abort a run past this many steps (reason step_budget); 'auto': per "
            "family, the step count a "
            "new success passes with probability <= alpha (split conformal on the successes' "
            "lengths)",
        },
    )
    done_above: float | Literal["auto"] | None = field(
        default=None,
        metadata={
            "help": "signal done when the score stays above this for patience scored steps; "
            "'auto': the threshold "
            "a new failing run passes with probability <= alpha (calibrated on the family's "
            "failures)"
        },
    )

    holdout: float = field(
        default=DEFAULT_HOLDOUT,
        metadata={
            "help": "with abort-below auto: the share of runs (chosen by run id) it never "
            "aborts; their outcomes "
            "keep teaching the calibration without bias"
        },
    )

    keep_top: int = field(
        default=1,
        metadata={
            "help": "in a group (start.group): never prune below this many live runs; "
            "the k of 'k-th best'"
        },
    )
    prune_margin: float | None = field(
        default=None,
        metadata={
            "help": "in a group: prune a run whose score stays more than this below the "
            "keep-top-th best live "
            "sibling for patience scored steps (and beyond both runs' uncertainty); none: "
            "never prune"
        },
    )
    compare: bool = field(
        default=False,
        metadata={
            "help": "in a group: when the leaders' scores are within their uncertainty, rank "
            "them by pairwise "
            "judge comparisons (pivot tournament; costs judge calls)"
        },
    )
    uniform_confidence: float | None = field(
        default=0.9,
        metadata={
            "help": "in a group: flag it on its ranking as all_fail or all_pass (no outcome "
            "variance: an RL trainer "
            "can cancel it) once the calibrated calls of all its runs give this confidence; "
            "none: never flag"
        },
    )
    schedule: Schedule = field(
        default="every",
        metadata={
            "help": "when to score a step: every (each step, coalescing aside) or adaptive "
            "(only where a decision "
            "could change: near a threshold, every max-gap steps, at the end; the rest fold "
            "into the next scoring)"
        },
    )
    max_gap: int = field(
        default=DEFAULT_MAX_GAP,
        metadata={"help": "with schedule adaptive: the most steps a run goes without a scoring"},
    )
    margin: float = field(
        default=DEFAULT_MARGIN,
        metadata={
            "help": "with schedule adaptive: score when the last score is within this many "
            "uncertainties of a "
            "threshold in force (below an abort threshold: always)"
        },
    )
    repeats_near: bool = field(
        default=True,
        metadata={
            "help": "with schedule adaptive: spend the repeats only near a threshold (one "
            "repeat elsewhere); "
            "false: every scoring gets them"
        },
    )

    def __post_init__(self) -> None:
        for name in ("abort_below", "resample_below", "regression", "prune_margin", "done_above"):
            v = getattr(self, name)
            auto = name in ("abort_below", "done_above")
            if auto and v == AUTO:
                continue
            if v is not None and (
                isinstance(v, bool)
                or not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0)
            ):
                raise PolicyError(
                    f"policy {name}={v!r}: use a number in [0, 1]"
                    + (', or "auto"' if auto else "")
                    + ", or leave it out"
                )
        b = self.max_steps
        if (
            b is not None
            and b != AUTO
            and (isinstance(b, bool) or not (isinstance(b, int) and b >= 1))
        ):
            raise PolicyError(
                f'policy max_steps={b!r}: use an integer >= 1 (steps), "auto", or leave it out'
            )
        if isinstance(self.min_steps, bool) or not (
            isinstance(self.min_steps, int) and self.min_steps >= 0
        ):
            raise PolicyError(f"policy min_steps={self.min_steps!r}: use an integer >= 0")
        if isinstance(self.patience, bool) or not (
            isinstance(self.patience, int) and self.patience >= 1
        ):
            raise PolicyError(f"policy patience={self.patience!r}: use an integer >= 1")
        mu = self.max_uncertainty
        if isinstance(mu, bool) or not (isinstance(mu, (int, float)) and 0.0 <= mu <= 1.0):
            raise PolicyError(
                f"policy max_uncertainty={self.max_uncertainty!r}: use a number in [0, 1]"
            )
        a = self.alpha
        if isinstance(a, bool) or not (isinstance(a, (int, float)) and 0.0 < a < 1.0):
            raise PolicyError(
                f"policy alpha={a!r}: use a number between 0 and 1 (exclusive), "
                f"e.g. {DEFAULT_ALPHA}"
            )

        h = self.holdout
        if isinstance(h, bool) or not (isinstance(h, (int, float)) and 0.0 <= h < 1.0):
            raise PolicyError(
                f"policy holdout={h!r}: use a share in [0, 1), e.g. {DEFAULT_HOLDOUT}"
            )

        k = self.keep_top
        if isinstance(k, bool) or not (isinstance(k, int) and k >= 1):
            raise PolicyError(
                f"policy keep_top={k!r}: use an integer >= 1 (the live runs a group always keeps)"
            )
        u = self.uniform_confidence
        if u is not None and (
            isinstance(u, bool) or not (isinstance(u, (int, float)) and 0.0 < u < 1.0)
        ):
            raise PolicyError(
                f"policy uniform_confidence={u!r}: use a number between 0 and 1 (exclusive), "
                "e.g. 0.9, or none"
            )
        if not isinstance(self.compare, bool):
            raise PolicyError(f"policy compare={self.compare!r}: use true or false")
        if self.schedule not in SCHEDULES:
            raise PolicyError(
                f"policy schedule={self.schedule!r}: use one of {', '.join(SCHEDULES)}"
            )
        g = self.max_gap
        if isinstance(g, bool) or not (isinstance(g, int) and 1 <= g <= 1000):
            raise PolicyError(
                f"policy max_gap={g!r}: use an integer from 1 to 1000 (steps between scorings)"
            )
        m = self.margin
        if isinstance(m, bool) or not (
            isinstance(m, (int, float)) and math.isfinite(m) and m >= 0.0
        ):
            raise PolicyError(
                f"policy margin={m!r}: use a finite number >= 0 "
                f"(uncertainties), e.g. {DEFAULT_MARGIN}"
            )
        if not isinstance(self.repeats_near, bool):
            raise PolicyError(f"policy repeats_near={self.repeats_near!r}: use true or false")

    @property
    def auto(self) -> bool:
        """The abort threshold comes from calibration."""
        return self.abort_below == AUTO

    @property
    def every_step(self) -> bool:
        """Every step is scored (the "every" schedule), not only where a decision could change
        ("adaptive")."""
        return self.schedule == "every"

    def alphas(self) -> Alphas:
        """The share of successes each calibrated abort rule may stop: alpha, split evenly when both
        are "auto".

        Two rules each at alpha/2 stop a success with probability <= alpha together (a union bound).
        """
        both = self.auto and self.max_steps == AUTO
        share = self.alpha / 2 if both else self.alpha
        return Alphas(abort=share, budget=share)

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> Policy:
        """This policy with some settings replaced (e.g. a run's `start.policy`); unknown keys
        are an error."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise PolicyError(f"unknown policy setting(s) {unknown}; known: {sorted(known)}")
        values = dict(overrides)
        for key in ("min_steps", "patience", "keep_top", "max_gap", "max_steps"):
            if isinstance(values.get(key), float) and values[key].is_integer():
                values[key] = int(values[key])
        return dataclasses.replace(self, **values)

    def as_dict(self) -> dict[str, Any]:
        """The settings, for signal messages."""
        return dataclasses.asdict(self)


class Alphas(NamedTuple):
    """The alpha each calibrated abort rule of a policy uses (see `Policy.alphas`)."""

    abort: float
    budget: float


def with_levels(policy: Policy, levels: Mapping[str, Any], *, keep: Iterable[str] = ()) -> Policy:
    """`policy` with a rubric's threshold levels (see `criteria.map_thresholds`) where the policy
    leaves them open.

    A setting is the policy's own, and wins over the rubric's level, when it differs from
    `Policy()`'s default or is named in `keep` (settings chosen explicitly, even at their default
    value: `serve --abort-below none` keeps aborts off whatever a rubric says).
    """
    if not levels:
        return policy
    kept, default = set(keep), Policy()
    take = {
        k: v
        for k, v in levels.items()
        if k not in kept and getattr(policy, k) == getattr(default, k)
    }
    return dataclasses.replace(policy, **take) if take else policy


def resolve(policy: Policy | Mapping[str, Any] | None, levels: Mapping[str, Any]) -> Policy | None:
    """A run's policy from what the caller gave and its rubric's threshold levels (the caller's
    settings win).

    A mapping's keys win (`{"abort_below": None}` turns a rubric's abort level off); a Policy's
    settings win where they differ from the defaults; None takes the rubric's levels, and is no
    policy when it has none.
    """
    if isinstance(policy, Mapping):
        return with_levels(Policy(), levels).with_overrides(policy)
    if policy is None:
        return with_levels(Policy(), levels) if levels else None
    return with_levels(policy, levels)


class PolicyState:
    """One run's policy memory: best score so far, the last counted scores, the current signal.

    With `abort_below="auto"`, `threshold` gives the calibrated threshold in force at each
    observation (it moves as the family's runs end); without it, an "auto" run never aborts.
    A `held_out` run is never aborted by the calibrated rule (its decisions say when it would
    have been): runs that an abort rule could stop have censored outcomes and must not teach
    the calibration (`exposed`), so held-out runs are what keeps it learning without bias.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        threshold: Callable[[], AbortThreshold] | None = None,
        held_out: bool = False,
        budget: Callable[[], AbortThreshold] | None = None,
        done: Callable[[], AbortThreshold] | None = None,
    ) -> None:
        self.policy = policy
        self.every_step = policy.every_step
        """The schedule scores every step (read on each step's path: an attribute, not a call)."""
        self.threshold = threshold
        self.budget = budget
        """With `max_steps="auto"`: the calibrated step budget in force (None: an "auto" budget
        stops nothing)."""
        self.done = done
        """With `done_above="auto"`: the calibrated done threshold in force (None: never done)."""
        self.held_out = held_out and (policy.auto or policy.max_steps == AUTO)
        self.signal: Signal = "continue"
        self.reason = "start"
        self.best_score: float | None = None
        self.best_step: int | None = None
        # The last `patience` scores the streak counts: abort when all are below the threshold in
        # force. With a fixed threshold that is exactly "a streak of `patience`"; with a moving one
        # it uses today's threshold.
        self.recent: deque[float] = deque(maxlen=policy.patience)
        self.counted = 0
        """Scores the streak counted so far (a calibrated threshold depends on the run's length
        stratum)."""
        fixed = policy.abort_below
        self.abort_below: float | None = float(fixed) if isinstance(fixed, (int, float)) else None
        """The abort threshold in force at the last observation (None: this rule aborts nothing)."""
        self.calibration: str | None = None
        """Where an "auto" threshold came from ("calibrated on 23 successful runs, alpha 0.05"),
        else None."""
        cap = policy.max_steps
        self.max_steps: int | None = cap if isinstance(cap, int) else None
        """The step budget in force at the last observation (None: no budget)."""
        self.budget_reason: str | None = None
        """Where an "auto" budget came from, else None."""
        done_at = policy.done_above
        self.done_above: float | None = (
            float(done_at) if isinstance(done_at, (int, float)) else None
        )
        """The done threshold in force at the last observation (None: never done)."""
        self.done_reason: str | None = None
        self.exposed = self.abort_below is not None or self.max_steps is not None
        """An abort rule could have stopped this run: its outcome is censored, so it must not
        teach calibration."""

    def refresh(self) -> None:
        """Read the calibrated threshold in force now (a fixed threshold: nothing to read)."""
        self._refresh()

    def _refresh(self) -> None:
        pol = self.policy
        if pol.max_steps == AUTO:
            if self.budget is None:
                self.max_steps, self.budget_reason = None, "no calibration attached; no step budget"
            else:
                b = self.budget()
                self.max_steps = None if b.value is None else int(b.value)
                self.budget_reason = b.reason
                if b.value is not None and not self.held_out:
                    self.exposed = True
        if pol.done_above == AUTO:
            if self.done is None:
                self.done_above, self.done_reason = None, "no calibration attached; never done"
            else:
                d = self.done()
                self.done_above, self.done_reason = d.value, d.reason
        if not pol.auto:
            return
        if self.threshold is None:
            self.abort_below, self.calibration = None, "no calibration attached; never aborts"
            return
        th = self.threshold()
        self.abort_below, self.calibration = th.value, th.reason
        if th.value is not None and not self.held_out:
            self.exposed = True

    def observe(self, p: Progress) -> Decision:
        """Fold one result (in step order) into the state and decide."""
        before = self.signal
        pol = self.policy
        self._refresh()
        cap = self.max_steps
        if self.signal == "abort":
            pass  # final: the harness has been told to stop
        elif cap is not None and p.step > cap:
            # A step count needs no judge: the budget stops a run even while the judge fails.
            why = f"step {p.step} past the step budget of {cap}" + (
                f" ({self.budget_reason})" if self.budget_reason else ""
            )
            if self.held_out:
                self.reason = f"held out: would abort ({STEP_BUDGET}: {why}); keeping {self.signal}"
            else:
                self.signal, self.reason = "abort", f"{STEP_BUDGET}: {why}"
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
                self.reason = (
                    f"score {score:.2f} too uncertain (±{p.uncertainty:.2f}); keeping {self.signal}"
                )
            else:
                self.recent.append(score)
                self.counted += 1
                self.signal, self.reason = self._decide(score)
        return Decision(
            signal=self.signal,
            reason=self.reason,
            step=p.step,
            score=p.score,
            best_step=self.best_step,
            best_score=self.best_score,
            changed=self.signal != before,
            abort_below=self.abort_below,
            calibration=self.calibration,
        )

    def _decide(self, score: float) -> tuple[Signal, str]:
        pol = self.policy
        t = self.abort_below
        if t is not None and len(self.recent) == pol.patience and max(self.recent) < t:
            why = f"score below {t:.4g} for {pol.patience} scored steps"
            if self.held_out:
                return "continue", (
                    f"held out: would abort ({why}, {self.calibration}); one of the "
                    f"{pol.holdout:.0%} of runs "
                    "left running so their outcomes keep the calibration unbiased"
                )
            return "abort", f"{why} ({self.calibration})" if self.calibration else why
        d = self.done_above
        if d is not None and len(self.recent) == pol.patience and min(self.recent) > d:
            why = f"score above {d:.4g} for {pol.patience} scored steps"
            return (
                "done",
                f"{DONE}: {why} ({self.done_reason})" if self.done_reason else f"{DONE}: {why}",
            )
        if pol.resample_below is not None and score < pol.resample_below:
            return "resample", f"score {score:.2f} below {pol.resample_below}"
        if (
            pol.regression is not None
            and self.best_score is not None
            and self.best_score - score >= pol.regression
        ):
            return "resample", (
                f"score fell {self.best_score - score:.2f} from its best at step {self.best_step}"
            )
        return "continue", "on track"


@dataclass(frozen=True, slots=True)
class Plan:
    """Whether to score a run's newest step now, why (or why not), and whether to spend the
    repeats."""

    score: bool
    reason: str
    """Why it is scored ("every step", "near abort_below 0.40", "max_gap 4", "end", "first", "after
    a failure") or why not (`FAR`)."""
    full: bool = True
    """Spend the repeats (near a threshold, or schedule every); False: one cheap repeat."""


EVERY = Plan(True, "every step")
TEACHING = Plan(True, "teaching: calibration learns from every step")


def lines_in_force(
    state: PolicyState, extra: Mapping[str, float | None] | None = None
) -> dict[str, float]:
    """The thresholds a run's next score could cross, by name: abort, resample, regression from
    best, and `extra`.

    `extra` holds lines the policy state does not know: a group's pruning line (`prune`), for one.
    """
    pol = state.policy
    out: dict[str, float] = {}
    if state.abort_below is not None:
        out["abort_below"] = state.abort_below
    if pol.resample_below is not None:
        out["resample_below"] = pol.resample_below
    if pol.regression is not None and state.best_score is not None:
        out["regression"] = state.best_score - pol.regression
    for k, v in (extra or {}).items():
        if v is not None:
            out[k] = v
    return out


def plan(
    state: PolicyState,
    step: int,
    *,
    last: Progress | None,
    last_step: int,
    ending: bool = False,
    extra: Mapping[str, float | None] | None = None,
) -> Plan:
    """Under `policy.schedule`, whether step `step` is scored or folded into a later scoring (as
    coalescing folds).

    `last` is the run's newest in-order result and `last_step` the newest step scored (0: none).
    Under "adaptive" a step is scored when the last score is within `margin` uncertainties of a
    threshold in force (`lines_in_force`; at or below an abort threshold always, while a streak may
    be building), when `max_gap` steps passed since the last scoring, at the run's end, at its first
    step and after a failed scoring (fail-open: a failure is never a reason to wait); otherwise not
    (`FAR`). A skipped step is not lost: the next scoring reads the prefix that includes it. An
    "auto" run whose outcome will teach the calibration (none armed yet, or held out) is scored at
    every step: the calibrated bound is about the every-step rule, and an adaptive abort is always
    an every-step abort at the same step.
    """
    pol = state.policy
    if pol.every_step:
        return EVERY
    state.refresh()
    if state.max_steps is not None and step > state.max_steps and state.signal != "abort":
        # the budget's abort needs an observation
        return Plan(True, f"past {STEP_BUDGET} {state.max_steps}", False)
    if ending:
        return Plan(True, "end", _full(pol, state, last, extra))
    if pol.auto and not state.exposed:
        # Its outcome will teach the calibration (no threshold armed yet, or held out): the bound is
        # about the every-step rule (an adaptive abort is an every-step abort at the same step, see
        # docs/calibration.md), so the runs that teach are scored at every step, with every repeat.
        return TEACHING
    if last is None or last_step == 0:
        return Plan(True, "first", True)
    if not last.ok or last.score is None:
        return Plan(True, "after a failure", True)
    near = _near(pol, state, last, extra)
    if near is not None:
        return Plan(True, near, True)
    if step - last_step >= pol.max_gap:
        return Plan(True, f"max_gap {pol.max_gap}", not pol.repeats_near)
    return Plan(False, FAR, False)


def _near(
    pol: Policy, state: PolicyState, last: Progress, extra: Mapping[str, float | None] | None
) -> str | None:
    """The threshold the last score is near (or, for an abort threshold, below), or None."""
    assert last.score is not None
    s = last.score
    band = pol.margin * max(last.uncertainty or 0.0, MIN_UNCERTAINTY)
    for name, line in lines_in_force(state, extra).items():
        # Below an abort threshold (or a pruning line) the streak is building: every step counts
        # toward it.
        one_sided = name in ("abort_below", "prune")
        if (s < line + band) if one_sided else abs(s - line) <= band:
            return f"near {name} {line:.3g}"
    return None


def _full(
    pol: Policy, state: PolicyState, last: Progress | None, extra: Mapping[str, float | None] | None
) -> bool:
    if not pol.repeats_near or last is None or not last.ok or last.score is None:
        return True
    return _near(pol, state, last, extra) is not None


def held_out(run_key: str, share: float) -> bool:
    """Whether a run is in the held-out share: chosen by a hash of its id, so independent of how
    it goes."""
    if share <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(run_key.encode()).digest()[:8], "big")
    return h / 2.0**64 < share
