"""The judge beside what a live monitor has for free, with error bars, and decisions simulated on
whole runs.

`signal_report` puts the judge's score next to three baselines a monitor can compute at step k
without a judge: `step_index` (k itself), `chars` (the run's text size so far) and `errors`
(non-zero exits, tracebacks, failed tests so far). Each is oriented so that a higher value says
"failure" (the positive class) and gets AUROC and AUPRC with 95% bootstrap intervals (resampling
tasks when runs share tasks, else runs) and a permutation p-value against chance (outcomes shuffled
across runs), in three views:

- at fixed steps k (2, 4, 8, 16 and the user's): the runs still going at step k, as live;
- pooled over every scored step (each step of each run a sample, clustered by run in the
  resampling): where counting steps has its signal, since failing runs go on longer;
- at fractions of the run (25/50/75%): these use the run's final length, which a live monitor does
  not know.

`simulate` calibrates on one split of the tasks and applies on the other (then the reverse): the
judge's `abort_below: auto` rule, the step budget (`max_steps: auto`), both together at alpha/2
each, and the `done` signal, with the shared split-conformal rule of `agent_monitor.calibration`.
Steps saved are over failing runs' whole length, whatever `--max-steps` scored.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..calibration import (
    Point,
    budget_threshold,
    conformal_threshold,
    done_margin,
    done_threshold,
    margin,
    min_successes,
    points,
    task_family,
)
from ..policy import Policy
from .evaluate import RunCurve, abort_step, progress

SignalName = Literal["judge", "step_index", "chars", "errors"]
BASELINES: tuple[SignalName, ...] = ("step_index", "chars", "errors")
SIGNALS: tuple[SignalName, ...] = ("judge", *BASELINES)
FIXED_STEPS = (2, 4, 8, 16)
FRACTIONS = (0.25, 0.5, 0.75)
DEFAULT_RESAMPLES = 1000
"""Bootstrap resamples and label permutations per figure."""
LEVEL = 0.95
POOLED = "every scored step"
WHOLE = "every step of the whole runs (baselines only: past what was scored)"
_PLAIN = {"step_index": "counting steps", "chars": "the text size", "errors": "counting errors"}
MIN_TASKS = 5
"""Tasks needed (with some sharing runs) before the bootstrap resamples tasks rather than runs."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One signal in one view: AUROC and AUPRC (failure positive) with 95% intervals, and a
    p-value vs chance."""

    signal: str
    n: int
    """Samples (runs at a fixed step; run-steps pooled)."""
    failures: int
    auroc: float | None
    auroc_ci: tuple[float, float] | None
    auprc: float | None
    auprc_ci: tuple[float, float] | None
    p_value: float | None
    """Two-sided permutation p-value of the AUROC against 0.5 (outcomes shuffled across runs)."""
    chance: tuple[float, float] | None
    """The 95% range of this AUROC when outcomes are shuffled: what this sample cannot tell from
    chance."""
    prevalence: float | None
    """The failures' share: AUPRC's chance level."""


@dataclass(frozen=True, slots=True)
class View:
    """The signals side by side at one point of the runs."""

    name: str
    """"step 4", "every scored step", "25% (final length)"."""
    uses_final_length: bool
    figures: dict[str, Figure]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the judge beats the best baseline on these runs, and how many runs would tell."""

    text: str
    baseline: str | None
    difference: float | None
    difference_ci: tuple[float, float] | None
    runs_needed: int | None


@dataclass(slots=True)
class SignalReport:
    """Every view, the verdict, and the ROC / PR curves of the pooled view."""

    runs: int
    clusters: str
    """What the bootstrap resamples: "tasks (6)" or "runs (30)"."""
    views: list[View]
    verdict: Verdict
    curves: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    """Signal -> {"roc": [(fpr, tpr)], "pr": [(recall, precision)]} over the pooled view."""


def _task(c: RunCurve) -> str:
    return c.family.name if c.family is not None else task_family(c.name)


def value_at(curve: RunCurve, signal: str, k: int) -> float | None:
    """The signal at step k, oriented so that higher says failure; None when the run ended before
    k or is unscored."""
    if k < 1 or k > curve.steps:
        return None
    if signal == "judge":
        if k > len(curve.scores):
            return None
        good = [s for s in curve.scores[:k] if s is not None]
        return 1.0 - good[-1] if good else None
    if signal == "step_index":
        return float(k)
    series = curve.chars if signal == "chars" else curve.errors if signal == "errors" else None
    if series is None:
        raise ValueError(f"unknown signal {signal!r}; use one of {', '.join(SIGNALS)}")
    return float(series[k - 1]) if k <= len(series) else None


def auroc_of(values: Sequence[float], labels: Sequence[bool]) -> float | None:
    """AUROC with positives = True (Mann-Whitney from ranks, ties half); None without both
    classes."""
    n1 = sum(labels)
    n0 = len(labels) - n1
    if n1 == 0 or n0 == 0:
        return None
    order = sorted(range(len(values)), key=values.__getitem__)
    rank_sum = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        r = (i + j) / 2 + 1
        rank_sum += r * sum(labels[order[m]] for m in range(i, j + 1))
        i = j + 1
    return (rank_sum - n1 * (n1 + 1) / 2) / (n1 * n0)


def auprc_of(values: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Average precision with positives = True (tied values enter together); None without a
    positive."""
    pos = sum(labels)
    if pos == 0 or pos == len(labels):
        return None if pos == 0 else 1.0
    pairs = sorted(zip(values, labels, strict=True), key=lambda t: -t[0])
    ap = 0.0
    tp = seen = 0
    i = 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        group_tp = sum(y for _, y in pairs[i:j])
        tp += group_tp
        seen += j - i
        ap += group_tp / pos * (tp / seen)
        i = j
    return ap


def roc_points(values: Sequence[float], labels: Sequence[bool]) -> list[tuple[float, float]]:
    """(false-positive rate, true-positive rate) at every threshold, from (0, 0) to (1, 1)."""
    pos = sum(labels)
    neg = len(labels) - pos
    out = [(0.0, 0.0)]
    if not pos or not neg:
        return out
    tp = fp = 0
    pairs = sorted(zip(values, labels, strict=True), key=lambda t: -t[0])
    for i, (v, y) in enumerate(pairs):
        tp += y
        fp += not y
        if i + 1 == len(pairs) or pairs[i + 1][0] != v:
            out.append((fp / neg, tp / pos))
    return out


def pr_points(values: Sequence[float], labels: Sequence[bool]) -> list[tuple[float, float]]:
    """(recall, precision) at every threshold."""
    pos = sum(labels)
    out: list[tuple[float, float]] = []
    if not pos:
        return out
    tp = 0
    pairs = sorted(zip(values, labels, strict=True), key=lambda t: -t[0])
    for i, (v, y) in enumerate(pairs):
        tp += y
        if i + 1 == len(pairs) or pairs[i + 1][0] != v:
            out.append((tp / pos, tp / (i + 1)))
    return out


Sample = tuple[int, float, bool]
"""(run index, value, failed)."""


def _interval(xs: list[float]) -> tuple[float, float] | None:
    if not xs:
        return None
    xs.sort()
    tail = (1 - LEVEL) / 2
    return xs[int(tail * (len(xs) - 1))], xs[round((1 - tail) * (len(xs) - 1))]


class _Resampler:
    """Paired bootstrap draws (the same clusters for every signal) and label permutations,
    seeded."""

    def __init__(self, curves: Sequence[RunCurve], resamples: int, seed: int) -> None:
        tasks = [_task(c) for c in curves]
        distinct = sorted(set(tasks))
        shared = len(distinct) < len(curves)
        if shared and len(distinct) >= MIN_TASKS:
            self.clusters = f"tasks ({len(distinct)})"
            groups = {t: [i for i, x in enumerate(tasks) if x == t] for t in distinct}
            units = list(groups.values())
        else:
            self.clusters = f"runs ({len(curves)})"
            units = [[i] for i in range(len(curves))]
        rng = random.Random(seed)
        # Each draw: how many times each run enters (its cluster drawn that often).
        self.draws: list[list[int]] = []
        for _ in range(resamples):
            weight = [0] * len(curves)
            for _ in units:
                for i in units[rng.randrange(len(units))]:
                    weight[i] += 1
            self.draws.append(weight)
        labels = [c.success is False for c in curves]
        self.perms: list[list[bool]] = []
        for _ in range(resamples):
            shuffled = labels[:]
            rng.shuffle(shuffled)
            self.perms.append(shuffled)

    def figure(self, signal: str, samples: Sequence[Sample]) -> Figure:
        """The figure of one signal's samples, with its intervals and p-value."""
        vals = [v for _, v, _ in samples]
        ys = [y for _, _, y in samples]
        a, p = auroc_of(vals, ys), auprc_of(vals, ys)
        boot_a, boot_p = [], []
        for w in self.draws:
            bv = [v for r, v, _ in samples for _ in range(w[r])]
            by = [y for r, _, y in samples for _ in range(w[r])]
            if (x := auroc_of(bv, by)) is not None:
                boot_a.append(x)
            if (x := auprc_of(bv, by)) is not None:
                boot_p.append(x)
        null = []
        if a is not None:
            for perm in self.perms:
                if (x := auroc_of(vals, [perm[r] for r, _, _ in samples])) is not None:
                    null.append(x)
        pv = (
            (1 + sum(abs(x - 0.5) >= abs(a - 0.5) - 1e-12 for x in null)) / (1 + len(null))
            if a is not None
            else None
        )
        fails = sum(ys)
        return Figure(
            signal,
            len(samples),
            fails,
            a,
            _interval(boot_a),
            p,
            _interval(boot_p),
            pv,
            _interval(null),
            fails / len(samples) if samples else None,
        )

    def difference(self, a: Sequence[Sample], b: Sequence[Sample]) -> tuple[float, float] | None:
        """The paired bootstrap interval of AUROC(a) - AUROC(b) (same draws for both)."""
        diffs = []
        for w in self.draws:
            xa = auroc_of(
                [v for r, v, _ in a for _ in range(w[r])], [y for r, _, y in a for _ in range(w[r])]
            )
            xb = auroc_of(
                [v for r, v, _ in b for _ in range(w[r])], [y for r, _, y in b for _ in range(w[r])]
            )
            if xa is not None and xb is not None:
                diffs.append(xa - xb)
        return _interval(diffs)


def _samples(
    curves: Sequence[RunCurve], signal: str, steps: Callable[[RunCurve], list[int]]
) -> list[Sample]:
    out = []
    for i, c in enumerate(curves):
        for k in steps(c):
            if (v := value_at(c, signal, k)) is not None:
                out.append((i, v, c.success is False))
    return out


def signal_report(
    curves: Sequence[RunCurve],
    *,
    at_steps: Sequence[int] = (),
    judged: bool = True,
    max_steps: int | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> SignalReport:
    """The judge (when `judged`) and the baselines side by side over runs with known outcomes.

    The pooled view takes the steps the judge scored (without a judge: the first `max_steps`, or
    all).
    """
    known = [c for c in curves if c.success is not None]
    signals: tuple[str, ...] = SIGNALS if judged else BASELINES
    rs = _Resampler(known, resamples, seed)
    views = []
    ks = sorted({*FIXED_STEPS, *(k for k in at_steps if k >= 1)})

    def at(k: int) -> Callable[[RunCurve], list[int]]:
        return lambda c: [k]

    def fraction(q: float) -> Callable[[RunCurve], list[int]]:
        return lambda c: [max(1, math.ceil(q * c.steps))]

    for k in ks:
        views.append(
            View(f"step {k}", False, {s: rs.figure(s, _samples(known, s, at(k))) for s in signals})
        )

    def scored(c: RunCurve) -> list[int]:
        upto = len(c.scores) if judged else min(c.steps, max_steps or c.steps)
        return list(range(1, min(upto, c.steps) + 1))

    pooled = {s: _samples(known, s, scored) for s in signals}
    views.append(View(POOLED, False, {s: rs.figure(s, pooled[s]) for s in signals}))
    if any(
        min(len(c.scores) if judged else (max_steps or c.steps), c.steps) < c.steps for c in known
    ):
        # Scoring stopped before some runs ended: the baselines are free over whole runs, where
        # counting steps has its signal (failing runs go on longer); the judge has no score there to
        # stand beside them.
        every: dict[str, Figure] = {
            s: rs.figure(s, _samples(known, s, lambda c: list(range(1, c.steps + 1))))
            for s in BASELINES
        }
        views.append(View(WHOLE, False, every))
    for q in FRACTIONS:
        views.append(
            View(
                f"{q:.0%} of the run (final length)",
                True,
                {s: rs.figure(s, _samples(known, s, fraction(q))) for s in signals},
            )
        )
    curves_ = {
        s: {
            "roc": roc_points([v for _, v, _ in pooled[s]], [y for _, _, y in pooled[s]]),
            "pr": pr_points([v for _, v, _ in pooled[s]], [y for _, _, y in pooled[s]]),
        }
        for s in signals
    }
    if judged:
        # The difference is measured on the same run-steps: those the judge gave a score (a failed
        # call has none).
        def scored_by_judge(c: RunCurve) -> list[int]:
            return [k for k in scored(c) if value_at(c, "judge", k) is not None]

        paired = {s: _samples(known, s, scored_by_judge) for s in signals}
    else:
        paired = pooled
    verdict = _verdict(known, next(v for v in views if v.name == POOLED), paired, rs, judged)
    return SignalReport(len(known), rs.clusters, views, verdict, curves_)


def _ci(x: float | None, ci: tuple[float, float] | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _verdict(
    curves: Sequence[RunCurve],
    pooled: View,
    samples: dict[str, list[Sample]],
    rs: _Resampler,
    judged: bool,
) -> Verdict:
    n = len(curves)
    figs = pooled.figures
    base = [b for b in BASELINES if figs[b].auroc is not None]
    if not base:
        return Verdict(
            f"on these {n} runs no signal could be measured (one outcome only?)",
            None,
            None,
            None,
            None,
        )
    best = max(base, key=lambda b: figs[b].auroc or 0.0)
    fb = figs[best]
    if not judged or figs["judge"].auroc is None:
        why = "no judge" if not judged else "the judge scored no step"
        return Verdict(
            f"on these {n} runs ({why}) the best baseline is {_PLAIN[best]} ({best}): AUROC "
            f"{_ci(fb.auroc, fb.auroc_ci)} over {POOLED}",
            best,
            None,
            None,
            None,
        )
    fj = figs["judge"]
    assert fj.auroc is not None and fb.auroc is not None
    ja = auroc_of([v for _, v, _ in samples["judge"]], [y for _, _, y in samples["judge"]])
    ba = auroc_of([v for _, v, _ in samples[best]], [y for _, _, y in samples[best]])
    d = (ja or 0.5) - (ba or 0.5)
    # The interval of the difference pairs the two on the run-steps the judge scored (the same draws
    # for both).
    dci = rs.difference(samples["judge"], samples[best])
    pair = (
        f"AUROC {_ci(fj.auroc, fj.auroc_ci)} vs {_ci(fb.auroc, fb.auroc_ci)} ({POOLED}, "
        "failure positive)"
    )
    needed: int | None = None
    if dci is not None and (dci[0] > 0 or dci[1] < 0):
        word = "beats" if d > 0 else "is worse than"
        text = (
            f"on these {n} runs the judge {word} {_PLAIN[best]} ({best}): {pair}; "
            f"difference {d:+.2f} [{dci[0]:+.2f}, {dci[1]:+.2f}]"
        )
    else:
        text = (
            f"on these {n} runs the judge is not distinguishable from {_PLAIN[best]} "
            f"({best}): {pair}"
        )
        if dci is not None:
            text += (
                f"; difference {d:+.2f} [{dci[0]:+.2f}, {dci[1]:+.2f}] on the run-steps "
                "the judge scored"
            )
        if dci is not None and abs(d) > 1e-9:
            # The interval's half-width shrinks as 1/sqrt(n): the runs at which it would stop
            # straddling 0.
            half = (dci[1] - dci[0]) / 2
            needed = math.ceil(n * (half / abs(d)) ** 2)
            text += f"; telling a difference of {abs(d):.2f} apart would take about {needed} runs"
        else:
            text += "; no difference to tell at any sample size"
    if fj.chance is not None:
        text += (
            f"; against chance, this sample cannot tell a judge AUROC in [{fj.chance[0]:.2f}, "
            f"{fj.chance[1]:.2f}] "
            f"from 0.5 (judge p={fj.p_value:.3f})"
        )
    return Verdict(text, best, d, dci, needed)


# --- decisions simulated on whole runs: calibrate on one split of the tasks, apply on the other ---


@dataclass(frozen=True, slots=True)
class Wilson:
    """A proportion with its 95% Wilson interval."""

    k: int
    n: int

    @property
    def rate(self) -> float | None:
        """k / n (None: n = 0)."""
        return self.k / self.n if self.n else None

    @property
    def ci(self) -> tuple[float, float] | None:
        """The 95% Wilson score interval (None: n = 0)."""
        if not self.n:
            return None
        z, n, p = 1.959964, self.n, self.k / self.n
        mid = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, mid - half), min(1.0, mid + half)


@dataclass(frozen=True, slots=True)
class FoldThreshold:
    """What one calibration split gave a rule: its value (None: too few runs), from how many
    runs."""

    calibrated_on: list[str]
    applied_to: list[str]
    threshold: float | None
    """The judge's abort threshold (or `done`'s), when the rule has one (None: none, or too few
    runs)."""
    budget: int | None
    """The step budget, when the rule has one (None: none, or too few successes)."""
    samples: int
    needed: int
    false_rate: float | None
    """Realised on the other split's successes (aborts) or failures (done)."""
    shifted: bool
    """Realised false aborts (or false dones) passed alpha on the other split: the threshold does
    not travel."""


@dataclass(frozen=True, slots=True)
class RuleResult:
    """One rule calibrated on one split and applied on the other, both ways, every run tested
    once."""

    rule: str
    alpha: float
    folds: list[FoldThreshold]
    false_aborts: Wilson
    """Tested successes aborted (for `done`: tested failures called done)."""
    steps_saved: float | None
    """Failing runs' steps after their abort over their whole length (`done`: successes' steps
    after done)."""
    tokens_saved: float | None
    """Judge tokens of scored steps after an abort, over every scored step's tokens."""
    first_alert: dict[str, int]
    """Failing run -> the step its abort came (`done`: successful run -> the step done came)."""
    earlier: float | None = None
    """`done` only: mean steps before the end at which it fired on successes."""


def _folds(curves: Sequence[RunCurve]) -> list[int]:
    tasks = sorted({_task(c) for c in curves})
    if len(tasks) >= 2:
        where = {t: i % 2 for i, t in enumerate(tasks)}
        return [where[_task(c)] for c in curves]
    return [i % 2 for i in range(len(curves))]  # one task: alternate runs (exchangeable within it)


def _points(c: RunCurve) -> tuple[Point, ...]:
    return points(progress(c))


def _tokens_after(c: RunCurve, at: int) -> int:
    return sum(c.tokens[at:])


def simulate(
    curves: Sequence[RunCurve], *, policy: Policy, judged: bool = True
) -> list[RuleResult]:
    """The judge's rule, the step budget, both (alpha/2 each) and `done`, calibrated on one
    split, tested on the other."""
    known = [c for c in curves if c.success is not None]
    fold = _folds(known)
    alpha = policy.alpha
    rules: list[tuple[str, float, float]] = [("step_budget", 0.0, alpha)]
    if judged:
        rules = [("judge", alpha, 0.0), *rules, ("judge+step_budget", alpha / 2, alpha / 2)]
    out = [_abort_rule(known, fold, policy, name, aj, ab) for name, aj, ab in rules]
    if judged:
        out.append(_done_rule(known, fold, policy))
    return out


def _names(curves: Sequence[RunCurve], fold: list[int], f: int) -> list[str]:
    return sorted({_task(c) for c, x in zip(curves, fold, strict=True) if x == f})


def _abort_rule(
    curves: Sequence[RunCurve],
    fold: list[int],
    policy: Policy,
    rule: str,
    a_judge: float,
    a_budget: float,
) -> RuleResult:
    tested_s = aborted_s = 0
    saved = total = 0
    tok_saved = tok_total = 0
    first: dict[str, int] = {}
    folds = []
    for f in (0, 1):
        cal = [c for c, x in zip(curves, fold, strict=True) if x != f]
        test = [c for c, x in zip(curves, fold, strict=True) if x == f]
        good = [c for c in cal if c.success]
        t_judge = b = None
        if a_judge:
            ms = [m for c in good if math.isfinite(m := margin(_points(c), policy))]
            t_judge = conformal_threshold(ms, a_judge)
        if a_budget:
            b = budget_threshold([c.steps for c in good], a_budget)
        fixed = dataclasses.replace(policy, abort_below=t_judge, max_steps=None)
        k_s = n_s = 0
        for c in test:
            ats = []
            if t_judge is not None:
                at = abort_step(c, fixed)
                if at is not None:
                    ats.append(at)
            if b is not None and c.steps > b:
                ats.append(b + 1)  # the budget stops a run at the first step past it
            at = min(ats) if ats else None
            tok_total += sum(c.tokens)
            if at is not None:
                tok_saved += _tokens_after(c, at)
            if c.success:
                n_s += 1
                k_s += at is not None
            else:
                total += c.steps
                if at is not None:
                    saved += c.steps - at
                    first[c.name] = at
        tested_s += n_s
        aborted_s += k_s
        a = a_judge + a_budget
        rate = k_s / n_s if n_s else None
        folds.append(
            FoldThreshold(
                _names(curves, fold, 1 - f),
                _names(curves, fold, f),
                t_judge,
                b,
                len(good),
                min_successes(min(x for x in (a_judge, a_budget) if x)),
                rate,
                rate is not None and rate > a,
            )
        )
    return RuleResult(
        rule,
        a_judge + a_budget,
        folds,
        Wilson(aborted_s, tested_s),
        saved / total if total else None,
        tok_saved / tok_total if tok_total else None,
        first,
    )


def _done_rule(curves: Sequence[RunCurve], fold: list[int], policy: Policy) -> RuleResult:
    alpha = policy.alpha
    fired_f = tested_f = 0
    before: list[int] = []
    saved = total = 0
    first: dict[str, int] = {}
    folds = []
    for f in (0, 1):
        cal = [c for c, x in zip(curves, fold, strict=True) if x != f]
        test = [c for c, x in zip(curves, fold, strict=True) if x == f]
        bad = [c for c in cal if not c.success]
        t = done_threshold([done_margin(_points(c), policy) for c in bad], alpha)
        k_f = n_f = 0
        for c in test:
            at = _done_step(c, policy, t) if t is not None else None
            if c.success:
                total += c.steps
                if at is not None:
                    first[c.name] = at
                    before.append(c.steps - at)
                    saved += c.steps - at
            else:
                n_f += 1
                k_f += at is not None
        fired_f += k_f
        tested_f += n_f
        rate = k_f / n_f if n_f else None
        folds.append(
            FoldThreshold(
                _names(curves, fold, 1 - f),
                _names(curves, fold, f),
                t,
                None,
                len(bad),
                min_successes(alpha),
                rate,
                rate is not None and rate > alpha,
            )
        )
    return RuleResult(
        "done",
        alpha,
        folds,
        Wilson(fired_f, tested_f),
        saved / total if total else None,
        None,
        first,
        sum(before) / len(before) if before else None,
    )


def _done_step(c: RunCurve, policy: Policy, t: float) -> int | None:
    from ..policy import PolicyState

    state = PolicyState(dataclasses.replace(policy, abort_below=None, max_steps=None, done_above=t))
    for p in progress(c):
        if state.observe(p).signal == "done":
            return p.step
    return None


# --- text, JSON, plot ---


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def report_text(report: SignalReport, rules: Sequence[RuleResult]) -> str:
    """The views as a table, then the simulated decisions and the verdict."""
    lines = [
        f"signals side by side ({report.runs} runs; failure is the positive class; 95% "
        "bootstrap intervals over "
        f"{report.clusters}; p: permutation test against chance)"
    ]
    for v in report.views:
        label = v.name + (
            "  <- uses the run's final length, which a live monitor does not know"
            if v.uses_final_length
            else ""
        )
        lines.append(f"  {label}")
        for s, fig in v.figures.items():
            p = "n/a" if fig.p_value is None else f"{fig.p_value:.3f}"
            lines.append(
                f"    {s:<10} n={fig.n:<4} AUROC {_ci(fig.auroc, fig.auroc_ci):<20} AUPRC "
                f"{_ci(fig.auprc, fig.auprc_ci):<20} (chance {_num2(fig.prevalence)})  p={p}"
            )
    lines.append("")
    lines.append(
        "decisions simulated on whole runs (calibrated on one half of the tasks, "
        "applied to the other, "
        "then the reverse; steps saved over failing runs' whole length)"
    )
    for r in rules:
        fa = r.false_aborts
        ci = fa.ci
        what = (
            "false done (failures called done)"
            if r.rule == "done"
            else ("false aborts (successes aborted)")
        )
        row = f"  {r.rule:<18} alpha {r.alpha:g}: {what} {fa.k}/{fa.n} = {_pct(fa.rate)}" + (
            f" [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else ""
        )
        if r.rule == "done":
            row += (
                f"; fired on {len(r.first_alert)} successes, {_num2(r.earlier)} steps "
                "before their end on average"
            )
        else:
            row += f"; failing runs' steps saved {_pct(r.steps_saved)}"
            if r.tokens_saved is not None and r.rule != "step_budget":
                row += f", judge tokens saved {_pct(r.tokens_saved)} (of the scored steps)"
        lines.append(row)
        for fo in r.folds:
            parts = []
            if r.rule != "step_budget":
                parts.append(
                    "threshold " + ("none" if fo.threshold is None else f"{fo.threshold:.3f}")
                )
            if r.rule in ("step_budget", "judge+step_budget"):
                parts.append("budget " + ("none" if fo.budget is None else f"{fo.budget} steps"))
            val = ", ".join(parts)
            kind = "failures" if r.rule == "done" else "successes"
            armed = fo.threshold is not None or fo.budget is not None
            note = "" if armed else f" (not calibrated: {fo.samples} of {fo.needed} {kind} needed)"
            flag = "  SHIFT: realised rate above alpha" if fo.shifted else ""
            lines.append(
                f"    calibrated on {len(fo.calibrated_on)} tasks ({fo.samples} {kind}) -> "
                f"{val}{note}; "
                f"on the other {len(fo.applied_to)} tasks: {_pct(fo.false_rate)}{flag}"
            )
        if r.first_alert:
            alerts = ", ".join(f"{n}@{s}" for n, s in sorted(r.first_alert.items()))
            lines.append(
                f"    first alert ({'successes' if r.rule == 'done' else 'failing runs'}): {alerts}"
            )
    lines.append("")
    lines.append("verdict: " + report.verdict.text)
    return "\n".join(lines)


def _num2(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def report_json(report: SignalReport, rules: Sequence[RuleResult]) -> dict[str, Any]:
    """Every figure: per view and signal `auroc`, `auprc` and their intervals; the simulated
    rules; the verdict."""
    return {
        # not "runs": eval.json's "runs" lists the runs themselves
        "runs_with_outcome": report.runs,
        "bootstrap_over": report.clusters,
        "views": [
            {
                "view": v.name,
                "uses_final_length": v.uses_final_length,
                "signals": {s: dataclasses.asdict(f) for s, f in v.figures.items()},
            }
            for v in report.views
        ],
        "verdict": dataclasses.asdict(report.verdict),
        "aborts": {
            r.rule: {
                **{k: v for k, v in dataclasses.asdict(r).items() if k != "false_aborts"},
                ("false_done" if r.rule == "done" else "false_aborts"): {
                    "count": r.false_aborts.k,
                    "of": r.false_aborts.n,
                    "rate": r.false_aborts.rate,
                    "ci": r.false_aborts.ci,
                },
            }
            for r in rules
        },
        "curves": report.curves,
    }


COLORS = {"judge": "#264653", "step_index": "#e76f51", "chars": "#2a9d8f", "errors": "#e9c46a"}


def plot_curves(report: SignalReport, axes: Any) -> None:
    """ROC and PR curves of the pooled view on two matplotlib axes."""
    roc, pr = axes
    pooled = next(v for v in report.views if v.name == POOLED)
    for s, c in report.curves.items():
        fig = pooled.figures[s]
        label = f"{s} AUROC {_num2(fig.auroc)}"
        roc.plot(
            *zip(*c["roc"], strict=True),
            color=COLORS.get(s),
            label=label,
            linewidth=1.6 if s == "judge" else 1.2,
        )
        if c["pr"]:
            pr.plot(
                *zip(*c["pr"], strict=True),
                color=COLORS.get(s),
                label=f"{s} AUPRC {_num2(fig.auprc)}",
            )
    roc.plot([0, 1], [0, 1], color="#888888", linestyle=":", linewidth=1)
    roc.set(
        xlabel="false-positive rate (successes flagged)",
        ylabel="true-positive rate (failures flagged)",
    )
    roc.set_title(f"ROC, {POOLED} (failure positive)")
    pr.set(xlabel="recall (failures)", ylabel="precision", ylim=(0, 1.02))
    pr.set_title(f"Precision-recall, {POOLED}")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # runs of one outcome have no curve to name
            ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
