"""Abort thresholds learned from outcomes, with a finite-sample bound on aborted successes (split
conformal).

For a run policy (`min_steps`, `patience`, `max_uncertainty`), a finished run would be aborted at
threshold t exactly when some `patience` consecutive *counted* scores (judged, from step `min_steps`
on, no more uncertain than `max_uncertainty`: the scores the policy's streak counts) all lie below
t. Its **margin** m is the largest t that does not abort it: the minimum over those windows of the
window's maximum (infinite when the run has fewer than `patience` counted scores).

With the margins m_1..m_n of the n successful runs of a family seen so far, the threshold is the
k-th smallest, k = floor(alpha * (n + 1)); when k < 1 (fewer than ceil(1/alpha) - 1 successes) there
is no threshold and nothing is aborted. If a new successful run is exchangeable with those n (same
task family, judge and rubric, in no particular order), its margin's rank among all n + 1 is
uniform, and it is aborted only when its margin is strictly below the k-th smallest of the others,
that is when it is among the k smallest of the n + 1: probability at most k / (n + 1) <= alpha. Ties
only lower that probability. The bound is marginal (averaged over calibration sets), it says nothing
about failing runs, and it breaks when the family's mix of tasks or the judge changes; a family is
therefore keyed by its name, the judge's model and the rubric's hash, and starts from nothing when
any of them changes.

`Calibration` keeps the runs' curves (not their margins), so runs under different policies share
one family's evidence: margins are computed for the policy asking.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .policy import DEFAULT_ALPHA, Policy

if TYPE_CHECKING:
    from .progress import Progress

DEFAULT_SUCCESS_AT = 0.5
"""A numeric outcome at or above this counts as a success."""

DEFAULT_MAX_SAMPLES = 2000
"""Finished runs kept per family (the most recent): bounds memory, and follows a slowly drifting
family."""

DEFAULT_MAX_TOTAL = 50_000
"""Finished runs kept over all families; past it, the family that learnt least recently is
forgotten."""

DEFAULT_STRATA = 1
"""Length strata of the calibration (1: none; runs of a family are taken to be alike in length)."""

_EPS = 1e-9  # alpha * (n + 1) in floating point: 0.29 * 100 must give 29, not 28


class CalibrationError(ValueError):
    """A calibration setting or record that cannot be used."""


def check_alpha(alpha: float) -> float:
    """`alpha` if it is a usable bound (0 < alpha < 1), else a CalibrationError saying what to
    use."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 < alpha < 1.0):
        raise CalibrationError(
            f"alpha={alpha!r}: use a number between 0 and 1 (exclusive), e.g. {DEFAULT_ALPHA}"
        )
    return float(alpha)


def min_successes(alpha: float) -> int:
    """The fewest successful runs with which `alpha` gives a threshold: ceil(1/alpha) - 1 (19 at
    0.05)."""
    alpha = check_alpha(alpha)
    n = max(0, math.ceil(1.0 / alpha - _EPS) - 1)
    while math.floor(alpha * (n + 1) + _EPS) < 1:  # guards the rounding of ceil(1/alpha)
        n += 1
    return n


def outcome_message(run_id: str, started_at: float | None, outcome: object) -> bytes:
    """What an outcome's HMAC signs: the run id, the start's `started_at` and the outcome, one per
    line.

    `started_at` is written with 3 decimals (empty when the start gave none); a string outcome as
    is, a number with 17 significant digits (`%.17g`), so harnesses in any language can compute the
    same text.
    """
    started = "" if started_at is None else f"{float(started_at):.3f}"
    text = outcome if isinstance(outcome, str) else f"{float(outcome):.17g}"  # type: ignore[arg-type]
    return f"{run_id}\n{started}\n{text}".encode()


def outcome_mac(secret: str | bytes, run_id: str, started_at: float | None, outcome: object) -> str:
    """The hex HMAC-SHA256 a harness puts in `end.auth` when the monitor runs with
    `--outcome-secret`."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, outcome_message(run_id, started_at, outcome), hashlib.sha256).hexdigest()


def outcome_authentic(
    secret: str | bytes, run_id: str, started_at: float | None, outcome: object, auth: str | None
) -> bool:
    """Whether `auth` is the outcome's HMAC under `secret` (compared in constant time)."""
    if not auth or outcome is None:
        return False
    return hmac.compare_digest(auth.lower(), outcome_mac(secret, run_id, started_at, outcome))


class Point(NamedTuple):
    """One scored step of a finished run, as calibration needs it."""

    step: int
    score: float | None
    """None: the judge failed (the policy skips it)."""
    uncertainty: float | None


def points(curve: Iterable[Progress]) -> tuple[Point, ...]:
    """A tracker's curve (Progress results in step order) as calibration points."""
    return tuple(
        Point(p.step, p.score if p.ok else None, p.uncertainty if p.ok else None) for p in curve
    )


def counted(curve: Iterable[Point], policy: Policy) -> list[float]:
    """The scores the policy's low-score streak counts, in step order."""
    return [
        p.score
        for p in curve
        if p.score is not None
        and p.step >= policy.min_steps
        and (p.uncertainty is None or p.uncertainty <= policy.max_uncertainty)
    ]


def margin(curve: Iterable[Point], policy: Policy) -> float:
    """The largest abort threshold under which `policy` would not have aborted this run (inf:
    none would)."""
    scores = counted(curve, policy)
    w = policy.patience
    if len(scores) < w:
        return math.inf
    # Sliding-window maximum (monotone deque): O(n) for long runs.
    best = math.inf
    window: list[int] = []
    head = 0
    for i, s in enumerate(scores):
        while len(window) > head and scores[window[-1]] <= s:
            window.pop()
        window.append(i)
        if window[head] <= i - w:
            head += 1
        if i >= w - 1:
            best = min(best, scores[window[head]])
    return best


def run_length(curve: Iterable[Point]) -> int:
    """A finished run's length in steps: its last scored step (the end is always scored)."""
    return max((p.step for p in curve), default=0)


def budget_threshold(lengths: Sequence[int], alpha: float) -> int | None:
    """The step budget: the k-th longest success, k = floor(alpha (n+1)); None when k < 1 (no
    budget).

    A run is stopped once it passes the budget (a step beyond it). A new success exchangeable with
    the n is longer than the k-th longest of them only when it is among the k longest of the n + 1:
    probability <= alpha. The same rank as `conformal_threshold`, on the lengths turned around.
    """
    k = conformal_rank(len(lengths), alpha)
    if k is None:
        return None
    return sorted(lengths, reverse=True)[k - 1]


def done_margin(curve: Iterable[Point], policy: Policy) -> float:
    """The lowest `done` threshold a failing run never held above for `patience` counted scores
    (-inf: none).

    The mirror of `margin`: `done` fires at threshold t when `patience` counted scores in a row are
    all above t, so for a run that is the largest window minimum; a failure is wrongly called done
    at t exactly when t is below it.
    """
    flipped = [Point(p.step, None if p.score is None else -p.score, p.uncertainty) for p in curve]
    return -margin(flipped, policy)


def done_threshold(margins: Sequence[float], alpha: float) -> float | None:
    """The `done` threshold from failing runs' `done_margin`s: the k-th largest (k = floor(alpha
    (n+1))).

    `done` fires when `patience` counted scores in a row lie strictly above it; a new failure
    exchangeable with the n does so only when its margin is among the k largest of the n + 1:
    probability <= alpha. None: too few failures (never done).
    """
    # As for aborts, only finite margins teach (a failure with fewer counted scores than patience
    # says nothing).
    finite = sorted((m for m in margins if math.isfinite(m)), reverse=True)
    k = conformal_rank(len(finite), alpha)
    return None if k is None else min(max(finite[k - 1], 0.0), 1.0)


def stratum(length: int, patience: int, strata: int) -> int:
    """The length stratum of a run with `length` counted scores: [p, 2p) is 0, [2p, 4p) is 1,
    ..., the last open."""
    if strata <= 1 or length < 2 * patience:
        return 0
    return min(strata - 1, (length // patience).bit_length() - 1)


def stratum_range(j: int, patience: int, strata: int) -> str:
    """Stratum `j`'s counted-score range, for reasons and docs."""
    lo = patience << j
    return f"{lo}+" if j >= strata - 1 else f"{lo}-{(patience << (j + 1)) - 1}"


def conformal_rank(n: int, alpha: float) -> int | None:
    """The split-conformal rank k = floor(alpha (n+1)) of n calibration samples; None when k < 1
    (too few).

    The one rule every calibrated decision shares (`abort_below`, the step budget, `done`): a new
    sample exchangeable with the n is among the k most extreme of the n + 1 with probability
    k / (n + 1) <= alpha.
    """
    k = math.floor(check_alpha(alpha) * (n + 1) + _EPS)
    return k if k >= 1 else None


def conformal_threshold(
    margins: Sequence[float], alpha: float, *, presorted: bool = False
) -> float | None:
    """The k-th smallest margin, k = floor(alpha (n+1)), capped at 1; None when k < 1 (never
    abort)."""
    k = conformal_rank(len(margins), alpha)
    if k is None:
        return None
    # A cap lowers the threshold, so it can only abort fewer runs: the bound still holds.
    return min((margins if presorted else sorted(margins))[k - 1], 1.0)


@dataclass(frozen=True, slots=True)
class Family:
    """What a calibration is keyed by: the family of runs, the judge's model and the rubric's
    hash."""

    name: str
    model: str
    rubric: str

    @classmethod
    def of(
        cls, *, family: str | None, task: str, model: str, rubric: str, schedule: str = "every"
    ) -> Family:
        """A run's family: its `family` when given, else its task text (long texts by their hash).

        A schedule other than "every" is part of the key (in its rubric part, so the keys of runs
        scored at every step stay as they were): the bound holds when calibration runs and live runs
        follow the same rule, so a family learnt under "every" does not arm runs scored under
        "adaptive", nor the reverse.
        """
        key = rubric if schedule == "every" else f"{rubric} schedule={schedule}"
        return cls(family if family else task_family(task), model, key)


def task_family(task: str) -> str:
    """The family name of a run that names none: its task text, or `task:<hash>` when that is
    long."""
    task = " ".join(task.split())
    if len(task) <= 80:
        return task
    return f"task:{hashlib.sha256(task.encode()).hexdigest()[:16]} {task[:48]}"


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished run with an outcome: what calibration learns from."""

    run_id: str
    family: Family
    success: bool
    curve: tuple[Point, ...]
    outcome: float | str | None = None
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        return {
            "run_id": self.run_id,
            "family": self.family.name,
            "model": self.family.model,
            "rubric": self.family.rubric,
            "success": self.success,
            "outcome": self.outcome,
            "at": self.at,
            "curve": [list(p) for p in self.curve],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sample:
        """The Sample a `to_json` form describes."""
        return cls(
            run_id=str(data["run_id"]),
            family=Family(str(data["family"]), str(data["model"]), str(data["rubric"])),
            success=bool(data["success"]),
            curve=tuple(Point(int(s), sc, u) for s, sc, u in data["curve"]),
            outcome=data.get("outcome"),
            at=float(data.get("at", 0.0)),
        )


def is_success(outcome: object, success_at: float = DEFAULT_SUCCESS_AT) -> bool | None:
    """True / False for an outcome that says success or failure; None when it says neither (no
    evidence)."""
    if isinstance(outcome, bool):
        return outcome
    if isinstance(outcome, (int, float)):
        return outcome >= success_at if math.isfinite(outcome) else None
    if isinstance(outcome, str):
        o = outcome.strip().lower()
        if o in {"success", "succeeded", "pass", "passed"}:
            return True
        if o in {"failure", "failed", "fail"}:
            return False
    return None  # None, "aborted", "evicted", "stalled", ...: the run's outcome is unknown


@dataclass(frozen=True, slots=True)
class Threshold:
    """The abort threshold calibration gives a family now, and the evidence behind it."""

    value: float | None
    """None: not calibrated yet (or the margins allow no abort): the rule aborts nothing."""
    successes: int
    failures: int
    alpha: float
    detail: str = ""
    """Why there is no threshold although the family has enough successes (a length stratum still
    short)."""

    @property
    def needed(self) -> int:
        """Successful runs needed before `alpha` gives a threshold."""
        return min_successes(self.alpha)

    on_failures: bool = False
    """Calibrated on failing runs (the `done` threshold), not on successful ones."""

    @property
    def reason(self) -> str:
        """Where the threshold comes from, for signals and logs."""
        if self.value is None and self.detail:
            return self.detail
        n, kind, never = (
            (self.failures, "failing", "never done")
            if self.on_failures
            else (self.successes, "successful", "never aborts")
        )
        if n < self.needed:
            return (
                f"not calibrated yet: {n} of {self.needed} {kind} runs needed at alpha "
                f"{self.alpha:g}; {never}"
            )
        return f"calibrated on {n} {kind} runs, alpha {self.alpha:g}"


@dataclass(frozen=True, slots=True)
class FamilySummary:
    """One family's evidence, for `agent-monitor calibration` and the metrics."""

    family: Family
    successes: int
    failures: int
    last_at: float


@dataclass(frozen=True, slots=True)
class CalibrationStatistics:
    """What a calibration holds, and the outcomes its per-family rate refused."""

    samples: int
    """Samples kept, every family's."""
    families: int
    rate_limited: int
    """Outcomes not learnt because their family had learnt `max_rate` runs in the last
    `rate_window_s`."""


class Calibration:
    """Per-family evidence from finished runs, and the abort thresholds it supports.

    Feed it finished runs (`record`, or `add` for stored samples); ask `threshold(family, policy)`.
    A run counts once (by run id) per family; its outcome decides success (`success_at` for
    numbers). Each family keeps its `max_samples` most recent runs, and all families together
    `max_total` (families come from the network: past it, the family that learnt least recently is
    forgotten). `on_sample` is called with each new sample (the daemon stores it there). Not
    thread-safe: the daemon and the trackers use it from one event loop.
    """

    def __init__(
        self,
        samples: Iterable[Sample] = (),
        *,
        success_at: float = DEFAULT_SUCCESS_AT,
        on_sample: Callable[[Sample], object] | None = None,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        max_total: int = DEFAULT_MAX_TOTAL,
        clock: Callable[[], float] = time.time,
        strata: int = DEFAULT_STRATA,
        max_rate: int | None = None,
        rate_window_s: float = 60.0,
    ) -> None:
        if not (isinstance(success_at, (int, float)) and math.isfinite(success_at)):
            raise CalibrationError(
                f"success_at={success_at!r}: use a number (outcomes at or above it are successes)"
            )
        if not (isinstance(max_samples, int) and max_samples >= 1):
            raise CalibrationError(
                f"max_samples={max_samples!r}: use an integer >= 1 (finished runs kept per family)"
            )
        if not (isinstance(max_total, int) and max_total >= max_samples):
            raise CalibrationError(
                f"max_total={max_total!r}: use an integer >= max_samples ({max_samples}): "
                "runs kept over all families"
            )
        if not (isinstance(strata, int) and 1 <= strata <= 8):
            raise CalibrationError(
                f"strata={strata!r}: use an integer from 1 (no length strata) to 8"
            )
        if max_rate is not None and not (isinstance(max_rate, int) and max_rate >= 1):
            raise CalibrationError(
                f"max_rate={max_rate!r}: use an integer >= 1 (runs a family learns per "
                "window), or None"
            )
        self.strata = strata
        self.max_rate = max_rate
        self.rate_window_s = rate_window_s
        self._taught: dict[Family, deque[float]] = {}
        self._failures: dict[Family, int] = {}
        self.rate_limited = 0
        """Outcomes not learnt because their family had learnt `max_rate` runs in the last
        `rate_window_s`."""
        self.success_at = float(success_at)
        self.max_samples = max_samples
        self.max_total = max_total
        self._total = 0
        self.on_sample = on_sample
        self.clock = clock
        self._runs: dict[Family, dict[str, Sample]] = {}
        self.revision = 0
        """Bumped whenever the samples change (a cache of anything computed from them keys on
        it)."""
        self._revisions: dict[Family, int] = {}
        # Sorted finite success margins per (family, min_steps, patience, max_uncertainty), one list
        # per length stratum, kept current by `add`.
        self._margins: dict[tuple[Family, int, int, float], tuple[Policy, list[list[float]]]] = {}
        self._memos: dict[tuple[Any, ...], tuple[int, Threshold]] = {}
        for s in samples:
            self.add(s)

    def add(self, sample: Sample) -> bool:
        """Take a sample (a stored one, or one made elsewhere); False when that run was already
        counted."""
        runs = self._runs.setdefault(sample.family, {})
        if sample.run_id in runs:
            return False
        runs[sample.run_id] = sample
        self._total += 1
        self.revision += 1
        self._revisions[sample.family] = self.revision
        if not sample.success:
            self._failures[sample.family] = self._failures.get(sample.family, 0) + 1
        self._cached(sample, bisect.insort)
        if len(runs) > self.max_samples:
            # The oldest goes: a bounded window of the family's most recent runs (dicts keep
            # insertion order).
            oldest = runs.pop(next(iter(runs)))
            self._total -= 1
            if not oldest.success:
                self._failures[oldest.family] -= 1
            self._cached(oldest, _remove)
        # Families come from the network (start.family, task texts): over the total, whole families
        # go, the one that learnt least recently first (moved to the end of the dict on every new
        # sample).
        self._runs[sample.family] = self._runs.pop(sample.family)
        while self._total > self.max_total:
            stale = next(iter(self._runs))
            self._total -= len(self._runs.pop(stale))
            self._failures.pop(stale, None)
            self._revisions.pop(stale, None)
            self._margins = {k: v for k, v in self._margins.items() if k[0] != stale}
        return True

    def _cached(self, sample: Sample, change: Callable[[list[float], float], None]) -> None:
        # Keep the cached margins current (one change each) rather than recomputing a family's on
        # next use.
        if sample.success:
            for key, (policy, ms) in self._margins.items():
                if key[0] == sample.family and (got := self._placed(sample, policy)) is not None:
                    change(ms[got[0]], got[1])

    def _placed(self, sample: Sample, policy: Policy) -> tuple[int, float] | None:
        """A success's (stratum, margin) under `policy`; None when its margin is infinite (it
        says nothing)."""
        n = len(counted(sample.curve, policy))
        if n < policy.patience:
            # fewer counted scores than patience: no window, margin +inf, nothing learnt about the
            # rule
            return None
        return stratum(n, policy.patience, self.strata), margin(sample.curve, policy)

    def record(
        self,
        family: Family,
        run_id: str,
        outcome: object,
        curve: Iterable[Progress | Point],
        *,
        exposed: bool = False,
    ) -> Sample | None:
        """Learn from a finished run; None when it teaches nothing (see below) or was counted
        already.

        A run teaches nothing when its outcome says neither success nor failure, or when it was
        `exposed`: an abort rule could have stopped it (`PolicyState.exposed`). Such a run's outcome
        is censored: the successes an armed threshold aborted never report one, so learning from
        the rest would only ever raise the threshold, and the bound would no longer hold.
        """
        success = is_success(outcome, self.success_at)
        if success is None or exposed:
            return None
        if self.max_rate is not None:
            # Outcomes come from the network: however fast they come, a family learns at most
            # max_rate per window.
            now = self.clock()
            recent = self._taught.setdefault(family, deque())
            while recent and recent[0] <= now - self.rate_window_s:
                recent.popleft()
            if len(recent) >= self.max_rate:
                self.rate_limited += 1
                return None
            recent.append(now)
            if len(self._taught) > self.max_total:
                self._taught.pop(next(iter(self._taught)))
        pts = tuple(p if isinstance(p, Point) else points([p])[0] for p in curve)
        stored = (
            outcome
            if isinstance(outcome, (int, float, str)) and not isinstance(outcome, bool)
            else success
        )
        sample = Sample(run_id, family, success, pts, outcome=stored, at=self.clock())
        if not self.add(sample):
            return None
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample

    def _strata(self, family: Family, policy: Policy) -> list[list[float]]:
        key = (family, policy.min_steps, policy.patience, policy.max_uncertainty)
        got = self._margins.get(key)
        if got is None:
            per: list[list[float]] = [[] for _ in range(self.strata)]
            for s in self._runs.get(family, {}).values():
                if s.success and (placed := self._placed(s, policy)) is not None:
                    per[placed[0]].append(placed[1])
            got = self._margins[key] = (policy, [sorted(ms) for ms in per])
        return got[1]

    def revision_of(self, family: Family) -> int:
        """The revision at which `family`'s samples last changed (-1: it has none): a per-family
        cache key."""
        return self._revisions.get(family, -1)

    def margins(self, family: Family, policy: Policy) -> list[float]:
        """The family's successful runs' finite margins under `policy`, sorted (every stratum)."""
        return sorted(m for ms in self._strata(family, policy) for m in ms)

    def threshold(
        self,
        family: Family,
        policy: Policy,
        alpha: float | None = None,
        *,
        counted: int | None = None,
    ) -> Threshold:
        """The abort threshold for a live run of `family` under `policy` (alpha: the policy's,
        unless given).

        `counted`: the live run's counted scores at the decision (None: its first possible
        decision). The threshold is the smallest of the thresholds of the length strata the run can
        still end in (its own and every longer one); None while any of them has too few successes.
        Only finite margins teach.
        """
        a = check_alpha(policy.alphas().abort if alpha is None else alpha)
        per = self._strata(family, policy)
        successes = sum(len(ms) for ms in per)
        failures = self._failures.get(family, 0)
        first = stratum(max(counted or 0, policy.patience), policy.patience, self.strata)
        value: float | None = None
        detail = ""
        for j in range(first, self.strata):
            t = conformal_threshold(per[j], a, presorted=True)
            if t is None:
                value = None
                if self.strata > 1:
                    detail = (
                        f"not calibrated yet: {len(per[j])} of {min_successes(a)} successful "
                        "runs with "
                        f"{stratum_range(j, policy.patience, self.strata)} counted scores "
                        f"needed at alpha {a:g}; "
                        "never aborts"
                    )
                break
            value = t if value is None else min(value, t)
        return Threshold(value, successes, failures, a, detail)

    def budget(self, family: Family, policy: Policy, alpha: float | None = None) -> Threshold:
        """The step budget for a live run of `family` (`max_steps="auto"`): `budget_threshold` of
        its successes' lengths.

        The same rule and minimum of successes as `threshold`; alpha: the policy's share for the
        budget (`policy.alphas`) unless given.
        """
        a = check_alpha(policy.alphas().budget if alpha is None else alpha)
        key = (family, "budget", a)

        def value() -> float | None:
            lengths = [
                run_length(s.curve) for s in self._runs.get(family, {}).values() if s.success
            ]
            return budget_threshold([n for n in lengths if n > 0], a)

        return self._memo(key, family, value, a)

    def done(self, family: Family, policy: Policy, alpha: float | None = None) -> Threshold:
        """The `done` threshold for a live run of `family` (`done_above="auto"`), from its
        failing runs' curves."""
        a = check_alpha(policy.alpha if alpha is None else alpha)
        key = (family, "done", a, policy.min_steps, policy.patience, policy.max_uncertainty)

        def value() -> float | None:
            fails = [s for s in self._runs.get(family, {}).values() if not s.success]
            return done_threshold([done_margin(s.curve, policy) for s in fails], a)

        return self._memo(key, family, value, a, on_failures=True)

    def _memo(
        self,
        key: tuple[Any, ...],
        family: Family,
        value: Callable[[], float | None],
        alpha: float,
        **kw: Any,
    ) -> Threshold:
        # Asked at every observation of every live run: recomputed only when the family's samples
        # changed.
        rev = self.revision_of(family)
        got = self._memos.get(key)
        if got is None or got[0] != rev:
            runs = self._runs.get(family, {}).values()
            successes = sum(s.success for s in runs)
            got = (rev, Threshold(value(), successes, self._failures.get(family, 0), alpha, **kw))
            # families come from the network: bounded like the samples
            if len(self._memos) > 4 * self.max_total:
                self._memos.clear()
            self._memos[key] = got
        return got[1]

    def families(self) -> list[FamilySummary]:
        """Every family with evidence, most recent first."""
        out = [
            FamilySummary(
                f,
                sum(s.success for s in runs.values()),
                sum(not s.success for s in runs.values()),
                max((s.at for s in runs.values()), default=0.0),
            )
            for f, runs in self._runs.items()
        ]
        return sorted(out, key=lambda x: -x.last_at)

    def samples(self, family: Family | None = None) -> Iterator[Sample]:
        """The samples (of one family, or all)."""
        for f, runs in self._runs.items():
            if family is None or f == family:
                yield from runs.values()

    def statistics(self) -> CalibrationStatistics:
        """Samples kept, families, and outcomes refused by the per-family rate."""
        return CalibrationStatistics(self._total, len(self._runs), self.rate_limited)

    def reset(self, name: str) -> int:
        """Forget every family called `name` (any model or rubric); how many samples were
        dropped."""
        gone = [f for f in self._runs if f.name == name]
        dropped = sum(len(self._runs.pop(f)) for f in gone)
        for f in gone:
            self._failures.pop(f, None)
            self._revisions.pop(f, None)
        self._total -= dropped
        self.revision += 1
        self._margins = {k: v for k, v in self._margins.items() if k[0].name != name}
        return dropped

    def save(self, path: str | Path) -> Path:
        """Write every sample to a JSON-lines file (atomically: a crash leaves the old file), for
        `load`."""
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        with tmp.open("w") as f:
            for s in self.samples():
                f.write(json.dumps(s.to_json()) + "\n")
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> Calibration:
        """A Calibration from a file `save` wrote (none yet: empty); `options` are the
        constructor's."""
        p = Path(path)
        samples = []
        if p.exists():
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    samples.append(Sample.from_json(json.loads(line)))
                except (ValueError, KeyError, TypeError) as e:
                    raise CalibrationError(
                        f"{p}:{n}: not a calibration sample ({e}); was it written by save()?"
                    ) from e
        return cls(samples, **options)

    def __contains__(self, family: object) -> bool:
        return family in self._runs

    def __len__(self) -> int:
        return self._total


def _remove(ms: list[float], m: float) -> None:
    i = bisect.bisect_left(ms, m)
    if i < len(ms) and ms[i] == m:
        del ms[i]


# Uniform groups (formerly agent_monitor.uniform). Groups flagged early (DAPO dynamic sampling):
# each live run's calibrated pass / fail call as a p-value. Pure logic.
#
# An RL trainer wants to know, while a group's rollouts still run, that their outcomes will be all
# alike (no variance, so no gradient). This module gives each member two conformal p-values from the
# family's calibration (`agent_monitor.calibration`); `groups.GroupState.uniform` combines them over
# the group.
#
# **Fail call.** A run's *running margin* is the calibration margin of its curve so far (the minimum
# over its windows of `patience` consecutive counted scores of the window's maximum): the abort rule
# at threshold t has stopped it iff that margin is below t. With the finite margins m_1..m_n of the
# family's n successful runs, the p-value of "this run will fail" is
#
#     fail_p = (1 + #{i : m_i <= m_live}) / (n + 1)        (1 while m_live is infinite, or n = 0)
#
# If the run is in fact a success exchangeable with those n, its *final* margin's rank among the n +
# 1 is uniform, so P(final p <= a) <= a; the running margin only ever falls as the run goes on, so
# the running p-value is never below the final one: P(fail_p <= a at any step) <= a. This is exactly
# the calibration's false-abort bound (`fail_p <= alpha` iff the calibrated rule at `alpha` aborts
# the run), as a number.
#
# **Pass call**, the mirror image: a run's *pass margin* is the maximum over its windows of the
# window's minimum (the rule "`patience` counted scores in a row above u" calls it a pass iff it
# exceeds u), it only rises as the run goes on, and the reference set is the family's failed runs'
# pass margins M_j:
#
#     pass_p = (1 + #{j : M_j >= M_live}) / (n_failures + 1)
#
# **A group of N members** is called all-fail when 1 - N * max_i fail_p_i >= `uniform_confidence`.
# If some member is in fact a success, P(flag) <= sum over members of P(member i succeeds and
# fail_p_i <= d / N) <= (d / N) * E[#successes] <= d * P(some member succeeds): the flag is wrong
# with probability at most d = 1 - confidence, whatever the dependence between the members (they
# share a prompt: they are not independent, so no product of per-run confidences is claimed).
# Limits: docs/groups.md.
#
# API: `pass_margin(curve, policy)`, `p_fail(margins, m)`, `p_pass(pass_margins, m)`, and
# `Caller(calibration).calls(family, policy, curve) -> Calls` (evidence cached per family revision).

MAX_CACHED = 256
"""(family, policy) evidence sets a Caller keeps; past it the oldest goes (families come from the
network)."""


class Calls(NamedTuple):
    """One run's two calls: the p-values of "it will fail" and "it will pass" (1: no call)."""

    fail_p: float
    pass_p: float


NO_CALL = Calls(1.0, 1.0)
"""A run nothing is known about (no calibration, too few counted scores, a failing judge)."""


def pass_margin(curve: Iterable[Point], policy: Policy) -> float:
    """The largest u such that `patience` counted scores in a row all lie above it (-inf: fewer
    counted scores)."""
    scores = counted(curve, policy)
    w = policy.patience
    if len(scores) < w:
        return -math.inf
    # The mirror image of calibration.margin: the max over windows of the window's min, by negation.
    return -margin([Point(i, -s, None) for i, s in enumerate(scores)], _bare(policy))


def _bare(policy: Policy) -> Policy:
    """`policy`'s window with every score counted (the scores given are already the counted
    ones)."""
    return Policy(patience=policy.patience, min_steps=0, max_uncertainty=1.0)


def p_fail(margins: Sequence[float], m: float) -> float:
    """The p-value of "fails" for a running margin `m` against the successes' sorted finite
    `margins`."""
    if not margins or not math.isfinite(m):
        return 1.0
    return (1 + bisect.bisect_right(margins, m)) / (len(margins) + 1)


def p_pass(pass_margins: Sequence[float], m: float) -> float:
    """The p-value of "passes" for a running pass margin `m` against the failures' sorted finite
    `pass_margins`."""
    if not pass_margins or not math.isfinite(m):
        return 1.0
    return (1 + len(pass_margins) - bisect.bisect_left(pass_margins, m)) / (len(pass_margins) + 1)


@dataclass(frozen=True, slots=True)
class CallerStatistics:
    """A caller's evidence sets: cached now, and computed so far (cache misses)."""

    cached: int
    recomputed: int


class Caller:
    """Live runs' calls from a calibration's evidence; the family's margins are recomputed only
    when it learns."""

    def __init__(self, calibration: Calibration, *, max_cached: int = MAX_CACHED) -> None:
        self.calibration = calibration
        self.max_cached = max_cached
        self._cache: dict[tuple[Family, int, int, float], tuple[int, list[float], list[float]]] = {}
        self.recomputed = 0
        """Evidence sets computed (a cache miss: a new family or policy, or the family learnt a
        run)."""

    def calls(self, family: Family, policy: Policy, curve: Sequence[Point]) -> Calls:
        """A run's calls now, from its curve so far (step order; failed scorings have score
        None)."""
        fails, passes = self.evidence(family, policy)
        if not fails and not passes:
            return NO_CALL
        return Calls(
            p_fail(fails, margin(curve, policy)), p_pass(passes, pass_margin(curve, policy))
        )

    def evidence(self, family: Family, policy: Policy) -> tuple[list[float], list[float]]:
        """The family's successes' margins and failures' pass margins under `policy`'s window,
        sorted (finite only)."""
        key = (family, policy.min_steps, policy.patience, policy.max_uncertainty)
        rev = self.calibration.revision_of(family)
        got = self._cache.get(key)
        if got is not None and got[0] == rev:
            return got[1], got[2]
        fails = self.calibration.margins(family, policy)
        passes = sorted(
            pm
            for s in self.calibration.samples(family)
            if not s.success and math.isfinite(pm := pass_margin(s.curve, policy))
        )
        self._cache.pop(key, None)
        self._cache[key] = (rev, fails, passes)
        while len(self._cache) > self.max_cached:
            self._cache.pop(next(iter(self._cache)))
        self.recomputed += 1
        return fails, passes

    def statistics(self) -> CallerStatistics:
        """Evidence sets cached and computed."""
        return CallerStatistics(len(self._cache), self.recomputed)
