"""Evaluate-and-tune on recorded runs: score every prefix as live, then measure and pick abort thresholds.

`score_runs` replays recorded runs with known outcomes through the tracker, prefix by prefix
(exactly as the daemon would), with a disk cache keyed by content hash, judge, model, rubric and
settings, so a re-run costs nothing. `evaluate` turns the curves into the report: AUROC of the
score at 25/50/75% of a run against its outcome, the value-order (Spearman) correlation of each
curve with step index per outcome, and an abort-threshold sweep (false-abort rate on successful
runs, share of failing runs' steps saved) with the threshold that saves most within a target
false-abort rate.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .criteria import CriteriaSpec
from .judges.base import Judge
from .policy import Policy, PolicyState
from .progress import Progress
from .recorded import RecordedRun
from .tracker import DEFAULT_REPEATS, AsyncProgressTracker

QUANTILES = (0.25, 0.5, 0.75)
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(1, 20))


@dataclass(slots=True)
class RunCurve:
    """One recorded run scored prefix by prefix: its outcome and the score after each step (None: failed)."""

    name: str
    outcome: float | None
    scores: list[float | None]
    uncertainties: list[float | None] = field(default_factory=list)
    cached: int = 0

    @property
    def success(self) -> bool | None:
        """True for a successful run (outcome >= 0.5), None when the outcome is unknown."""
        return None if self.outcome is None else self.outcome >= 0.5

    def score_at(self, q: float) -> float | None:
        """The latest good score at fraction `q` of the run (step ceil(q * n))."""
        n = len(self.scores)
        if n == 0:
            return None
        upto = max(1, math.ceil(q * n))
        good = [s for s in self.scores[:upto] if s is not None]
        return good[-1] if good else None


class ScoreCache:
    """Scores of prefixes on disk, keyed by what determines them; a re-run of `eval` is free."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute("CREATE TABLE IF NOT EXISTS scores (key TEXT PRIMARY KEY, body TEXT NOT NULL)")

    def get(self, key: str) -> Progress | None:
        """The cached result, or None."""
        row = self.db.execute("SELECT body FROM scores WHERE key = ?", (key,)).fetchone()
        return Progress.from_json(json.loads(row[0])) if row else None

    def put(self, key: str, p: Progress) -> None:
        """Cache a result (only successful ones: a failed call is retried next time)."""
        if p.ok:
            self.db.execute("INSERT OR REPLACE INTO scores VALUES (?, ?)", (key, json.dumps(p.to_json())))
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


async def score_runs(
    runs: Sequence[RecordedRun],
    *,
    judge: Judge,
    criteria: CriteriaSpec = None,
    min_mass: float | None = None,
    repeats: int = DEFAULT_REPEATS,
    max_steps: int | None = None,
    cache: ScoreCache | None = None,
    on_step: Callable[[RecordedRun, Progress], object] | None = None,
) -> list[RunCurve]:
    """Score every prefix of every run, in order, as a live monitor would; cached prefixes are not judged."""
    curves = []
    for run in runs:
        steps = run.steps[:max_steps] if max_steps else run.steps
        tracker = AsyncProgressTracker(
            run.task, judge=judge, criteria=criteria, min_mass=min_mass, repeats=repeats, run_id=run.name
        )
        curve = RunCurve(run.name, run.outcome, [])
        setting = [
            getattr(judge, "name", ""),
            getattr(judge, "model", "") or "",
            tracker.rubric.hash,
            f"{tracker.min_mass}",
            f"{repeats}",
        ]
        texts: list[str] = [run.task]
        for step in steps:
            await tracker.add(step.text)
            texts.append(step.text)
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
            if on_step:
                on_step(run, p)
        curves.append(curve)
    return curves


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
    """Spearman's rank correlation (ties averaged); None when either side is constant or too short."""
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)


def abort_step(curve: RunCurve, policy: Policy) -> int | None:
    """The step at which `policy` would have aborted this run, or None."""
    state = PolicyState(policy)
    for i, (s, u) in enumerate(zip(curve.scores, curve.uncertainties or [None] * len(curve.scores), strict=False), 1):
        p = Progress(step=i, score=s, uncertainty=u if s is not None else None, criteria={}, ok=s is not None)
        if state.observe(p).signal == "abort":
            return i
    return None


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One abort threshold: how often it would abort a good run, and how much of the bad runs it saves."""

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


def evaluate(curves: Sequence[RunCurve], *, policy: Policy | None = None, max_false_abort: float = 0.05) -> Report:
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
            n = len(c.scores)
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
    # Only a threshold that saves something is worth recommending; ties go to the lowest (the least aggressive).
    ok = [
        r
        for r in sweep
        if r.false_abort_rate is not None and r.false_abort_rate <= max_false_abort and (r.steps_saved or 0.0) > 0
    ]
    recommended = max(ok, key=lambda r: (r.steps_saved or 0.0, -r.threshold)) if ok else None
    decisions = {c.name: abort_step(c, policy) for c in curves} if policy.abort_below is not None else {}
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
                w.writerow([c.name, c.outcome, i, len(c.scores), _fmt(s), _fmt(u), report.decisions.get(c.name, "")])
    with sweep.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["abort_below", "false_abort_rate", "failing_steps_saved", "aborted_failures", "aborted_successes"])
        for r in report.sweep:
            w.writerow(
                [r.threshold, _fmt(r.false_abort_rate), _fmt(r.steps_saved), r.aborted_failures, r.aborted_successes]
            )
    return [curves, sweep]


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def summary(report: Report) -> str:
    """The report as readable text."""
    lines = [f"{len(report.runs)} runs ({sum(c.success is True for c in report.runs)} success, "
             f"{sum(c.success is False for c in report.runs)} failure)"]  # fmt: skip
    lines.append("AUROC of the score against the outcome: " + ", ".join(
        f"at {int(q * 100)}% {_num(a)}" for q, a in report.auroc.items()))  # fmt: skip
    lines.append("value-order correlation (Spearman of score vs step), mean: " + ", ".join(
        f"{k} {_num(v)}" for k, v in report.spearman.items()))  # fmt: skip
    lines.append("")
    lines.append(f"{'abort_below':>11}  {'false aborts':>12}  {'failing steps saved':>19}")
    for r in report.sweep:
        mark = (
            "  <- recommended" if report.recommended is not None and r.threshold == report.recommended.threshold else ""
        )
        lines.append(f"{r.threshold:>11.2f}  {_pct(r.false_abort_rate):>12}  {_pct(r.steps_saved):>19}{mark}")
    lines.append("")
    if report.recommended is None:
        lines.append(
            f"no threshold saves failing runs' steps while keeping false aborts at or below "
            f"{report.max_false_abort:.0%}: do not let this judge abort runs yet"
        )
    else:
        r = report.recommended
        lines.append(
            f"recommended: --abort-below {r.threshold:.2f} (with --min-steps {report.policy.min_steps} --patience "
            f"{report.policy.patience}): false aborts {_pct(r.false_abort_rate)}, failing runs' steps saved {_pct(r.steps_saved)}"
        )
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def plot(report: Report, path: str | Path) -> Path:
    """A PNG: every run's curve coloured by outcome, and the threshold sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for c in report.runs:
        xs = [i / max(1, len(c.scores)) for i, s in enumerate(c.scores, 1) if s is not None]
        ys = [s for s in c.scores if s is not None]
        color = "#2a9d8f" if c.success else "#e76f51" if c.success is False else "#888888"
        ax1.plot(xs, ys, color=color, alpha=0.55, linewidth=1.4)
    ax1.plot([], [], color="#2a9d8f", label="success")
    ax1.plot([], [], color="#e76f51", label="failure")
    if report.recommended is not None:
        ax1.axhline(
            report.recommended.threshold, color="black", linestyle="--", linewidth=1, label="recommended abort_below"
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
    ax2.plot(ts, [r.steps_saved or 0 for r in report.sweep], color="#264653", label="failing runs' steps saved")
    ax2.axhline(report.max_false_abort, color="#e76f51", linestyle=":", linewidth=1)
    if report.recommended is not None:
        ax2.axvline(report.recommended.threshold, color="black", linestyle="--", linewidth=1)
    ax2.set(xlabel="abort_below", ylabel="share", ylim=(0, 1), xlim=(0, 1))
    ax2.set_title("Abort threshold sweep")
    ax2.legend(loc="upper left", fontsize=8)
    ax2.grid(alpha=0.3)
    good, bad = sum(c.success is True for c in report.runs), sum(c.success is False for c in report.runs)
    auc = report.auroc.get(0.5)
    fig.suptitle(
        f"{len(report.runs)} runs ({good} success, {bad} failure); AUROC at half-run "
        f"{'n/a' if auc is None else f'{auc:.2f}'}",
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
            {"name": c.name, "outcome": c.outcome, "scores": c.scores, "abort_step": report.decisions.get(c.name)}
            for c in report.runs
        ],
        "auroc": {str(q): a for q, a in report.auroc.items()},
        "spearman": report.spearman,
        "sweep": [dataclasses.asdict(r) for r in report.sweep],
        "recommended": dataclasses.asdict(report.recommended) if report.recommended else None,
    }
