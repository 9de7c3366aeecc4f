"""Evaluate-and-tune on recorded runs: score every prefix as live, then measure and pick abort
thresholds.

`score_runs` replays recorded runs with known outcomes through the tracker, prefix by prefix
(exactly as the daemon would), with a disk cache keyed by content hash, judge, model, rubric and
settings, so a re-run costs nothing. `evaluate` turns the curves into the report: AUROC of the
score at 25/50/75% of a run against its outcome, the value-order (Spearman) correlation of each
curve with step index per outcome, and an abort-threshold sweep (false-abort rate on successful
runs, share of failing runs' steps saved) with the threshold that saves most within a target
false-abort rate.

`calibrate` replays the scored runs through the online calibration of `abort_below="auto"`
(`agent_monitor.calibration`): runs arrive one after another, each judged live against the
threshold the runs that ended before it give, then taught its outcome; in recorded order and in
many random orders, with the realised false-abort rate, the steps saved and when aborts begin.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import random
import sqlite3
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..calibration import Calibration, Family, Threshold, min_successes, task_family
from ..criteria import CriteriaSpec
from ..extractors import ErrorLines
from ..judges.base import Judge
from ..policy import AUTO, FAR, Policy, PolicyState, Schedule, held_out
from ..progress import Progress
from ..selection import Comparison
from ..tracker import DEFAULT_REPEATS, AsyncProgressTracker
from .recorded import RecordedRun

QUANTILES = (0.25, 0.5, 0.75)
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(1, 20))
DEFAULT_ORDERS = 200
"""Random orders `calibrate` replays the runs in (besides the recorded one)."""

FamilyBy = Literal["task", "all"]
"""How `calibrate` groups runs: by task (as the monitor does without `start.family`), or all in
one family."""


@dataclass(slots=True)
class RunCurve:
    """One recorded run scored prefix by prefix: its outcome and the score after each step (None:
    failed)."""

    name: str
    outcome: float | None
    scores: list[float | None]
    uncertainties: list[float | None] = field(default_factory=list)
    cached: int = 0
    family: Family | None = None
    """The calibration key a live run of this task would have (None: its name is its task)."""
    length: int = 0
    """The whole run's steps, however many were scored (`--max-steps` limits scoring, never
    this); 0: as scored."""
    chars: list[int] = field(default_factory=list)
    """The run's text size after each of its steps (the whole run): a baseline a live monitor has
    for free."""
    errors: list[int] = field(default_factory=list)
    """Errors seen after each step (non-zero exits, tracebacks, failed tests; the whole run):
    another baseline."""
    tokens: list[int] = field(default_factory=list)
    """Judge tokens (input and output) each scored step cost."""

    @property
    def steps(self) -> int:
        """The run's length in steps: the whole run, not the scored part."""
        return self.length or len(self.scores)

    @property
    def success(self) -> bool | None:
        """True for a successful run (outcome >= 0.5), None when the outcome is unknown."""
        return None if self.outcome is None else self.outcome >= 0.5

    def score_at(self, q: float) -> float | None:
        """The latest good score at fraction `q` of the whole run (step ceil(q * n)); None when not
        scored that far.

        This uses the run's final length, which a live monitor does not know: reports label it so.
        """
        n = self.steps
        if n == 0:
            return None
        upto = max(1, math.ceil(q * n))
        if upto > len(self.scores):
            # --max-steps stopped scoring before this point: no score, rather than an earlier one
            return None
        good = [s for s in self.scores[:upto] if s is not None]
        return good[-1] if good else None


class ScoreCache:
    """Scores of prefixes on disk, keyed by what determines them; a re-run of `eval` is free."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS scores (key TEXT PRIMARY KEY, body TEXT NOT NULL)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS pairs (key TEXT PRIMARY KEY, body TEXT NOT NULL)"
        )

    def get(self, key: str) -> Progress | None:
        """The cached result, or None."""
        row = self.db.execute("SELECT body FROM scores WHERE key = ?", (key,)).fetchone()
        return Progress.from_json(json.loads(row[0])) if row else None

    def put(self, key: str, p: Progress) -> None:
        """Cache a result (only successful ones: a failed call is retried next time)."""
        if p.ok:
            self.db.execute(
                "INSERT OR REPLACE INTO scores VALUES (?, ?)", (key, json.dumps(p.to_json()))
            )
            self.db.commit()

    def get_pair(self, key: str) -> Comparison | None:
        """The cached pairwise comparison, or None."""
        row = self.db.execute("SELECT body FROM pairs WHERE key = ?", (key,)).fetchone()
        return Comparison.from_json(json.loads(row[0])) if row else None

    def put_pair(self, key: str, c: Comparison) -> None:
        """Cache a comparison (only a successful one: a failed one is asked again next time)."""
        if c.ok:
            self.db.execute(
                "INSERT OR REPLACE INTO pairs VALUES (?, ?)", (key, json.dumps(c.to_json()))
            )
            self.db.commit()

    def close(self) -> None:
        """Close the file."""
        self.db.close()


def _key(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def _setting(judge: Judge, tracker: AsyncProgressTracker, repeats: int) -> list[str]:
    """What besides the text determines a score: the cache key's head."""
    return [
        getattr(judge, "name", ""),
        getattr(judge, "model", "") or "",
        tracker.rubric.hash,
        f"{tracker.min_mass}",
        f"{repeats}",
        # A bounded prompt is another prompt: scores cached for the whole run are not the bounded
        # one's.
        f"budget={tracker.prompt_budget}",
        # An LLM digest's summaries are other prompts again (keys without one are as before it
        # existed).
        *([f"digest={tracker.options.digest}"] if tracker.options.digest is not None else []),
    ]


def pair_key(
    judge: Judge,
    rubric_hash: str,
    min_mass: float,
    repeats: int,
    max_chars: int,
    task: str,
    a: Sequence[str],
    b: Sequence[str],
) -> str:
    """The cache key of a pairwise comparison of step texts `a` with `b`."""
    setting = [
        "pair",
        getattr(judge, "name", ""),
        getattr(judge, "model", "") or "",
        rubric_hash,
        f"{min_mass}",
        f"{repeats}",
        f"{max_chars}",
    ]
    return _key([*setting, task, f"{len(a)}", *a, f"{len(b)}", *b])


async def score_runs(
    runs: Sequence[RecordedRun],
    *,
    judge: Judge,
    criteria: CriteriaSpec = None,
    min_mass: float | None = None,
    repeats: int = DEFAULT_REPEATS,
    max_steps: int | None = None,
    cache: ScoreCache | None = None,
    prompt_budget: int | None = None,
    on_step: Callable[[RecordedRun, Progress], object] | None = None,
    digest: str | None = None,
) -> list[RunCurve]:
    """Score every prefix of every run, in order, as a live monitor would; cached prefixes are
    not judged."""
    curves = []
    for run in runs:
        steps = run.steps[:max_steps] if max_steps else run.steps
        tracker = AsyncProgressTracker(
            run.task,
            judge=judge,
            criteria=criteria,
            min_mass=min_mass,
            repeats=repeats,
            run_id=run.name,
            prompt_budget=prompt_budget,
            digest=digest,
        )
        curve = baseline_curve(run)
        curve.family = tracker.family
        setting = _setting(judge, tracker, repeats)
        texts: list[str] = [run.task]
        for step in steps:
            await tracker.add(step.text, images=step.images)
            texts.append(step.text)
            # A frame changes the prompt as much as text does: the cache key holds each frame's
            # digest.
            texts.extend(hashlib.sha256(i).hexdigest() for i in step.images)
            key = _key([*setting, *texts])
            hit = cache.get(key) if cache else None
            if hit is not None:
                tracker.restore([hit])
                p = hit
                curve.cached += 1
            else:
                p = await tracker.score()
                if cache:
                    cache.put(key, p)
            curve.scores.append(p.score if p.ok else None)
            curve.uncertainties.append(p.uncertainty if p.ok else None)
            curve.tokens.append(p.usage.input_tokens + p.usage.output_tokens)
            if on_step:
                on_step(run, p)
        curves.append(curve)
    return curves


def baseline_curve(run: RecordedRun) -> RunCurve:
    """A run's curve before any judge: its whole length, text size and error count after each
    step, no scores."""
    chars, errors = [], []
    size = found = 0
    count = ErrorLines()
    for step in run.steps:
        size += len(step.text)
        found += len(count(step.text).splitlines())
        chars.append(size)
        errors.append(found)
    # the judge's model and rubric join it when scored
    family = Family(task_family(run.task), "", "")
    return RunCurve(
        run.name, run.outcome, [], family=family, length=len(run.steps), chars=chars, errors=errors
    )


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties count half); None without both classes."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties averaged); None when either side is constant or too
    short."""
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)


def progress(curve: RunCurve) -> Iterator[Progress]:
    """The run's scores as the tracker gave them live, step by step (a None score: a failed judge
    call)."""
    us = [*curve.uncertainties, *[None] * (len(curve.scores) - len(curve.uncertainties))]
    for i, (s, u) in enumerate(zip(curve.scores, us, strict=False), 1):
        yield Progress(
            step=i, score=s, uncertainty=u if s is not None else None, criteria={}, ok=s is not None
        )


def abort_step(curve: RunCurve, policy: Policy, state: PolicyState | None = None) -> int | None:
    """The step at which `policy` (or a live `state`) would have aborted this run, or None."""
    state = state or PolicyState(policy)
    for p in progress(curve):
        if state.observe(p).signal == "abort":
            return p.step
    return None


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One abort threshold: how often it would abort a good run, and how much of the bad runs it
    saves."""

    threshold: float
    false_abort_rate: float | None
    steps_saved: float | None
    aborted_failures: int
    aborted_successes: int


@dataclass(slots=True)
class Report:
    """What `agent-monitor eval` prints and writes."""

    runs: list[RunCurve]
    auroc: dict[float, float | None]
    spearman: dict[str, float | None]
    sweep: list[SweepRow]
    recommended: SweepRow | None
    policy: Policy
    max_false_abort: float
    decisions: dict[str, int | None] = field(default_factory=dict)


def evaluate(
    curves: Sequence[RunCurve], *, policy: Policy | None = None, max_false_abort: float = 0.05
) -> Report:
    """Metrics over scored runs with known outcomes, and the abort threshold to recommend."""
    policy = policy or Policy()
    known = [c for c in curves if c.success is not None]
    aucs: dict[float, float | None] = {}
    for q in QUANTILES:
        pairs = [(s, bool(c.success)) for c in known if (s := c.score_at(q)) is not None]
        aucs[q] = auroc([s for s, _ in pairs], [y for _, y in pairs])
    rho: dict[str, float | None] = {}
    for label, want in (("success", True), ("failure", False)):
        values = []
        for c in known:
            if c.success is not want:
                continue
            pts = [(i, s) for i, s in enumerate(c.scores, 1) if s is not None]
            r = spearman([float(i) for i, _ in pts], [s for _, s in pts])
            if r is not None:
                values.append(r)
        rho[label] = sum(values) / len(values) if values else None
    good, bad = [c for c in known if c.success], [c for c in known if not c.success]
    sweep = []
    for t in THRESHOLDS:
        pol = dataclasses.replace(policy, abort_below=t)
        good_aborts = sum(abort_step(c, pol) is not None for c in good)
        saved = total = 0
        bad_aborts = 0
        for c in bad:
            n = c.steps  # the whole run: --max-steps limits scoring, never what a run's length is
            total += n
            at = abort_step(c, pol)
            if at is not None:
                bad_aborts += 1
                saved += n - at
        sweep.append(
            SweepRow(
                threshold=t,
                false_abort_rate=good_aborts / len(good) if good else None,
                steps_saved=saved / total if total else None,
                aborted_failures=bad_aborts,
                aborted_successes=good_aborts,
            )
        )
    # Only a threshold that saves something is worth recommending; ties go to the lowest (the least
    # aggressive).
    ok = [
        r
        for r in sweep
        if r.false_abort_rate is not None
        and r.false_abort_rate <= max_false_abort
        and (r.steps_saved or 0.0) > 0
    ]
    recommended = max(ok, key=lambda r: (r.steps_saved or 0.0, -r.threshold)) if ok else None
    decisions = (
        {c.name: abort_step(c, policy) for c in curves} if policy.abort_below is not None else {}
    )
    return Report(list(curves), aucs, rho, sweep, recommended, policy, max_false_abort, decisions)


def write_csv(report: Report, directory: str | Path) -> list[Path]:
    """`eval_curves.csv` (one row per run and step) and `eval_sweep.csv` (one row per threshold)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    curves, sweep = out / "eval_curves.csv", out / "eval_sweep.csv"
    with curves.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "outcome", "step", "steps", "score", "uncertainty", "abort_step"])
        for c in report.runs:
            for i, (s, u) in enumerate(zip(c.scores, c.uncertainties, strict=False), 1):
                w.writerow(
                    [
                        c.name,
                        c.outcome,
                        i,
                        c.steps,
                        _fmt(s),
                        _fmt(u),
                        report.decisions.get(c.name, ""),
                    ]
                )
    with sweep.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "abort_below",
                "false_abort_rate",
                "failing_steps_saved",
                "aborted_failures",
                "aborted_successes",
            ]
        )
        for r in report.sweep:
            w.writerow(
                [
                    r.threshold,
                    _fmt(r.false_abort_rate),
                    _fmt(r.steps_saved),
                    r.aborted_failures,
                    r.aborted_successes,
                ]
            )
    return [curves, sweep]


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


SMALL_SAMPLE = 10
"""Runs of each outcome below which `summary` says the AUROC is too uncertain to act on."""


def summary(report: Report) -> str:
    """The report as readable text."""
    lines = [
        f"{len(report.runs)} runs ({sum(c.success is True for c in report.runs)} success, "
        f"{sum(c.success is False for c in report.runs)} failure)"
    ]
    lines.append(
        "AUROC of the score against the outcome: "
        + ", ".join(f"at {int(q * 100)}% {_num(a)}" for q, a in report.auroc.items())
    )
    good, bad = (
        sum(c.success is True for c in report.runs),
        sum(c.success is False for c in report.runs),
    )
    if min(good, bad) < SMALL_SAMPLE:
        lines.append(
            f"  (from {good} successful and {bad} failed runs: too few to trust; one run more "
            "or less can move "
            f"AUROC far, so score at least {SMALL_SAMPLE} of each before deciding on it)"
        )
    lines.append(
        "value-order correlation (Spearman of score vs step), mean: "
        + ", ".join(f"{k} {_num(v)}" for k, v in report.spearman.items())
    )
    lines.append("")
    lines.append(f"{'abort_below':>11}  {'false aborts':>12}  {'failing steps saved':>19}")
    for r in report.sweep:
        mark = (
            "  <- recommended"
            if report.recommended is not None and r.threshold == report.recommended.threshold
            else ""
        )
        lines.append(
            f"{r.threshold:>11.2f}  {_pct(r.false_abort_rate):>12}  {_pct(r.steps_saved):>19}{mark}"
        )
    lines.append("")
    p = report.policy
    longest = max((len(c.scores) for c in report.runs), default=0)
    if report.recommended is None and longest < p.min_steps + p.patience - 1:
        lines.append(
            f"no abort was possible: one needs {p.patience} scored steps in a row from step "
            f"{p.min_steps} on "
            f"(step {p.min_steps + p.patience - 1} at the earliest), and the longest run has "
            f"{longest} scored "
            "steps; score more steps (--max-steps) or lower --min-steps / --patience to "
            "judge this judge's aborts"
        )
    elif report.recommended is None:
        lines.append(
            f"no threshold saves failing runs' steps while keeping false aborts at or below "
            f"{report.max_false_abort:.0%}: do not let this judge abort runs yet"
        )
    else:
        r = report.recommended
        lines.append(
            f"recommended: --abort-below {r.threshold:.2f} (with --min-steps "
            f"{report.policy.min_steps} --patience "
            f"{report.policy.patience}): false aborts {_pct(r.false_abort_rate)}, failing "
            f"runs' steps saved {_pct(r.steps_saved)}"
        )
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def plot(
    report: Report,
    path: str | Path,
    *,
    note: str | None = None,
    more: Callable[[Any], None] | None = None,
) -> Path:
    """A PNG: every run's curve coloured by outcome, and the threshold sweep (`note`: a line under
    the title).

    `more` draws a second row on a pair of axes (eval: the ROC and PR curves of the judge and the
    baselines).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if more is None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, grid = plt.subplots(2, 2, figsize=(13, 10), gridspec_kw={"width_ratios": [3, 2]})
        (ax1, ax2), below = grid
        more(below)
    for c in report.runs:
        xs = [i / max(1, c.steps) for i, s in enumerate(c.scores, 1) if s is not None]
        ys = [s for s in c.scores if s is not None]
        color = "#2a9d8f" if c.success else "#e76f51" if c.success is False else "#888888"
        ax1.plot(xs, ys, color=color, alpha=0.55, linewidth=1.4)
    ax1.plot([], [], color="#2a9d8f", label="success")
    ax1.plot([], [], color="#e76f51", label="failure")
    if report.recommended is not None:
        ax1.axhline(
            report.recommended.threshold,
            color="black",
            linestyle="--",
            linewidth=1,
            label="recommended abort_below",
        )
    ax1.set(xlabel="fraction of the run", ylabel="progress score", ylim=(0, 1), xlim=(0, 1))
    ax1.set_title("Progress curves by outcome")
    ax1.legend(loc="upper left")
    ax1.grid(alpha=0.3)
    ts = [r.threshold for r in report.sweep]
    ax2.plot(
        ts,
        [r.false_abort_rate or 0 for r in report.sweep],
        color="#e76f51",
        label="false-abort rate (successes aborted)",
    )
    ax2.plot(
        ts,
        [r.steps_saved or 0 for r in report.sweep],
        color="#264653",
        label="failing runs' steps saved",
    )
    ax2.axhline(report.max_false_abort, color="#e76f51", linestyle=":", linewidth=1)
    if report.recommended is not None:
        ax2.axvline(report.recommended.threshold, color="black", linestyle="--", linewidth=1)
    ax2.set(xlabel="abort_below", ylabel="share", ylim=(0, 1), xlim=(0, 1))
    ax2.set_title("Abort threshold sweep")
    ax2.legend(loc="upper left", fontsize=8)
    ax2.grid(alpha=0.3)
    good, bad = (
        sum(c.success is True for c in report.runs),
        sum(c.success is False for c in report.runs),
    )
    auc = report.auroc.get(0.5)
    fig.suptitle(
        f"{len(report.runs)} runs ({good} success, {bad} failure); AUROC at half-run "
        f"{'n/a' if auc is None else f'{auc:.2f}'}"
        + (f"\n{textwrap.fill(note, 150)}" if note else ""),
        fontsize=11,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report_json(report: Report) -> dict[str, Any]:
    """The report as JSON-ready data."""
    return {
        "runs": [
            {
                "name": c.name,
                "outcome": c.outcome,
                "scores": c.scores,
                "abort_step": report.decisions.get(c.name),
            }
            for c in report.runs
        ],
        "auroc": {str(q): a for q, a in report.auroc.items()},
        "spearman": report.spearman,
        "sweep": [dataclasses.asdict(r) for r in report.sweep],
        "recommended": dataclasses.asdict(report.recommended) if report.recommended else None,
    }


@dataclass(slots=True)
class ScheduledRun:
    """One recorded run scored live under one schedule: which steps were scored (and why), what
    it cost, its abort."""

    name: str
    outcome: float | None
    steps: int
    scored: dict[int, str] = field(default_factory=dict)
    """Step -> why it was scored ("every step", "near abort_below 0.4", "max_gap 4", "end", ...)."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Step -> why it was not scored alone (`FAR`): it folded into the next scoring."""
    calls: int = 0
    tokens: int = 0
    """Judge tokens, input and output, over every scoring (failed ones too: they were spent)."""
    abort_step: int | None = None
    abort_tokens: int | None = None
    """The run's judge tokens up to its abort decision (None: not aborted)."""
    failed: int = 0


@dataclass(slots=True)
class ScheduleReport:
    """Every run under each schedule, for `eval --schedule every,adaptive`."""

    policy: Policy
    runs: dict[str, list[ScheduledRun]]
    """Schedule -> its runs, in the recorded order."""

    def totals(self, schedule: str) -> dict[str, Any]:
        """Judge calls and tokens, scorings made and skipped, and aborts under one schedule."""
        rs = self.runs[schedule]
        aborts = {r.name: r.abort_step for r in rs if r.abort_step is not None}
        spent = [r.abort_tokens for r in rs if r.abort_tokens is not None]
        return {
            "runs": len(rs),
            "steps": sum(r.steps for r in rs),
            "scorings": sum(len(r.scored) for r in rs),
            "skipped": sum(len(r.skipped) for r in rs),
            "failed": sum(r.failed for r in rs),
            "calls": sum(r.calls for r in rs),
            "tokens": sum(r.tokens for r in rs),
            "tokens_per_run": sum(r.tokens for r in rs) / len(rs) if rs else None,
            "tokens_per_decision": sum(spent) / len(spent) if spent else None,
            "aborts": aborts,
        }

    def compare(self, base: str = "every", other: str = "adaptive") -> dict[str, Any]:
        """Whether `other` made `base`'s abort decisions (same runs, abort step within max_gap),
        and its token saving."""
        a, b = self.totals(base), self.totals(other)
        gap = self.policy.max_gap
        same_runs = set(a["aborts"]) == set(b["aborts"])
        late = {n: b["aborts"][n] - s for n, s in a["aborts"].items() if n in b["aborts"]}
        within = same_runs and all(0 <= d <= gap for d in late.values())
        saved = 1.0 - b["tokens"] / a["tokens"] if a["tokens"] else None
        return {
            "same_runs": same_runs,
            "within_max_gap": within,
            "abort_delay": late,
            "only_" + base: sorted(set(a["aborts"]) - set(b["aborts"])),
            "only_" + other: sorted(set(b["aborts"]) - set(a["aborts"])),
            "tokens_saved": saved,
            "calls_saved": 1.0 - b["calls"] / a["calls"] if a["calls"] else None,
        }


async def score_scheduled(
    runs: Sequence[RecordedRun],
    *,
    judge: Judge,
    policy: Policy,
    schedule: Schedule,
    criteria: CriteriaSpec = None,
    min_mass: float | None = None,
    repeats: int = DEFAULT_REPEATS,
    max_steps: int | None = None,
    cache: ScoreCache | None = None,
    prompt_budget: int | None = None,
    digest: str | None = None,
) -> list[ScheduledRun]:
    """Every run stepped through live under `schedule`: each step planned as the monitor plans it,
    scored or skipped.

    The run's policy decides as live (a fixed `abort_below`: "auto" needs `calibrate`'s online
    replay), so the schedule sees the thresholds in force, the best score and the streak. A cache
    hit counts the tokens the recorded scoring spent: the figures are what the judge would be paid,
    whatever was cached.
    """
    pol = dataclasses.replace(policy, schedule=schedule)
    out = []
    for run in runs:
        steps = run.steps[:max_steps] if max_steps else run.steps
        tracker = AsyncProgressTracker(
            run.task,
            judge=judge,
            criteria=criteria,
            min_mass=min_mass,
            repeats=repeats,
            run_id=run.name,
            policy=pol,
            prompt_budget=prompt_budget,
            digest=digest,
        )
        r = ScheduledRun(run.name, run.outcome, len(steps))
        texts: list[str] = [run.task]
        last = 0
        for i, step in enumerate(steps, 1):
            await tracker.add(step.text)
            texts.append(step.text)
            if r.abort_step is not None:
                continue  # the harness was told to stop: nothing more is scored
            plan = tracker.plan(i, ending=i == len(steps))
            if not plan.score:
                r.skipped[i] = plan.reason
                continue
            k = repeats if plan.full else 1
            key = _key([*_setting(judge, tracker, k), *texts])
            hit = cache.get(key) if cache else None
            skipped = FAR if i - last > 1 else None
            if hit is not None:
                hit = dataclasses.replace(
                    hit, coalesced=i - last, scheduled=plan.reason, skipped=skipped
                )
                tracker.restore([hit])
                p = tracker.latest
                assert p is not None
            else:
                p = await tracker.score(i, coalesced=i - last, plan=plan, skipped=skipped)
                if cache:
                    cache.put(key, dataclasses.replace(p, signal=None, totals=p.usage, delta=None))
            last = i
            r.scored[i] = plan.reason if schedule != "every" else "every step"
            r.calls += p.calls
            r.tokens += p.usage.input_tokens + p.usage.output_tokens
            r.failed += not p.ok
            if p.signal is not None and p.signal.signal == "abort":
                r.abort_step, r.abort_tokens = i, r.tokens
        out.append(r)
    return out


def schedule_summary(report: ScheduleReport) -> str:
    """The schedules side by side: judge calls and tokens, scorings skipped, abort decisions and
    their steps."""
    pol = report.policy
    lines = [
        f"schedules (abort_below {pol.abort_below}, min_steps {pol.min_steps}, patience "
        f"{pol.patience}; adaptive: "
        f"max_gap {pol.max_gap}, margin {pol.margin:g}, repeats_near "
        f"{str(pol.repeats_near).lower()})",
        f"{'schedule':<10} {'scorings':>8} {'skipped':>7} {'calls':>6} {'judge tokens':>12} "
        f"{'per run':>9} "
        f"{'per abort':>9}  aborts (run@step)",
    ]
    for name in report.runs:
        t = report.totals(name)
        per_run = "n/a" if t["tokens_per_run"] is None else f"{t['tokens_per_run']:.0f}"
        per_dec = "n/a" if t["tokens_per_decision"] is None else f"{t['tokens_per_decision']:.0f}"
        aborts = ", ".join(f"{_short(n, 32)}@{s}" for n, s in t["aborts"].items()) or "none"
        lines.append(
            f"{name:<10} {t['scorings']:>8} {t['skipped']:>7} {t['calls']:>6} "
            f"{t['tokens']:>12} {per_run:>9} "
            f"{per_dec:>9}  {len(t['aborts'])}: {aborts}"
        )
    if "every" in report.runs and "adaptive" in report.runs:
        c = report.compare()
        same = "the same runs" if c["same_runs"] else "different runs"
        lines.append(
            f"adaptive vs every: {same} aborted"
            + (f", each within max_gap {pol.max_gap} steps" if c["within_max_gap"] else "")
            + f"; judge tokens {_signed(c['tokens_saved'])} fewer, calls "
            f"{_signed(c['calls_saved'])} fewer"
        )
        if c["only_every"] or c["only_adaptive"]:
            lines.append(
                f"  aborted only under every: {c['only_every']}; only under "
                f"adaptive: {c['only_adaptive']}"
            )
        if not c["within_max_gap"] and c["abort_delay"]:
            lines.append(f"  abort step adaptive minus every: {c['abort_delay']}")
    return "\n".join(lines)


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def schedule_json(report: ScheduleReport) -> dict[str, Any]:
    """The schedules' report as JSON-ready data: totals, the comparison, and per run which steps
    were scored and why."""
    out: dict[str, Any] = {"policy": report.policy.as_dict(), "schedules": {}}
    for name, rs in report.runs.items():
        out["schedules"][name] = {
            "totals": report.totals(name),
            "runs": [
                {
                    "name": r.name,
                    "outcome": r.outcome,
                    "steps": r.steps,
                    "calls": r.calls,
                    "tokens": r.tokens,
                    "abort_step": r.abort_step,
                    "abort_tokens": r.abort_tokens,
                    "curve": [
                        {"step": i, "scored": r.scored[i]}
                        if i in r.scored
                        else {"step": i, "skipped": r.skipped[i]}
                        for i in range(1, r.steps + 1)
                        if i in r.scored or i in r.skipped
                    ],
                }
                for r in rs
            ],
        }
    if "every" in report.runs and "adaptive" in report.runs:
        out["compare"] = report.compare()
    return out


@dataclass(frozen=True, slots=True)
class Judged:
    """One run as the online procedure judged it: the threshold in force, and the step it was
    aborted at."""

    name: str
    family: str
    success: bool | None
    steps: int
    threshold: float | None
    """The calibrated threshold in force while it ran (None: the rule was not armed for its
    family)."""
    abort_step: int | None
    held_out: bool = False
    """In the policy's holdout share (by run id): judged, never aborted, and its outcome teaches."""
    taught: bool = False
    """Its outcome taught the calibration (not when an abort rule could have stopped it:
    censored)."""

    @property
    def armed(self) -> bool:
        """A threshold was in force while it ran and it was not held out: the rule could abort
        it."""
        return self.threshold is not None and not self.held_out


@dataclass(frozen=True, slots=True)
class Order:
    """The online procedure over one order of the runs."""

    name: str
    """Which order: `recorded`, or `random N`."""
    runs: tuple[Judged, ...]

    def _count(self, success: bool | None, *, armed: bool = False, aborted: bool = False) -> int:
        return sum(
            1
            for r in self.runs
            if r.success is success
            and (r.armed or not armed)
            and (r.abort_step is not None or not aborted)
        )

    @property
    def aborts(self) -> int:
        """Runs aborted, whatever their outcome."""
        return sum(r.abort_step is not None for r in self.runs)

    @property
    def runs_armed(self) -> int:
        """Runs judged while their family's threshold was in force (held-out ones aside)."""
        return sum(r.armed for r in self.runs)

    @property
    def runs_taught(self) -> int:
        """Runs whose outcome taught the calibration."""
        return sum(r.taught for r in self.runs)

    @property
    def successes_armed(self) -> int:
        """Successful runs judged while armed: the ones the guarantee is about."""
        return self._count(True, armed=True)

    @property
    def aborted_successes(self) -> int:
        """Successful runs aborted (false aborts)."""
        return self._count(True, aborted=True)

    @property
    def aborted_failures(self) -> int:
        """Failing runs aborted."""
        return self._count(False, aborted=True)

    @property
    def false_abort_rate_armed(self) -> float | None:
        """Aborted successes over the successes judged while armed (None: none was)."""
        n = self.successes_armed
        return self.aborted_successes / n if n else None

    @property
    def false_abort_rate(self) -> float | None:
        """Aborted successes over all successes."""
        n = self._count(True)
        return self.aborted_successes / n if n else None

    @property
    def steps_saved(self) -> float | None:
        """Share of failing runs' steps that came after their abort."""
        bad = [r for r in self.runs if r.success is False]
        total = sum(r.steps for r in bad)
        saved = sum(r.steps - r.abort_step for r in bad if r.abort_step is not None)
        return saved / total if total else None

    @property
    def runs_before_first_abort(self) -> int | None:
        """Runs judged before the first abort (None: nothing was aborted)."""
        return next((i for i, r in enumerate(self.runs) if r.abort_step is not None), None)

    @property
    def successes_before_first_abort(self) -> int | None:
        """Successful runs that had ended before the first abort (None: nothing was aborted)."""
        first = self.runs_before_first_abort
        return None if first is None else sum(r.success is True for r in self.runs[:first])


ORDER_METRICS: dict[str, Callable[[Order], float | None]] = {
    "false_abort_rate_armed": lambda o: o.false_abort_rate_armed,
    "false_abort_rate": lambda o: o.false_abort_rate,
    "steps_saved": lambda o: o.steps_saved,
    "runs_armed": lambda o: o.runs_armed,
    "runs_taught": lambda o: o.runs_taught,
    "runs_before_first_abort": lambda o: o.runs_before_first_abort,
    "successes_before_first_abort": lambda o: o.successes_before_first_abort,
}
"""What `calibrate` reports per order and summarises over orders."""


@dataclass(frozen=True, slots=True)
class Spread:
    """A metric over the orders that have it: mean, min, 5th and 95th percentiles, max."""

    mean: float
    low: float
    p5: float
    p95: float
    high: float
    orders: int
    """Orders with a value (e.g. those with an abort, for "runs before the first abort")."""

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        """The spread of the values that are not None; None when there are none."""
        xs = sorted(v for v in values if v is not None)
        if not xs:
            return None
        return cls(
            sum(xs) / len(xs), xs[0], _quantile(xs, 0.05), _quantile(xs, 0.95), xs[-1], len(xs)
        )


def _quantile(xs: Sequence[float], q: float) -> float:
    # Linear interpolation between order statistics (numpy's default).
    at = q * (len(xs) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


@dataclass(frozen=True, slots=True)
class FamilyResult:
    """A family's calibration after every run has ended, and what its threshold does to its own
    failing runs."""

    name: str
    threshold: Threshold
    failing: int
    """The family's recorded failing runs."""
    failures_aborted: int
    """Of those, the ones its final threshold aborts (in-sample: some taught it)."""
    example: str
    """The name of one of its runs (a family named by a long task's hash says little)."""


@dataclass(slots=True)
class CalibrateReport:
    """What `agent-monitor eval --calibrate` prints and writes."""

    policy: Policy
    family_by: FamilyBy
    seed: int
    recorded: Order
    shuffled: list[Order]
    families: list[FamilyResult]

    @property
    def orders(self) -> list[Order]:
        """The recorded order, then the random ones."""
        return [self.recorded, *self.shuffled]

    @property
    def spreads(self) -> dict[str, Spread | None]:
        """Each metric of ORDER_METRICS over every order, the recorded one included."""
        return {k: Spread.of([f(o) for o in self.orders]) for k, f in ORDER_METRICS.items()}

    @property
    def never_aborts(self) -> str | None:
        """Why the procedure aborted nothing in any order; None when it aborted something."""
        if any(o.aborts for o in self.orders):
            return None
        alpha = self.policy.alpha
        needed = min_successes(alpha)
        if not any(o.runs_armed for o in self.orders):
            best = max(self.families, key=lambda f: f.threshold.successes, default=None)
            if best is None or best.threshold.successes < needed:
                most = (
                    ""
                    if best is None
                    else (f" (most: {best.threshold.successes}, {_short(best.name)!r})")
                )
                return f"no family reached {needed} successful runs at alpha {alpha:g}{most}"
            return (
                f"no run came after {needed} successful runs of its family had ended (at "
                f"alpha {alpha:g} a family "
                f"is armed only then)"
            )
        armed = Spread.of([o.runs_armed for o in self.orders])
        assert armed is not None
        return (
            f"armed for {armed.mean:.1f} runs per order on average, but its thresholds "
            "aborted none of them: the "
            f"judge's scores do not put failing runs below the lowest-scoring successful ones"
        )

    @property
    def armed_abort_shares(self) -> tuple[float | None, float | None]:
        """(failing, successful): the share of each aborted among the runs judged while armed,
        over every order."""
        armed = [r for o in self.orders for r in o.runs if r.armed]

        def share(success: bool) -> float | None:
            runs = [r for r in armed if r.success is success]
            return sum(r.abort_step is not None for r in runs) / len(runs) if runs else None

        return share(False), share(True)

    @property
    def no_better_than_chance(self) -> bool:
        """It aborts, but failing runs no more often than successful ones (judged while armed,
        over every order)."""
        fail, succ = self.armed_abort_shares
        return self.never_aborts is None and fail is not None and succ is not None and fail <= succ


def _family(curve: RunCurve, family_by: FamilyBy) -> Family:
    own = curve.family or Family(task_family(curve.name), "", "")
    return own if family_by == "task" else Family("all", own.model, own.rubric)


def replay_online(
    curves: Sequence[RunCurve],
    order: Sequence[int],
    *,
    policy: Policy,
    family_by: FamilyBy = "task",
) -> tuple[list[Judged], Calibration]:
    """Runs in `order`, each judged live against the threshold the runs that ended before it give,
    then taught.

    Each run steps through its recorded scores with the live `PolicyState` of `abort_below="auto"`,
    its threshold from a real `Calibration`, held out by its name as live by its run id, and teaches
    its outcome only when the monitor would learn from it (not when an abort rule could have stopped
    it), so eval and the monitor cannot disagree.
    """
    pol = dataclasses.replace(policy, abort_below=AUTO)
    calibration = Calibration()
    judged = []
    for i in order:
        curve = curves[i]
        family = _family(curve, family_by)

        def threshold(family: Family = family) -> Threshold:
            return calibration.threshold(family, pol)

        in_force = threshold().value  # runs end one after another: it holds for the whole run
        state = PolicyState(pol, threshold=threshold, held_out=held_out(curve.name, pol.holdout))
        at = abort_step(curve, pol, state)
        # The index keeps two recorded runs of the same name apart (a run counts once per family).
        sample = calibration.record(
            family, f"{i}:{curve.name}", curve.outcome, list(progress(curve)), exposed=state.exposed
        )
        judged.append(
            Judged(
                curve.name,
                family.name,
                curve.success,
                curve.steps,
                in_force,
                at,
                state.held_out,
                sample is not None,
            )
        )
    return judged, calibration


def calibrate(
    curves: Sequence[RunCurve],
    *,
    policy: Policy | None = None,
    orders: int = DEFAULT_ORDERS,
    seed: int = 0,
    family_by: FamilyBy = "task",
) -> CalibrateReport:
    """The online calibration of `abort_below="auto"` replayed in recorded order and in `orders`
    random ones."""
    policy = dataclasses.replace(policy or Policy(), abort_below=AUTO)
    if orders < 0:
        raise ValueError(
            f"orders={orders}; use 0 or more random orders (0: the recorded order only)"
        )
    index = list(range(len(curves)))
    judged, calibration = replay_online(curves, index, policy=policy, family_by=family_by)
    recorded = Order("recorded", tuple(judged))
    rng = random.Random(seed)
    shuffled = []
    for k in range(orders):
        rng.shuffle(index)
        shuffled.append(
            Order(
                f"random {k + 1}",
                tuple(replay_online(curves, index, policy=policy, family_by=family_by)[0]),
            )
        )
    families = []
    for summary_ in calibration.families():
        th = calibration.threshold(summary_.family, policy)
        fixed = dataclasses.replace(policy, abort_below=th.value)
        members = [c for c in curves if _family(c, family_by) == summary_.family]
        bad = [c for c in members if c.success is False]
        aborted = sum(abort_step(c, fixed) is not None for c in bad) if th.value is not None else 0
        families.append(FamilyResult(summary_.family.name, th, len(bad), aborted, members[0].name))
    families.sort(key=lambda f: (-f.threshold.successes, f.name))
    return CalibrateReport(policy, family_by, seed, recorded, shuffled, families)


_METRIC_LABELS = {
    "false_abort_rate_armed": "false-abort rate (successes judged while armed)",
    "false_abort_rate": "false-abort rate (all successes)",
    "steps_saved": "failing runs' steps saved",
    "runs_armed": "runs judged while armed",
    "runs_taught": "runs whose outcome taught the calibration",
    "runs_before_first_abort": "runs before the first abort",
    "successes_before_first_abort": "successes before the first abort",
}
_RATES = ("false_abort_rate_armed", "false_abort_rate", "steps_saved")


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _metric(key: str, x: float | None) -> str:
    if x is None:
        return "n/a"
    if key in _RATES:
        return f"{x:.1%}"
    # Counts: a mean or a percentile may fall between two runs.
    return f"{round(x)}" if abs(x - round(x)) < 1e-9 else f"{x:.1f}"


def calibrate_summary(report: CalibrateReport) -> str:
    """The online calibration report as readable text: the verdict first, then the figures and
    the families."""
    pol, runs = report.policy, report.recorded.runs
    good, bad = sum(r.success is True for r in runs), sum(r.success is False for r in runs)
    needed = min_successes(pol.alpha)
    grouping = (
        f"families by task ({len(report.families)})"
        if report.family_by == "task"
        else "one family of every run (--family-by all)"
    )
    lines = [
        f"online calibration (abort_below auto): {len(runs)} runs ({good} success, {bad} "
        f"failure), {grouping}, "
        f"alpha {pol.alpha:g} (armed from {needed} successful runs per family), min_steps "
        f"{pol.min_steps}, "
        f"patience {pol.patience}, holdout {pol.holdout:g} ({sum(r.held_out for r in runs)} "
        "of these runs by "
        f"name); the recorded order and {len(report.shuffled)} random orders (seed {report.seed})"
    ]
    never = report.never_aborts
    if never is not None:
        lines.append(f"verdict: never aborts: {never}")
    else:
        with_abort = sum(o.aborts > 0 for o in report.orders)
        lines.append(f"verdict: aborts runs in {with_abort} of {len(report.orders)} orders")
        fail, succ = report.armed_abort_shares
        lines.append(
            f"of the runs judged while armed (every order): {_pct(fail)} of the failing ones "
            "aborted, "
            f"{_pct(succ)} of the successful ones"
        )
        if report.no_better_than_chance:
            lines.append(
                "warning: no better than chance: failing runs are aborted no more often than "
                "successful ones; "
                "this judge's aborts cost successes for nothing"
            )
    if report.family_by == "all":
        lines.append(
            "note: --family-by all pools different tasks into one family: the alpha bound "
            "then holds only while "
            "the mix of tasks stays the same (random orders of these runs keep it; a stream "
            "that runs one task "
            "after another does not), so read these figures as indicative only"
        )
    lines.append(
        "note: as live, a run judged while armed teaches nothing (its outcome is censored: "
        "an aborted success "
        "reports none); the runs before the rule is armed and the held-out ones (never "
        "aborted) teach"
    )
    lines.append("")
    lines.append(f"{'':<50} {'recorded':>9} {'mean':>7} {'min':>7} {'5%':>7} {'95%':>7} {'max':>7}")
    for key, f in ORDER_METRICS.items():
        s = report.spreads[key]
        cols = [
            _metric(key, v) for v in ((s.mean, s.low, s.p5, s.p95, s.high) if s else (None,) * 5)
        ]
        row = f"{_METRIC_LABELS[key]:<50} {_metric(key, f(report.recorded)):>9} " + " ".join(
            f"{c:>7}" for c in cols
        )
        if s is not None and s.orders < len(report.orders):
            row += f"  (in the {s.orders} orders that have it)"
        lines.append(row)
    lines.append("")
    lines.append(
        "families after the recorded order (taught: the runs the calibration learnt from):"
    )
    lines.append(
        f"  {'family':<50} {'a run of it':<28} {'taught: successes':>17} {'failures':>8}  threshold"
    )
    for fam in report.families:
        th = fam.threshold
        if th.value is None:
            what = f"never aborts ({th.successes} of {th.needed} successful runs needed)"
        else:
            what = (
                f"{th.value:.3f}: aborts {fam.failures_aborted} of its {fam.failing} "
                "failing runs (in-sample)"
            )
            if fam.failures_aborted == 0:
                what += "; never aborts them in effect"
        lines.append(
            f"  {_short(fam.name):<50} {_short(fam.example, 28):<28} {th.successes:>17} "
            f"{th.failures:>8}  {what}"
        )
    return "\n".join(lines)


def calibrate_json(report: CalibrateReport) -> dict[str, Any]:
    """The online calibration report as JSON-ready data (per-run decisions for the recorded order
    only)."""

    def order(o: Order, runs: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"order": o.name, **{k: f(o) for k, f in ORDER_METRICS.items()}}
        out.update(aborted_successes=o.aborted_successes, aborted_failures=o.aborted_failures)
        if runs:
            out["runs"] = [dataclasses.asdict(r) for r in o.runs]
        return out

    return {
        "policy": report.policy.as_dict(),
        "min_successes": min_successes(report.policy.alpha),
        "family_by": report.family_by,
        "seed": report.seed,
        "never_aborts": report.never_aborts,
        "armed_abort_shares": dict(
            zip(("failing", "successful"), report.armed_abort_shares, strict=True)
        ),
        "no_better_than_chance": report.no_better_than_chance,
        "spread": {k: dataclasses.asdict(s) if s else None for k, s in report.spreads.items()},
        "recorded": order(report.recorded, True),
        "random": [order(o, False) for o in report.shuffled],
        "families": [
            {
                "family": f.name,
                "example_run": f.example,
                "successes": f.threshold.successes,
                "failures": f.threshold.failures,
                "threshold": f.threshold.value,
                "reason": f.threshold.reason,
                "failing_runs": f.failing,
                "failures_aborted": f.failures_aborted,
            }
            for f in report.families
        ],
    }
