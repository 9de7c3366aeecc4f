"""eval beside trivial baselines: AUROC/AUPRC with intervals, decisions on whole runs, the step
budget and done."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from agent_monitor.calibration import (
    Calibration,
    Family,
    Point,
    budget_threshold,
    done_margin,
    done_threshold,
    min_successes,
)
from agent_monitor.extractors import ErrorLines
from agent_monitor.offline import baselines as bl
from agent_monitor.offline import evaluate as ev
from agent_monitor.offline.recorded import RecordedRun, RecordedStep
from agent_monitor.policy import Policy, PolicyError, PolicyState
from agent_monitor.progress import Decision, Progress
from agent_monitor.testing import FakeJudge
from agent_monitor.tracker import ProgressTracker

SHORT, LONG = 6, 12


def made_runs(n: int = 8) -> list[RecordedRun]:
    """Successes are short with small texts; failures long with large ones (and errors); one task
    each pair."""
    out = []
    for i in range(n):
        task = f"task {i % 4}"
        ok = tuple(RecordedStep(f"ok {i} step {k}: [exit code 0]") for k in range(SHORT))
        bad = tuple(
            RecordedStep(f"bad {i} step {k}: " + "x" * (200 + 10 * i) + "\n[exit code 1]")
            for k in range(LONG)
        )
        out.append(RecordedRun(f"good-{i}", task, ok, 1.0))
        out.append(RecordedRun(f"bad-{i}", task, bad, 0.0))
    return out


def test_error_lines_counts_non_zero_exits_tracebacks_and_failed_tests() -> None:
    text = (
        "[exit code 0]\n[exit code 1]\nTraceback (most recent call last):\n  x\n=== 3 "
        "failed, 2 passed\nreturncode=0"
    )
    assert ErrorLines()(text).splitlines() == ["1", "Traceback (most recent call last)", "3 failed"]
    assert ErrorLines()("all good [exit code 0]") == ""


async def test_judge_that_says_the_same_is_chance_and_text_size_separates() -> None:
    judge = FakeJudge(lambda prompt: "K")  # the same letter for every step of every run
    curves = await ev.score_runs(made_runs(), judge=judge)
    report = bl.signal_report(curves, resamples=300, seed=1)
    step2 = next(v for v in report.views if v.name == "step 2")
    judge_fig, chars = step2.figures["judge"], step2.figures["chars"]
    assert judge_fig.auroc == pytest.approx(0.5) and judge_fig.auroc_ci is not None
    assert judge_fig.auroc_ci[0] <= 0.5 <= judge_fig.auroc_ci[1]
    assert judge_fig.p_value is not None and judge_fig.p_value > 0.5
    assert (
        chars.auroc is not None
        and chars.auroc > 0.95
        and chars.auroc_ci is not None
        and chars.auroc_ci[0] > 0.8
    )
    assert chars.p_value is not None and chars.p_value < 0.01
    # AUPRC for both: the constant judge sits at the failures' share, the text size at 1.
    assert judge_fig.auprc == pytest.approx(0.5) and chars.auprc == pytest.approx(1.0)
    assert judge_fig.auprc_ci is not None and chars.auprc_ci is not None
    # The fraction views are labelled as using the final length; the verdict names the best
    # baseline.
    assert [v.uses_final_length for v in report.views if "%" in v.name] == [True, True, True]
    assert (
        "not distinguishable from" not in report.verdict.text or report.verdict.baseline is not None
    )
    assert report.verdict.baseline in ("chars", "errors", "step_index")
    assert (
        "the judge is worse than" in report.verdict.text
        or "not distinguishable" in report.verdict.text
    )


def test_auroc_auprc_and_curves_on_known_values() -> None:
    assert bl.auroc_of([0.9, 0.8, 0.2, 0.1], [True, True, False, False]) == 1.0
    assert bl.auroc_of([0.5, 0.5, 0.5], [True, False, False]) == 0.5
    assert bl.auroc_of([0.2, 0.7, 0.4], [True, True, False]) == ev.auroc(
        [0.2, 0.7, 0.4], [True, True, False]
    )
    assert bl.auprc_of([0.9, 0.8, 0.2, 0.1], [True, False, True, False]) == pytest.approx(
        (1 + 2 / 3) / 2
    )
    assert bl.auprc_of([0.3, 0.3], [True, False]) == pytest.approx(0.5)
    assert bl.roc_points([0.9, 0.1], [True, False]) == [(0.0, 0.0), (0.0, 1.0), (1.0, 1.0)]


async def test_steps_saved_count_whole_runs_when_max_steps_limits_scoring() -> None:
    # every run scores 0: any threshold aborts at step 3 (min 2, patience 2)
    judge = FakeJudge(lambda prompt: "A")
    curves = await ev.score_runs(made_runs(2), judge=judge, max_steps=4)
    assert [len(c.scores) for c in curves] == [4, 4, 4, 4] and [c.steps for c in curves] == [
        SHORT,
        LONG,
    ] * 2
    report = ev.evaluate(curves, policy=Policy(min_steps=2, patience=2))
    row = next(r for r in report.sweep if r.threshold == 0.5)
    # Aborted at step 3 of a 12-step failure: 9 of its 12 steps saved (not 1 of the 4 scored).
    assert row.steps_saved == pytest.approx((LONG - 3) / LONG)
    # The simulation counts the same way; the fraction views find no score past what was scored.
    assert curves[1].score_at(0.75) is None


def test_simulated_step_budget_on_whole_runs_calibrated_on_other_tasks() -> None:
    rng = random.Random(3)
    curves = []
    for i in range(120):
        ok = i % 2 == 0
        n = rng.randint(5, 15) if ok else rng.randint(10, 40)
        curves.append(
            ev.RunCurve(
                f"r{i}",
                1.0 if ok else 0.0,
                [],
                family=Family(f"task {(i // 2) % 6}", "", ""),
                length=n,
                chars=list(range(1, n + 1)),
                errors=[0] * n,
            )
        )
    rules = {r.rule: r for r in bl.simulate(curves, policy=Policy(alpha=0.1), judged=False)}
    budget = rules["step_budget"]
    assert all(f.budget is not None for f in budget.folds)
    assert budget.steps_saved is not None and budget.steps_saved > 0.2
    assert budget.false_aborts.n == 60 and budget.false_aborts.ci is not None
    for name, at in budget.first_alert.items():
        c = next(c for c in curves if c.name == name)
        assert c.success is False and at <= c.steps
    text = bl.report_text(
        bl.signal_report(curves, judged=False, resamples=50), list(rules.values())
    )
    assert "step_budget" in text and "verdict: on these 120 runs (no judge)" in text


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_step_budget_false_abort_bound_over_exchangeable_runs(alpha: float) -> None:
    rng = random.Random(int(alpha * 100))
    n = min_successes(alpha) + 3
    trials = 4000
    aborted = 0
    for _ in range(trials):
        lengths = [1 + int(rng.expovariate(1 / 20)) for _ in range(n)]
        b = budget_threshold(lengths, alpha)
        assert b is not None
        new = 1 + int(rng.expovariate(1 / 20))
        aborted += new > b
    rate = aborted / trials
    # k / (n+1) <= alpha, ties only lower it; the tolerance covers the simulation's own noise (4
    # sd).
    assert rate <= alpha + 4 * (alpha * (1 - alpha) / trials) ** 0.5
    assert rate > alpha / 3  # and it does stop some: the bound is not met by never aborting


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_done_false_done_bound_over_exchangeable_failures(alpha: float) -> None:
    rng = random.Random(7 + int(alpha * 100))
    policy = Policy(min_steps=1, patience=2, alpha=alpha)
    n = min_successes(alpha) + 5
    trials = 3000

    def failure() -> tuple[Point, ...]:
        drift = rng.random()
        return tuple(
            Point(k, min(1.0, max(0.0, drift * 0.8 + rng.gauss(0, 0.1))), 0.1) for k in range(1, 11)
        )

    fired = 0
    for _ in range(trials):
        t = done_threshold([done_margin(failure(), policy) for _ in range(n)], alpha)
        assert t is not None
        state = PolicyState(dataclasses.replace(policy, done_above=t))
        signals = [state.observe(prog(p.step, p.score, p.uncertainty)).signal for p in failure()]
        fired += "done" in signals
    rate = fired / trials
    assert rate <= alpha + 4 * (alpha * (1 - alpha) / trials) ** 0.5
    assert rate > alpha / 3


def test_policy_step_budget_aborts_past_it_even_while_the_judge_fails() -> None:
    state = PolicyState(Policy(max_steps=3))
    # a fixed budget could stop this run: its outcome must not teach calibration
    assert state.exposed
    for k in (1, 2, 3):
        assert state.observe(prog(k, 0.9)).signal == "continue"
    d = state.observe(
        Progress(step=4, score=None, uncertainty=None, criteria={}, ok=False, reason="timeout")
    )
    assert d.signal == "abort" and d.reason.startswith(
        "step_budget: step 4 past the step budget of 3"
    )
    with pytest.raises(PolicyError, match="max_steps"):
        Policy(max_steps=0)
    with pytest.raises(PolicyError, match="done_above"):
        Policy(done_above=1.5)
    assert Policy(abort_below="auto", max_steps="auto", alpha=0.1).alphas() == (0.05, 0.05)
    assert Policy(max_steps="auto", alpha=0.1).alphas().budget == 0.1


def prog(step: int, score: float | None, uncertainty: float | None = 0.0) -> Progress:
    return Progress(step=step, score=score, uncertainty=uncertainty, criteria={}, ok=True)


def _decisions(tracker: ProgressTracker, n: int) -> list[Decision]:
    out = []
    for k in range(n):
        d = tracker.update(f"step {k}").signal
        assert d is not None
        out.append(d)
    return out


def _steps(tracker: ProgressTracker, n: int) -> list[str]:
    return [d.signal for d in _decisions(tracker, n)]


def test_live_step_budget_auto_learns_from_outcomes_and_aborts_with_its_reason() -> None:
    calibration = Calibration()
    policy = {"max_steps": "auto", "alpha": 0.2, "holdout": 0.0}
    needed = min_successes(0.2)  # 4
    judge = FakeJudge(lambda prompt: "P")
    for i in range(needed):
        with ProgressTracker(
            "fix it", judge=judge, policy=policy, calibration=calibration, run_id=f"s{i}"
        ) as t:
            assert "abort" not in _steps(t, 5 + i)  # not armed yet: runs teach
            assert t.finish("success") is not None
    assert (
        calibration.budget(next(iter(calibration.families())).family, Policy(**policy)).value == 8
    )  # type: ignore[arg-type]
    with ProgressTracker(
        "fix it", judge=judge, policy=policy, calibration=calibration, run_id="long"
    ) as t:
        decisions = _decisions(t, 12)
        signals = [d.signal for d in decisions]
        # step 9: the first past the budget of 8 (the longest of 4 at 0.2)
        assert signals.index("abort") == 8
        decision = decisions[8]
        assert (
            decision.reason.startswith("step_budget:")
            and ("calibrated on 4 successful runs") in decision.reason
        )
        # exposed to the budget: its outcome is censored, it teaches nothing
        assert t.finish("success") is None


def test_live_done_auto_calibrated_on_failures() -> None:
    calibration = Calibration()
    policy = {"done_above": "auto", "alpha": 0.2, "min_steps": 1, "patience": 2}
    low = FakeJudge(lambda prompt: "F")  # failures hold around 0.26
    for i in range(min_successes(0.2)):
        with ProgressTracker(
            "task d", judge=low, policy=policy, calibration=calibration, run_id=f"f{i}"
        ) as t:
            assert "done" not in _steps(t, 4)
            t.finish("failure")
    high = FakeJudge(lambda prompt: "S")
    with ProgressTracker(
        "task d", judge=high, policy=policy, calibration=calibration, run_id="ok"
    ) as t:
        signals = _steps(t, 4)
    assert signals[:2] == ["continue", "done"]  # two scored steps above the failures' threshold


def test_eval_baselines_only_writes_every_figure(tmp_path: Path) -> None:
    data = tmp_path / "runs"
    data.mkdir()
    for r in made_runs(4):
        (data / f"{r.name}.json").write_text(
            json.dumps({"task": r.task, "steps": [s.text for s in r.steps], "outcome": r.outcome})
        )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "agent_monitor",
        "eval",
        str(data),
        "--baselines-only",
        "--out",
        str(out),
        "--resamples",
        "50",
        "--at-steps",
        "3",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "verdict: on these 8 runs (no judge)" in done.stdout
    report = json.loads((out / "eval.json").read_text())
    # the run list is not overwritten
    assert len(report["runs"]) == 8 and report["runs_with_outcome"] == 8
    views = {v["view"]: v for v in report["views"]}
    assert {"step 2", "step 3", "step 4", "step 8", "step 16", bl.POOLED} <= set(views)
    chars = views["step 3"]["signals"]["chars"]
    assert set(views["step 3"]["signals"]) == {"step_index", "chars", "errors"}
    assert chars["auroc"] == 1.0 and len(chars["auroc_ci"]) == 2 and len(chars["auprc_ci"]) == 2
    assert "step_budget" in report["aborts"] and "false_aborts" in report["aborts"]["step_budget"]
    assert (out / "eval.png").read_bytes().startswith(b"\x89PNG")
